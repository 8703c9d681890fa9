"""The persistence process (``log.persistence: process``): ``python -m lowdiff._persist.child FD``.

Started by :class:`lowdiff._persist.process_writer.ProcessWriter` with one end of a Unix socket. It maps the shared
rings, turns each message into a :class:`~lowdiff._storage.segment.StepRecord` or snapshot whose tensors are views of
the ring, and feeds them to a :class:`~lowdiff._persist.thread_writer.BackgroundWriter` of its own, which batches,
encodes, writes, fsyncs, applies retention and keeps the shadow replica, exactly as the thread does in the training
process. Released records free their ring slots (a message back); every commit and failure is reported back. With
``log.when_behind: replica`` this process applies each record to the shadow replica itself as it arrives and logs
only what the writer has room for, covering the rest with snapshots of the replica (:meth:`_Session.submit`).

When the training process dies (the socket reaches end of file, or this process is re-parented), it commits every
record it received, the one whose iteration had not ended included when nothing tracked changes at the end of an
iteration, and exits. It holds RUN_DIR/persist-RANK.lock for its whole life (its trainer took it and handed it
over), so a trainer restarted meanwhile waits for it, never races it; rank 0's also takes the writer lock to commit.
It runs in a session of its own, so a signal to the trainer's process group (a Ctrl-C, torchrun's SIGTERM and then
SIGKILL to the ranks of a failed job) never reaches it; in its trainer's group it once died of torchrun's SIGTERM
while still importing torch, with every record it held. SIGINT and SIGTERM sent to it directly (a scheduler
signalling every process of a job) are ignored once its imports are done: the trainer gets them too, and this
process finishes the trainer's work after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import torch

from lowdiff._persist.thread_writer import BackgroundWriter
from lowdiff._storage.format import Shard
from lowdiff._storage.lock import WriterLock
from lowdiff._storage.packed import unpack as unpack_step
from lowdiff._storage.packed import unpack_skeleton
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Staged
from lowdiff._transfer.packing import remember
from lowdiff._transfer.ring import Arena
from lowdiff.errors import RunLockedError
from lowdiff.testing import apply_persistence_env

log = logging.getLogger("lowdiff.persist")

ORPHAN_LOCK_WAIT_S = 10.0
"""How long an orphaned persistence process tries to take the writer lock before giving up its records."""


class _Reporter:
    """Messages back to the training process, from this process's main and writer threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.gone = False
        self._gathering: int | None = None  # the thread whose frees are gathered into one message (gathered())
        self._gathered: list[tuple[str, int, int]] = []

    def send(self, msg: Any) -> None:
        if self.gone:
            return
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            try:
                self.conn.send_bytes(data)
            except OSError:
                self.gone = True  # the trainer is gone: keep committing, stop reporting

    def free(self, kind: str, ring_id: int, aid: int) -> None:
        if self._gathering == threading.get_ident():
            self._gathered.append((kind, ring_id, aid))
            return
        self.send(("free", [(kind, ring_id, aid)]))

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The slots this thread frees inside the block go back in one message at its end (a segment's records:
        one message for the trainer to read instead of one per step). Other threads' frees are sent at once."""
        self._gathering = threading.get_ident()
        try:
            yield
        finally:
            self._gathering = None
            frees, self._gathered = self._gathered, []
            if frees:
                self.send(("free", frees))


class _ChildWriter(BackgroundWriter):
    """The thread writer, reporting every commit and failure to the training process."""

    reporter: _Reporter

    def _cpu_s(self) -> float:
        return time.process_time()  # the whole process: this thread, and the main thread's unpacking and replica

    def _status(self) -> None:
        self.stats.cpu_s = self._cpu_s()
        self.reporter.send(("status", self.durable_step, dataclasses.astuple(self.stats), self._broken,
                            self.shadow_ok))

    def _fail(self, e: BaseException) -> None:
        super()._fail(e)
        with self._lock:
            err = self._error
            # Sent is reported (the trainer raises it): the next failure is recorded as itself. Unmarked, the writer
            # kept the first error and every later failure sent its text again (a fault probe: snapshots 15-30
            # failing were each reported as snapshot 10's failure).
            self._reported = True
        self.reporter.send(("error", err.args if err is not None else (None, repr(e))))

    def _write_batch(self) -> None:
        had = bool(self._batch)
        with self.reporter.gathered():
            super()._write_batch()
        if had:
            self._status()

    def _write_snapshot(self, staged: Staged[SnapshotState]) -> None:
        super()._write_snapshot(staged)
        self._status()


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(socket.socket(fileno=fd).detach())
    start = pickle.loads(conn.recv_bytes())
    logging.basicConfig(level=start["log_level"],
                        format="%(asctime)s %(levelname)s %(name)s[persist %(process)d] %(message)s")
    apply_persistence_env()  # lowdiff.testing's fault injection, when a test asked for it
    run_dir = RunDir(start["path"], Shard(*start["shard"]), compressor_params=start["compressor_params"])
    run_dir.run_id = start["run_id"]
    run_dir.branch = start["branch"]
    w = dict(start["writer"])
    if start["shadow"] is not None:
        # The replica's first optimizer step imports torch._dynamo (2 s here): before "ready", so that the wait
        # counts as start-up, not as a slow disk.
        import torch._dynamo  # noqa: F401
    reporter = _Reporter(conn)
    _ChildWriter.reporter = reporter
    writer = _ChildWriter(run_dir, batch_steps=w["batch_steps"], codec=w["codec"], compressor=w["compressor"],
                          queue_depth=w["queue_depth"], retention=RetentionPolicy(w["retention"]),
                          durable_step=w["durable_step"], shadow=start["shadow"])
    writer.reporter = reporter
    session = _Session(conn, writer, reporter, start["trainer_pid"], paced=w.get("when_behind") == "replica",
                       queue_depth=w["queue_depth"])
    reporter.send(("ready",))
    code = 0
    try:
        if not session.serve():
            session.orphaned(run_dir)
    except BaseException:
        # Never leave with the writer thread in the middle of a write: a daemon thread that stops at interpreter
        # exit while holding h5py's lock would hang the exit, and its file would stay uncommitted.
        log.exception("lowdiff: the persistence process of %s failed; committing what it holds", run_dir.path)
        code = 1
        try:
            writer.close()
        except BaseException:
            log.exception("lowdiff: closing the writer failed")
    finally:
        logging.shutdown()
    log.info("lowdiff: persistence process exits (%d)", code)
    os._exit(code)  # the writer thread has finished: skip interpreter teardown (h5py, torch) altogether


class _Session:
    def __init__(self, conn: Connection, writer: _ChildWriter, reporter: _Reporter, trainer_pid: int, *,
                 paced: bool = False, queue_depth: int = 1) -> None:
        self.conn = conn
        self.trainer_pid = trainer_pid
        self.writer = writer
        self.reporter = reporter
        self.rings: dict[str, tuple[int, Arena]] = {}
        self.pending: tuple[Staged[StepRecord], bool] | None = None
        self.layouts: dict[int, Any] = {}
        self.paced = paced and writer.shadow is not None
        """``log.when_behind: replica`` (LowDiff+): this thread applies every record to the replica as it arrives
        and logs it only when the writer has room; otherwise the step lives in the replica until a snapshot of the
        replica is written (:meth:`_bridge`)."""
        if self.paced:
            writer.apply_shadow = False
        self.gap = False
        """Records were left out of the log since the last snapshot of the replica was queued."""
        self.bridging = False
        """A snapshot of the replica is queued and not yet written (one at a time: each is a copy of the state)."""
        self.queue_depth = queue_depth
        self.held = 0
        """Records given to the writer and not yet written (copies: see :meth:`_own`), at most queue_depth x
        batch_steps."""
        self._held_lock = threading.Lock()

    def serve(self) -> bool:
        """Handle messages until ``close`` (True) or until the training process is gone (False)."""
        while True:
            try:
                if not self.conn.poll(1.0):
                    # Re-parented: the trainer is gone, though a process it forked (a DataLoader worker) may still
                    # hold its end of the socket. Compared with the trainer's pid, not with the parent found at
                    # start: the trainer may have died while this process was still importing torch.
                    if os.getppid() != self.trainer_pid:
                        return False
                    continue
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                return False
            try:
                if self.handle(msg):
                    return True
            except (EOFError, ConnectionError):  # the trainer died in the middle of handing a descriptor over
                return False

    def handle(self, msg: Any) -> bool:
        kind = msg[0]
        writer = self.writer
        if kind == "multi":
            return any([self.handle(m) for m in msg[1]])
        if kind == "rec":
            self._record(msg)
        elif kind == "seal":
            _, step, data, end_groups, rng = msg
            staged, _ = self._take_pending(step)
            staged.item.data = data
            staged.item.end_groups = end_groups
            if rng is not None:
                staged.item.rng = _rng_tensors(rng)
            self.submit(staged)
        elif kind == "rng":  # taken again after an evaluation (opt.capture_rng()); the iteration goes on
            _, step, rng = msg
            if self.pending is None or self.pending[0].item.step != step:
                raise RuntimeError(f"lowdiff persistence: an RNG state for step {step}, which is not held")
            self.pending[0].item.rng = _rng_tensors(rng)
        elif kind == "drop":
            staged, _ = self._take_pending(msg[1])
            staged.release()
        elif kind == "snap":
            _, step, regions, places, skel, rng, groups, comp_name, extra = msg
            ring = self.rings["s"][1]
            t = unpack_skeleton(skel, regions, places, ring.buf)
            state = SnapshotState(step=step, param_groups=groups, compressor_name=comp_name, extra=extra,
                                  rng=_rng_tensors(rng), **t)
            writer.submit_snapshot(Staged(state, None, lambda: self.reporter.free("s", 0, 0)))
        elif kind == "shadow":
            if self.paced:
                self.periodic_snapshot(msg[1])
            else:
                writer.submit_shadow_snapshot(msg[1])
        elif kind == "batch":
            writer.set_batch_steps(msg[1])
        elif kind == "flush":
            self.close_gap()
            writer.flush()
            writer._status()  # before "flushed": the trainer's flush() returns with these counters
            self.reporter.send(("flushed", msg[1]))
        elif kind == "arena":
            _, ring_kind, ring_id, nbytes = msg
            fd = recv_handle(self.conn)
            old = self.rings.get(ring_kind)
            self.rings[ring_kind] = (ring_id, Arena(nbytes, fd))
            if old is not None:
                old[1].close()
        elif kind == "close":
            writer.close()
            self.reporter.send(("closed",))
            return True
        return False

    def _record(self, msg: Any) -> None:
        _, step, ring_id, aid, offset, nbytes, layout_id, new_layout, rng, groups, data, skipped, keep = msg
        if new_layout is not None:
            remember(self.layouts, layout_id, new_layout)
        if self.pending is not None:  # cannot happen with a well-behaved trainer: never leave a slot behind
            log.error("lowdiff: step %d arrived before step %d ended; the latter is dropped", step,
                      self.pending[0].item.step)
            self.pending[0].release()
        rid, ring = self.rings["r"]
        assert rid == ring_id, (rid, ring_id)
        grads, buffers = unpack_step(self.layouts[layout_id], ring.buf[offset:offset + nbytes])
        rec = StepRecord(step=step, groups=groups, grads=grads, buffers=buffers, data=data, skipped=skipped,
                         rng=_rng_tensors(rng))
        self.pending = (Staged(rec, None, lambda: self.reporter.free("r", ring_id, aid)), keep)

    def _take_pending(self, step: int) -> tuple[Staged[StepRecord], bool]:
        if self.pending is None or self.pending[0].item.step != step:
            raise RuntimeError(f"lowdiff persistence: step {step} was never handed over")
        p, self.pending = self.pending, None
        return p

    # -- log.when_behind: replica -------------------------------------------------------------------------------

    def submit(self, staged: Staged[StepRecord]) -> None:
        """A record whose iteration has ended: to the log, or (paced, the writer behind) to the replica only."""
        writer = self.writer
        if not self.paced:
            writer.submit_record(staged)
            return
        rec = staged.item
        try:
            writer.shadow.apply(rec)
        except BaseException as e:
            self._replica_failed(rec.step, e)
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
        if self.paced and self.gap:
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

    def _replica_failed(self, step: int, e: BaseException) -> None:
        self.writer.shadow_ok = False  # reported with the next status: the trainer captures snapshots again
        self.paced = False
        log.error("lowdiff: shadow replica failed at step %d (%s); the log waits for the disk again%s", step, e,
                  "; the steps left out of the log before it are not on disk" if self.gap else "")

    def orphaned(self, run_dir: RunDir) -> None:
        """The training process is gone: commit what it handed over, under the writer lock, and return."""
        writer = self.writer
        log.info("lowdiff: the trainer of %s is gone; committing what it handed over", run_dir.path)
        lock: WriterLock | _NoLock | None = None
        if run_dir.shard.index != 0:  # under DDP rank 0 holds the job's lock; its persistence process takes it
            lock = _NoLock()
        deadline = time.monotonic() + ORPHAN_LOCK_WAIT_S
        while lock is None:
            try:
                lock = WriterLock(run_dir.path, holder="persistence process ")
            except RunLockedError:
                if time.monotonic() > deadline:
                    log.error("lowdiff: the trainer of %s died and another process holds its lock; %d step(s) "
                              "handed over after step %d are not committed", run_dir.path,
                              writer.batch_steps, writer.durable_step)
                    os._exit(3)
                time.sleep(0.01)
        try:
            if self.pending is not None:
                staged, keep = self.pending
                self.pending = None
                if keep:
                    # Nothing tracked changes after opt.step(): the iteration's end state is the step's own.
                    staged.item.end_groups = staged.item.groups
                    self.submit(staged)
                else:
                    log.warning("lowdiff: the trainer died during iteration %d, after its opt.step() but before "
                                "the iteration ended (objects tracked at='end' unknown); not logged, a resume "
                                "redoes it", staged.item.step)
                    staged.release()
            self.close_gap()  # the steps only the replica holds: a last snapshot of it
            durable = writer.flush()
            writer.close()
            log.warning("lowdiff: the trainer of %s is gone; the persistence process committed up to step %d",
                        run_dir.path, durable)
        finally:
            lock.release()


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


def _rng_tensors(rng: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """RNG states sent as bytes (lowdiff._persist.process_writer), as the uint8 tensors records and snapshots hold."""
    return {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in rng.items()}


class _NoLock:
    def release(self) -> None:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
