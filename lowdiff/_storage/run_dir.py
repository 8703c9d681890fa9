"""The run directory while training: the one object that knows its layout and commits into it.

Training code (the wrapper, the background writer, the tuner's decision record) and compaction talk to a
:class:`RunDir`; nothing else composes file names. Its life cycle, in call order (the role DCP's
``StorageWriter`` and orbax's ``TemporaryPath`` play):

1. :meth:`RunDir.open` (one rank: the lock stands for the whole job): create the layout, take the writer lock,
   remove ``*.tmp`` files an earlier crash left.
2. A new run: :meth:`write_snapshot` of step 0 (every rank its shard), then :meth:`commit_manifest` (one
   rank): the manifest commits the run. An existing run: :meth:`read_manifest`, and after recovery
   :meth:`quarantine_beyond` the resumed step (one rank), then :meth:`start_branch` (every rank).
3. While training (the writer thread): :meth:`write_segment` and :meth:`write_snapshot`, each an atomic commit
   (``*.tmp``, fsync, rename, directory fsync); :meth:`apply_retention` after a snapshot (one rank);
   :meth:`record_decisions` for the tuner.
4. :meth:`release`: the lock goes.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowdiff._storage import history
from lowdiff._storage.atomic import clean_stale_tmp, fsync_dir, write_json_atomic
from lowdiff._storage.format import (
    LOG_DIR,
    MANIFEST,
    SNAPSHOT_DIR,
    STOP_DIR,
    UNSHARDED,
    Shard,
    files_beyond,
    parse_snapshot_name,
)
from lowdiff._storage.lock import WriterLock, wait_for_persistence
from lowdiff._storage.manifest import (
    Manifest,
    check_compatible,
    config_changes,
    read_manifest,
    shared_run_id,
    write_history,
    write_manifest,
)
from lowdiff._storage.retention import apply_retention
from lowdiff._storage.segment import StepRecord, write_segment
from lowdiff._storage.snapshot import SnapshotState, write_snapshot
from lowdiff._storage.stop import StopState, prune_stops, write_stop
from lowdiff.errors import CheckpointWriteError

log = logging.getLogger(__name__)

DECISIONS_FILE = "tuner.json"
PERSISTENCE_WAIT_S = 300.0
"""How long a trainer waits for an earlier trainer's persistence processes to finish committing."""
"""Run-directory file holding every tuner decision of the run (a JSON object with a ``decisions`` list)."""
QUARANTINE_DIR = "quarantine"


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep: the newest ``keep_snapshots`` snapshots and the log segments they need (0: everything)."""

    keep_snapshots: int = 0

    def __post_init__(self) -> None:
        if self.keep_snapshots < 0:
            raise ValueError(f"keep_snapshots must be >= 0, got {self.keep_snapshots}")


class RunDir:
    """``path`` as this rank's writer sees it; ``shard``: which share of each snapshot and segment it writes."""

    def __init__(self, path: str | Path, shard: Shard = UNSHARDED, *,
                 compressor_params: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.shard = shard
        self.compressor_params = compressor_params
        """Recorded in every segment, so a reader can bound its payloads (Top-k ratio, PowerSGD rank)."""
        self.run_id: str | None = None
        """The id every file of the run is stamped with: the manifest's, known once the run is committed or read
        (None for a run written before run ids existed: its new files stay without one)."""
        self.branch: str | None = None
        """The history new files are stamped with (lowdiff._storage.history): the manifest's current branch, a new
        one from :meth:`start_branch` (a resume); None: the run's first history."""
        self.direct_io = True
        """Snapshots, segments and stop files are written past the page cache where the file system takes it
        (``log.direct_io``; lowdiff._storage.direct_io)."""
        self._lock: WriterLock | None = None

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r}, shard={self.shard.index}/{self.shard.count})"

    # -- opening -----------------------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the layout, take the writer lock and remove stale ``*.tmp`` files (one rank per job)."""
        try:
            for d in (self.path, self.path / SNAPSHOT_DIR, self.path / LOG_DIR, self.path / STOP_DIR):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointWriteError(e.errno, f"cannot create the run directory {self.path}: {e.strerror or e}",
                                       str(self.path)) from e
        self._lock = WriterLock(self.path)
        removed = clean_stale_tmp(self.path)
        if removed:
            log.info("lowdiff: removed %d uncommitted file(s) left by an earlier crash", len(removed))

    def wait_for_persistence(self, timeout_s: float = PERSISTENCE_WAIT_S, leader: bool = True) -> None:
        """Wait until no persistence process of an earlier trainer is still committing here (every rank, before
        :meth:`open` and before any rank starts persistence processes of its own): a resume then sees every step
        they were handed, on every rank's shard. The ``leader`` (the rank that takes the writer lock) refuses at once
        when the trainer of those processes is alive: a second job on one run directory."""
        wait_for_persistence(self.path, timeout_s, lambda: log.warning(
            "lowdiff: %s: waiting for the persistence process of an earlier trainer to finish committing", self.path),
            refuse_live_trainer=leader)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def has_run(self) -> bool:
        """Whether a run has been committed here (its manifest exists)."""
        return (self.path / MANIFEST).exists()

    def read_manifest(self) -> Manifest:
        return read_manifest(self.path)

    def check_compatible(self, current: Manifest) -> None:
        """The model and optimizer being wrapped must be the ones this run was written for; adopts its run id."""
        recorded = self.read_manifest()
        check_compatible(recorded, current, self.path)
        for change in config_changes(recorded, current):
            log.warning("lowdiff: resuming %s: %s", self.path, change)
        self.run_id = recorded.run_id
        self.branch = history.current(recorded.history)

    def new_run(self, manifest: Manifest, broadcast_ints: Callable[[list[int], str], list[int]]) -> None:
        """Start a new run: draw its id (rank 0's, broadcast, so every rank stamps the same) into ``manifest``.
        Then :meth:`write_snapshot` of step 0 on every rank and :meth:`commit_manifest` on one."""
        self.run_id = manifest.run_id = shared_run_id(broadcast_ints)

    def start_branch(self, step: int, broadcast_ints: Callable[[list[int], str], list[int]], commit: bool) -> None:
        """A resume continues from the state of ``step``, after :meth:`quarantine_beyond` moved every later file
        aside: new files go to a new branch (lowdiff._storage.history; its id drawn like the run id, the same on
        every rank), and a file of the history left behind, put back later, is refused. ``commit``: this rank writes
        the manifest (one rank, before any rank writes a file of the branch)."""
        branch = shared_run_id(broadcast_ints, "branch id")
        if commit:
            write_history(self.path, history.resumed(self.read_manifest().history, branch, step))
        self.branch = branch

    def own_step_zero(self) -> None:
        """After a resume at step 0, every rank has written snapshot 0 again under :attr:`branch` (weights loaded
        after ``wrap()``): record that the state at step 0 is now the branch's own (lowdiff._storage.history), so the
        old snapshot 0 put back from a backup is refused. One rank, once every rank's file is committed."""
        if self.branch is None:
            return
        owned = history.own_step_zero(self.read_manifest().history, self.branch)
        if owned is not None:
            write_history(self.path, owned)

    def commit_manifest(self, manifest: Manifest) -> None:
        """Commit the run: written last, after the step-0 snapshot, by one rank."""
        write_manifest(self.path, manifest)

    # -- committing ----------------------------------------------------------------------------------------------

    def write_snapshot(self, state: SnapshotState, codec: str) -> int:
        """Commit this rank's share of the snapshot at ``state.step``; returns the bytes written."""
        return write_snapshot(self.path, state, codec, self.shard, run_id=self.run_id, branch=self.branch,
                              direct=self.direct_io)

    def write_segment(self, records: Sequence[StepRecord], codec: str, compressor: str) -> int:
        """Commit this rank's share of the segment holding ``records`` (consecutive steps); returns bytes."""
        return write_segment(self.path, list(records), codec, compressor, self.shard, run_id=self.run_id,
                             branch=self.branch, compressor_params=self.compressor_params, direct=self.direct_io)

    def write_stop(self, state: StopState, codec: str) -> int:
        """Commit this rank's share of the stop file at ``state.step`` (FORMAT.md section 4a); returns bytes."""
        return write_stop(self.path, state, codec, self.shard, run_id=self.run_id, branch=self.branch,
                          direct=self.direct_io)

    def prune_stops(self, keep_step: int) -> list[Path]:
        """Delete the stop files of steps before ``keep_step`` (one rank: every shard goes)."""
        return prune_stops(self.path, keep_step) if self.shard.index == 0 else []

    def apply_retention(self, policy: RetentionPolicy) -> list[Path]:
        """Delete what ``policy`` does not keep (one rank: the files of every shard go together)."""
        if not policy.keep_snapshots or self.shard.index != 0:
            return []
        return apply_retention(self.path, policy.keep_snapshots)

    def quarantine_beyond(self, step: int) -> list[Path]:
        """Move files holding steps after ``step`` (damaged or unreachable) into ``quarantine/``, so new segments
        never collide with them. Nothing is deleted. Returns the new paths."""
        return self._quarantine(files_beyond(self.path, step), f"beyond the resumed step {step}")

    def quarantine_snapshot_sets(self, step: int, keep_count: int) -> list[Path]:
        """Move the files of the snapshot at ``step`` written by another number of ranks than ``keep_count`` into
        ``quarantine/`` (a resume on another number of fully_shard ranks rewrote that step in its own layout)."""
        moved = []
        for p in sorted((self.path / SNAPSHOT_DIR).iterdir()):
            parsed = parse_snapshot_name(p.name)
            if parsed is not None and parsed[0] == step and parsed[1].count != keep_count:
                moved.append(p)
        return self._quarantine(moved, f"rewritten at step {step} in the layout of {keep_count} rank(s)")

    def _quarantine(self, moved: list[Path], why: str) -> list[Path]:
        if not moved:
            return []
        qdir = self.path / QUARANTINE_DIR
        qdir.mkdir(exist_ok=True)
        out = []
        for p in moved:
            target = _unused(qdir, f"{p.parent.name}-{p.name}")
            shutil.move(str(p), target)
            out.append(target)
            log.warning("lowdiff: moved %s to %s (%s)", p, target, why)
        for d in (qdir, self.path / SNAPSHOT_DIR, self.path / LOG_DIR, self.path / STOP_DIR):
            if d.is_dir():
                fsync_dir(d)
        return out

    # -- the tuner's record --------------------------------------------------------------------------------------

    def read_decisions(self) -> list[dict[str, Any]]:
        """The tuner decisions an earlier process recorded ([] when none, or unreadable: said in the log)."""
        path = self.path / DECISIONS_FILE
        if not path.is_file():
            return []
        try:
            return list(json.loads(path.read_text())["decisions"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("lowdiff: ignoring unreadable %s (%s); the tuner starts from scratch", path, e)
            return []

    def record_decisions(self, decisions: list[dict[str, Any]]) -> None:
        path = self.path / DECISIONS_FILE
        try:
            write_json_atomic(path, {"decisions": decisions})
        except OSError as e:
            log.warning("lowdiff: could not record the tuner's decision in %s: %s", path, e)


def _unused(directory: Path, name: str) -> Path:
    """``directory / name``, or with ``.1``, ``.2``, ... before the suffix where that exists: a later rollback over the
    same steps must not replace the copy an earlier one moved aside (lowdiff never deletes what it quarantines)."""
    target = directory / name
    n = 0
    while target.exists():
        n += 1
        target = directory / f"{Path(name).stem}.{n}{Path(name).suffix}"
    return target
