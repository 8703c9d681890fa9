"""``lowdiff verify``: every check recovery makes, on every file of a run directory, plus decoding every payload.

Recovery reads only the files its chain needs and steps around a bad one; verify reads them all and reports every
file recovery would skip or refuse, so a run directory it passes recovers every step its snapshots and log cover.

>>> report = lowdiff._recovery.verify.verify("runs/exp1")   # doctest: +SKIP
>>> report.ok, report.problems                             # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowdiff._compressors import decode_payload
from lowdiff._recovery.api import check_optimizer
from lowdiff._recovery.optimizers import check_snapshot_state
from lowdiff._storage.format import DTYPES, STOP_DIR, list_segments, list_snapshots
from lowdiff._storage.layout import for_files
from lowdiff._storage.log_reader import chains, contested, contested_note
from lowdiff._storage.manifest import Manifest, read_manifest
from lowdiff._storage.remote import fetched, is_url
from lowdiff._storage.segment import SegmentReader
from lowdiff._storage.snapshot import read_rank_state, read_snapshot
from lowdiff._storage.stop import read_stop
from lowdiff.errors import CorruptFileError, FileVanishedError, LowDiffError


@dataclass
class VerifyReport:
    run_dir: Path | str
    files: int = 0
    """Snapshots and segments checked (a sharded one counts once)."""
    problems: list[str] = field(default_factory=list)
    """One line per file recovery would skip or refuse (or per gap in the log), naming it and what is wrong."""
    vanished: list[str] = field(default_factory=list)
    """Files deleted while verify ran (retention of a live trainer): not problems."""
    latest_step: int | None = None
    """The newest step the files that passed reach (None: none does)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.ok:
            reach = "" if self.latest_step is None else f"; recoverable up to step {self.latest_step}"
            return (f"verify: OK ({self.files} files: every checksum, run id, name, shape, value and payload checked, "
                    f"and the log's contiguity{reach})")
        lines = [f"BAD  {p}" for p in self.problems]
        n = len(self.problems)
        # No file checked: the manifest could not be read (nothing can be checked without it), or there is none.
        checked = (f"{self.files} file{'' if self.files == 1 else 's'} checked" if self.files else
                   "no snapshot, segment or stop file checked")
        lines.append(f"verify: {n} problem{'' if n == 1 else 's'}; {checked}"
                     + ("" if self.latest_step is None else f"; the files that passed reach step {self.latest_step}"))
        return "\n".join(lines)


def verify(run_dir: str | os.PathLike[str], *, optimizer_class: type | None = None, progress: Any = None,
           storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Check every file of ``run_dir`` as recovery would and decode every logged payload. Never writes.

    A missing run directory raises :class:`~lowdiff.errors.RunDirNotFoundError`; everything else wrong is a
    line in ``problems`` (a bad manifest is the only one: nothing else can be checked without it). A URL
    (``s3://bucket/prefix``) is fetched into a temporary directory and checked there (lowdiff._storage.remote)."""
    if is_url(run_dir):
        with fetched(str(run_dir), storage_options, progress=progress is not None) as local:
            report = verify(local, optimizer_class=optimizer_class, progress=progress)
        report.problems = [p.replace(str(local), str(run_dir).rstrip("/")) for p in report.problems]
        report.run_dir = str(run_dir)
        return report
    root = Path(run_dir)
    report = VerifyReport(run_dir=root)
    try:
        manifest = read_manifest(root)
    except CorruptFileError as e:
        report.problems.append(str(e))
        return report
    cls: type | None = None
    try:
        cls = check_optimizer(root, manifest, optimizer_class)
    except LowDiffError as e:
        report.problems.append(str(e))
    bad: set[Path] = set()
    for _step, files in list_snapshots(root).items():
        report.files += 1
        try:
            stored = for_files(manifest, files)  # a fully_shard run's shards (format 2.3)
            snap = read_snapshot(files, stored)
            if cls is not None:
                check_snapshot_state(stored, cls, snap)
            for rank in range(len(files.paths) if len(files.paths) > 1 else 0):
                read_rank_state(files, stored, rank)  # each rank's own compressor memory (FORMAT.md section 4)
        except FileVanishedError as e:
            report.vanished.append(str(e))
        except LowDiffError as e:
            report.problems.append(str(e))
            bad.update(files.paths)
        if progress is not None:
            progress(1)
    snapshot_steps = set(list_snapshots(root))
    reach = None
    for first, last, files in list_segments(root):
        report.files += 1
        # A gap the log goes on from a snapshot after is what resume(at="snapshot") leaves: nothing is lost.
        if reach is not None and first > reach + 1 and first - 1 not in snapshot_steps:
            report.problems.append(f"log gap: no segment holds steps {reach + 1}-{first - 1} and no snapshot is at "
                                   f"step {first - 1}, so {files.name} extends no earlier snapshot")
        reach = last if reach is None else max(reach, last)
        try:
            _check_segment(for_files(manifest, files), files, first, last)
        except FileVanishedError as e:
            report.vanished.append(str(e))
        except LowDiffError as e:
            report.problems.append(str(e))
            bad.update(files.paths)
        if progress is not None:
            progress(1)
    for _step, files in list_snapshots(root, STOP_DIR).items():  # a clean stop's compressor memory (section 4a)
        report.files += 1
        try:
            stored = for_files(manifest, files)
            ranks: list[int | None] = list(range(len(files.paths))) if len(files.paths) > 1 else [None]
            for who in ranks:
                read_stop(files, stored, who)
        except FileVanishedError as e:
            report.vanished.append(str(e))
        except LowDiffError as e:
            report.problems.append(str(e))
        if progress is not None:
            progress(1)
    report.problems += [contested_note(a, b) for a, b in contested(root, frozenset(bad))]
    ends = [c.end for c in chains(root, frozenset(bad))]
    report.latest_step = max(ends) if ends else None
    if not snapshot_steps:  # every replay starts from a snapshot: the log alone rebuilds nothing
        report.problems.append(f"{root}: no committed snapshot (snapshots/ is empty or missing), so no step can be "
                               "recovered; restore the snapshots from a backup")
    return report


def _check_segment(manifest: Manifest, files: Any, first: int, last: int) -> None:
    """Read every column of the segment and decode every payload with the function training and replay share."""
    with SegmentReader(files, manifest, first, last) as r:
        for sd in r.read_steps(None, with_buffers=True):
            for name, payload in sd.grads.items():
                spec = manifest.param(name)
                try:
                    g = decode_payload(payload, spec.shape)
                except CorruptFileError as e:
                    raise CorruptFileError(f"{files} (step {sd.step}) [{name}]: {e}", path=files.paths[0],
                                           step=sd.step) from e
                if g.dtype != DTYPES[spec.dtype] or tuple(g.shape) != spec.shape:
                    raise CorruptFileError(f"{files} (step {sd.step}) [{name}]: decodes to {g.dtype}"
                                           f"{list(g.shape)}, the parameter is {spec.dtype}{list(spec.shape)}",
                                           path=files.paths[0], step=sd.step)
