"""The compressor memory of a clean stop (FORMAT.md section 4a), used when recovery's target is the stop's step.

Replay rebuilds parameters and optimizer state at any logged step, but not the compressors' error-feedback
residuals: at a step between two snapshots recovery has them only where a clean stop saved them, at its very step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lowdiff._storage import layout
from lowdiff._storage.format import STOP_DIR, FileSet, list_snapshots
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.stop import StopState, read_stop
from lowdiff.errors import CorruptFileError, FileVanishedError

log = logging.getLogger("lowdiff._recovery.api")


def stop_at(root: Path, manifest: Manifest, step: int, rank: int | None, layout_count: int,
            skipped: list[str]) -> tuple[StopState, FileSet] | None:
    """The stop file set at ``step`` and its memory (with rank ``rank``'s own), when one is there, is whole and
    belongs here, and was written in the layout the recovered state is in (``layout_count`` files: a fully_shard
    run's stop is in its shards' names). A damaged or foreign one is reported in ``skipped`` and left out: only the
    compressor's memory is lost by that, never the parameters or the optimizer's state."""
    files = list_snapshots(root, STOP_DIR).get(step)
    if files is None:
        return None
    if layout.layout_of(manifest, files) != layout_count:
        log.info("recovery: %s was written by another number of fully_shard ranks than the chain it would join; "
                 "not used", files)
        return None
    try:
        return read_stop(files, layout.for_files(manifest, files), rank), files
    except FileVanishedError:
        return None
    except CorruptFileError as e:
        log.warning("recovery: %s; the compressor's memory at step %d is not restored from it", e, step)
        skipped.append(str(e))
        return None
