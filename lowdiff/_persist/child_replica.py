"""``log.when_behind: replica`` in the persistence process (LowDiff+ with a disk slower than the log).

The persistence process applies every record to the shadow replica as it arrives and logs it only while the writer
has room; when the disk is behind, the step lives in the replica (training does not wait), and the log resumes
after the next snapshot of the replica, which covers it. Used by lowdiff/_persist/child.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from lowdiff._persist.thread_writer import BackgroundWriter
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Staged

log = logging.getLogger("lowdiff.persist")


class PacedReplica:
    """Decides, per record whose iteration has ended, whether it goes to the log or lives only in the replica."""

    def __init__(self, writer: BackgroundWriter, queue_depth: int) -> None:
        self.writer = writer
        self.active = writer.shadow is not None
        """False once the replica failed: every record goes to the log again, waiting for the disk."""
        if self.active:
            writer.apply_shadow = False  # this process's main thread applies the records itself
        self.gap = False
        """Records were left out of the log since the last snapshot of the replica was queued."""
        self.bridging = False
        """A snapshot of the replica is queued and not yet written (one at a time: each is a copy of the state)."""
        self.queue_depth = queue_depth
        self.held = 0
        """Records given to the writer and not yet written (copies: see :meth:`_own`), at most queue_depth x
        batch_steps."""
        self._held_lock = threading.Lock()

    def submit(self, staged: Staged[StepRecord]) -> None:
        """A record whose iteration has ended: to the log, or (the writer behind) to the replica only."""
        writer = self.writer
        if not self.active:
            writer.submit_record(staged)
            return
        rec = staged.item
        try:
            writer.shadow.apply(rec.unpacked())
        except BaseException as e:
            self._failed(rec.step, e)
            writer.submit_record(staged)
            return
        if not self.gap and self.held < self.queue_depth * writer.batch_steps and writer.room() >= 1:
            self._own(staged)
            writer.submit_record(staged)
            return
        # The disk is behind: the step lives in the replica (training does not wait), and the log resumes after
        # the next snapshot of the replica, which covers it.
        self.gap = True
        writer.stats.steps_skipped += 1
        staged.release()
        if not self.bridging and writer.room() >= 2:
            self._bridge()

    def _own(self, staged: Staged[StepRecord]) -> None:
        """A record for the writer, copied out of the ring and its slot given back now. The ring is first in, first
        out: a record the slow writer held would keep every later slot from being reused, dropped ones included,
        and training would wait for the disk after all (or for good, with the writer waiting for a batch to
        fill)."""
        rec = staged.item
        rec.grads = {n: {f: t.clone() for f, t in p.items()} for n, p in rec.grads.items()}
        rec.buffers = {n: t.clone() for n, t in rec.buffers.items()}
        if rec.packed is not None:
            rec.packed = rec.packed.owned()
        staged.release()
        with self._held_lock:
            self.held += 1

        def written() -> None:  # on the writer's thread, once the record is written (or dropped)
            with self._held_lock:
                self.held -= 1

        staged.release_fn = written

    def periodic_snapshot(self, step: int) -> None:
        """The trainer's snapshot step (the replica has applied it): a snapshot of the replica if the writer has
        room; skipped when the disk is behind (the next one, or the snapshot that closes a gap, takes its place)."""
        writer = self.writer
        if writer.shadow_ok and writer.shadow.step == step and not self.bridging and writer.room() >= 2:
            self._bridge()

    def close_gap(self) -> None:
        """Before a flush and when the trainer is gone: the steps only the replica holds go to disk as a snapshot
        of it (waiting for the writer if need be)."""
        if self.active and self.gap:
            if self.writer.shadow_ok:
                self._bridge()
            else:
                log.error("lowdiff: the shadow replica failed; the steps left out of the log since the last "
                          "snapshot are not on disk")

    def _bridge(self) -> None:
        """Queue a snapshot of the replica as it is now: a copy, since this thread goes on applying steps."""
        writer = self.writer
        state = _owned_copy(writer.shadow.snapshot())
        self.bridging, self.gap = True, False

        def written() -> None:
            self.bridging = False

        writer.cut()  # the records before the gap form a segment of their own
        writer.submit_snapshot(Staged(state, None, written))

    def _failed(self, step: int, e: BaseException) -> None:
        self.writer.shadow_ok = False  # reported with the next status: the trainer captures snapshots again
        self.active = False
        log.error("lowdiff: shadow replica failed at step %d (%s); the log waits for the disk again%s", step, e,
                  "; the steps left out of the log before it are not on disk" if self.gap else "")


def _owned_copy(state: SnapshotState) -> SnapshotState:
    """``state`` with every tensor copied (a replica's snapshot holds its live tensors)."""

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.detach().clone()
        if isinstance(obj, dict):
            return {k: copy(v) for k, v in obj.items()}
        return obj

    return dataclasses.replace(state, params=copy(state.params), buffers=copy(state.buffers),
                               optimizer_state=copy(state.optimizer_state),
                               compressor_state=copy(state.compressor_state), rng=copy(state.rng),
                               extra=dict(state.extra))
