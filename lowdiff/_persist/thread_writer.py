"""The background writer: batches step records into segments and persists snapshots off the training thread.

The queue is bounded (back-pressure: a slow disk blocks ``submit`` instead of growing memory). A failure is
stored and re-raised in the training thread by :meth:`BackgroundWriter.check`; after it, records are dropped
until the next snapshot commits, since a log with a hole cannot be replayed past it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lowdiff._persist.gc_pause import collector_paused
from lowdiff._persist.mirror import Mirror
from lowdiff._persist.writer import WriterEvents, WriterStats
from lowdiff._storage.later import Later
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import HostSlots, Staged
from lowdiff.errors import CheckpointWriteError

log = logging.getLogger(__name__)


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _SetBatchSteps:
    """Close the open segment here (after the records queued before this item) and batch ``steps`` per segment
    from the next record on (None: as before)."""

    steps: int | None


@dataclass
class ShadowSnapshot:
    """Write a snapshot of the shadow replica, which has applied every record up to ``step``."""

    step: int


_CLOSE = object()


class BackgroundWriter:
    """The :class:`lowdiff._persist.writer.Writer` of ``log.persistence: thread``, and the writer inside a
    persistence process (which passes ``events`` to report to its trainer). Records reach it when their iteration
    ends (:meth:`submit_record`); :meth:`submit_early`, :meth:`retake_rng` and :meth:`drop` have nothing to do
    here."""

    def __init__(self, run_dir: RunDir, *, batch_steps: int, codec: str, compressor: str, queue_depth: int,
                 retention: RetentionPolicy, durable_step: int, shadow: Any = None,
                 when_behind: str = "wait", events: WriterEvents | None = None,
                 remote: Mapping[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.batch_steps = batch_steps
        self.codec = codec
        self.compressor = compressor
        self.retention = retention
        self.shadow = shadow
        self.shadow_ok = shadow is not None
        self.apply_shadow = True
        """Whether this thread applies each record to the replica (a paced persistence process applies them itself,
        lowdiff._persist.child)."""
        self.stats = WriterStats()
        self.events = events if events is not None else WriterEvents()
        self.slots = HostSlots()
        """The host buffers the training thread packs step records into (lowdiff._training.stager.Slots)."""
        self._queue_depth = queue_depth
        self._durable_step = durable_step
        self._error: BaseException | None = None
        self._reported = False
        self._broken = False
        self._lost = -1  # the latest step of a record dropped (not written) so far
        self._batch: list[Staged[StepRecord]] = []
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_depth * batch_steps + 2)
        self._lock = threading.Lock()
        self.mirror: Mirror | None = None
        """``remote``: the mirror to object storage (rank 0's writer uploads every rank's files)."""
        if remote is not None and run_dir.shard.index == 0:
            self.mirror = Mirror(run_dir.path, remote, self.stats, durable_step=durable_step,
                                 on_progress=self.events.committed)
        self._thread = threading.Thread(target=self._run, name="lowdiff-writer", daemon=True)
        self._thread.start()

    @property
    def durable_step(self) -> int:
        with self._lock:
            return self._durable_step

    def _put(self, item: Any) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            t0 = time.perf_counter()
            self._queue.put(item)
            self.stats.blocked_s += time.perf_counter() - t0

    def _put_control(self, item: Any) -> None:
        """Queue a control item (a cut, a batch size) past the bound: it holds no data, and whoever queues it must
        not wait for the disk (the training thread; the persistence process's main thread, which goes on applying
        steps to the replica with ``log.when_behind: replica``)."""
        q = self._queue
        with q.mutex:  # queue.Queue's own lock and fields: put() without its bound
            q.queue.append(item)
            q.unfinished_tasks += 1
            q.not_empty.notify()

    def submit_early(self, record: Staged[StepRecord], keep_if_orphaned: bool) -> None:
        """Nothing: a thread dies with the trainer, so it takes the record when its iteration ends."""

    def retake_rng(self, record: Staged[StepRecord]) -> None:
        """Nothing: the record reaches this writer with the RNG state its iteration ended with."""

    def before_seal(self) -> None:
        """Nothing: the record reaches this writer when it is sealed."""

    def drop(self, step: int) -> None:
        """Nothing: an interrupted iteration's record never reached this writer."""

    def end_known(self, record: Staged[StepRecord], data: dict[str, Any], end_groups: list[dict[str, Any]],
                  later: Sequence[Later] = ()) -> None:
        """Nothing: the record reaches this writer when its iteration ends."""

    def submit_record(self, record: Staged[StepRecord]) -> None:
        self._put(record)

    def submit_snapshot(self, state: Staged[SnapshotState]) -> None:
        self._put(state)

    def room(self) -> int:
        """Items the queue takes now without blocking."""
        return max(self._queue.maxsize - self._queue.qsize(), 0)

    def cut(self) -> None:
        """Write the records queued so far as a segment before what is submitted next (the batch size stays); the
        caller does not wait."""
        self._put_control(_SetBatchSteps(None))  # not self.batch_steps: a change queued before it still applies

    @property
    def capacity(self) -> int:
        """Items the queue holds before ``submit`` blocks: ``queue_depth`` segments' worth of records + 2."""
        return self._queue.maxsize

    @property
    def queued(self) -> int:
        """Items waiting in the queue (records, snapshots, control items)."""
        return self._queue.qsize()

    def submit_shadow_snapshot(self, step: int) -> None:
        self._put(ShadowSnapshot(step))

    def set_batch_steps(self, steps: int) -> None:
        """Cut the open segment after the records submitted so far and continue with ``steps`` per segment.

        Queued in order with the records, so the cut lands exactly here; the caller does not wait, also when the
        queue is full or the new bound is below what it holds. The queue bound follows (``queue_depth * steps + 2``
        items)."""
        if steps < 1:
            raise ValueError(f"batch_steps must be >= 1, got {steps}")
        q = self._queue
        with q.mutex:
            q.maxsize = self._queue_depth * steps + 2
            q.not_full.notify_all()
        self._put_control(_SetBatchSteps(steps))

    def flush(self) -> int:
        """Write the partial batch and wait until everything submitted is committed (or failed)."""
        f = _Flush()
        self._put(f)
        f.done.wait()
        return self.durable_step

    def close(self) -> None:
        """Commit everything handed over; then wait for the mirror (up to ``remote.close_timeout_s``)."""
        if self._thread.is_alive():
            self.flush()
            self._queue.put(_CLOSE)
            self._thread.join()
        if self.mirror is not None:
            self.mirror.kick(self.durable_step)
            self.mirror.close()
            self.mirror = None

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def error(self) -> BaseException | None:
        """The background failure in force (reported or not), None while healthy."""
        with self._lock:
            return self._error if self._broken else None

    def take_error(self) -> BaseException | None:
        """The first background failure not yet reported (each is reported once)."""
        with self._lock:
            if self._error is None or self._reported:
                return None
            self._reported = True
            return self._error

    # -- writer thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            if isinstance(item, _Flush):
                self._write_batch()
                item.done.set()
            elif isinstance(item, Staged) and isinstance(item.item, StepRecord):
                item.wait()  # kept packed until written (StepRecord.unpacked), off the training thread
                if self.shadow_ok and self.apply_shadow:
                    self._apply_shadow(item.item.unpacked())
                if self._broken:
                    self._drop([item])
                    continue
                self._batch.append(item)
                if len(self._batch) >= self.batch_steps:
                    self._write_batch()
            elif isinstance(item, Staged):
                try:
                    item.wait()
                except Exception as e:  # the copy thread's copy failed: there is nothing whole to write
                    log.error("lowdiff: the snapshot of step %d was not copied (%s); it is not written (recovery "
                              "replays from the snapshot before it)", item.item.step, e)
                    item.release()
                    continue
                self._write_snapshot(item)
            elif isinstance(item, _SetBatchSteps):
                self._write_batch()
                if item.steps is not None:
                    self.batch_steps = item.steps
            elif isinstance(item, ShadowSnapshot):
                if self.shadow_ok and self.shadow.step == item.step:
                    self._write_snapshot(Staged(self.shadow.snapshot()))
            self.stats.cpu_s = self.events.cpu_clock()

    def _apply_shadow(self, record: StepRecord) -> None:
        try:
            self.shadow.apply(record)
        except BaseException as e:
            # From here on snapshots are captured on the training thread again (Checkpointer checks shadow_ok).
            self.shadow_ok = False
            log.error("lowdiff: shadow replica failed at step %d (%s); snapshots fall back to the training "
                      "thread", record.step, e)

    def _fail(self, e: BaseException) -> None:
        log.error("lowdiff background write failed: %s", e)
        with self._lock:
            if self._error is None or self._reported:
                self._error = e if isinstance(e, CheckpointWriteError) else CheckpointWriteError(
                    None, f"background write in {self.run_dir.path} failed: {e!r}")
                self._reported = False
            err = self._error
        self._broken = True
        self._drop(self._batch)
        self._batch = []
        if self.events.failed is not None:
            self.events.failed(err)
            with self._lock:
                # Reported by the callback: the next failure is recorded as itself. Unmarked, the writer kept the
                # first error and every later failure was reported with its text (a fault probe: snapshots 15-30
                # failing were each reported as snapshot 10's failure).
                self._reported = True

    def _drop(self, records: list[Staged[StepRecord]]) -> None:
        """Records that will not be written: their buffers go back (in a persistence process, ring slots the
        trainer would otherwise wait for once the ring wraps)."""
        for r in records:
            self._lost = max(self._lost, r.item.step)
            r.release()

    def _write_batch(self) -> None:
        if not self._batch:
            return
        with self.events.writing_segment():
            self._write_segment()
        self.events.committed()
        if self.mirror is not None:
            self.mirror.kick(self.durable_step)

    def _write_segment(self) -> None:
        if self._broken:
            self._drop(self._batch)
            self._batch = []
            return
        batch, self._batch = self._batch, []
        t0 = time.perf_counter()
        try:
            with collector_paused():  # the unpacked records die young (lowdiff._persist.gc_pause)
                nbytes = self.run_dir.write_segment([r.item for r in batch], self.codec, self.compressor)
        except BaseException as e:
            self._fail(e)
            return
        finally:
            for r in batch:
                r.release()
        self.stats.write_s += time.perf_counter() - t0
        self.stats.segments += 1
        self.stats.log_steps += len(batch)
        self.stats.log_bytes += nbytes
        with self._lock:
            self._durable_step = max(self._durable_step, batch[-1].item.step)

    def _write_snapshot(self, staged: Staged[SnapshotState]) -> None:
        self._commit_snapshot(staged)
        self.events.committed()
        if self.mirror is not None:
            self.mirror.kick(self.durable_step)

    def _commit_snapshot(self, staged: Staged[SnapshotState]) -> None:
        state = staged.item
        t0 = time.perf_counter()
        try:
            with collector_paused():
                nbytes = self.run_dir.write_snapshot(state, self.codec)
        except BaseException as e:
            self._fail(e)
            return
        finally:
            staged.release()  # its host buffers serve the next snapshot
        self.stats.write_s += time.perf_counter() - t0
        self.stats.snapshots += 1
        self.stats.snapshot_bytes += nbytes
        if self._broken and self._lost > state.step:
            # A persistence process hands a snapshot over once its GPU copies complete, after the records of the
            # steps since: the log resumes only from a snapshot after every record dropped.
            log.warning("lowdiff: snapshot at step %d committed; step %d after it was not written, so checkpointing "
                        "resumes at the next snapshot", state.step, self._lost)
        elif self._broken:
            log.warning("lowdiff: snapshot at step %d committed; checkpointing resumes from it", state.step)
            self._broken = False
            self._drop([r for r in self._batch if r.item.step <= state.step])
            self._batch = [r for r in self._batch if r.item.step > state.step]
        with self._lock:
            self._durable_step = max(self._durable_step, state.step)
        self.run_dir.apply_retention(self.retention)
