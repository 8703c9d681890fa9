"""The persistence process (``log.persistence: process``): ``python -m lowdiff._persist.child FD``.

Started by :class:`lowdiff._persist.process_writer.ProcessWriter` with one end of a Unix socket. It maps the shared
rings, turns each message (lowdiff/_persist/messages.py) into a :class:`~lowdiff._storage.segment.StepRecord` or
snapshot whose tensors are views of the ring, and feeds them to a
:class:`~lowdiff._persist.thread_writer.BackgroundWriter` of its own, which batches, encodes, writes, fsyncs, applies
retention and keeps the shadow replica, exactly as the thread does in the training process. Released records free
their ring slots (a message back); every commit and failure is reported back through the writer's events. With
``log.when_behind: replica`` the records go through a :class:`~lowdiff._persist.child_replica.PacedReplica`.

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
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import torch

from lowdiff._persist import messages as m
from lowdiff._persist.child_replica import PacedReplica
from lowdiff._persist.mailbox import Inbox
from lowdiff._persist.thread_writer import BackgroundWriter
from lowdiff._persist.writer import WriterEvents
from lowdiff._storage import atomic
from lowdiff._storage.format import Shard
from lowdiff._storage.lock import WriterLock
from lowdiff._storage.packed import Received, unpack_skeleton
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Staged
from lowdiff._transfer.packing import remember
from lowdiff._transfer.ring import Arena
from lowdiff.errors import RunLockedError

log = logging.getLogger("lowdiff.persist")

ORPHAN_LOCK_WAIT_S = 10.0
"""How long an orphaned persistence process tries to take the writer lock before giving up its records."""


class Reporter:
    """Messages back to the training process, from this process's main and writer threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.gone = False
        self.writer: BackgroundWriter | None = None
        self._gathering: int | None = None  # the thread whose frees are gathered into one message (gathered())
        self._gathered: list[tuple[str, int, int]] = []

    def send(self, msg: Any) -> None:
        if self.gone:
            return
        data = m.encode(msg)
        with self.lock:
            try:
                self.conn.send_bytes(data)
            except OSError:
                self.gone = True  # the trainer is gone: keep committing, stop reporting

    def free(self, kind: str, ring_id: int, aid: int) -> None:
        if self._gathering == threading.get_ident():
            self._gathered.append((kind, ring_id, aid))
            return
        self.send(m.Freed([(kind, ring_id, aid)]))

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
                self.send(m.Freed(frees))

    def status(self) -> None:
        """The writer's durable step and counters (after every commit, and before answering a flush)."""
        writer = self.writer
        if writer is None:
            return
        writer.stats.cpu_s = time.process_time()
        self.send(m.Status(writer.durable_step, dataclasses.astuple(writer.stats), writer.error is not None,
                           writer.shadow_ok))

    def failed(self, err: BaseException) -> None:
        self.send(m.Failed(err.args))

    def events(self) -> WriterEvents:
        # The whole process's CPU time: the writer thread's, and the main thread's unpacking and replica.
        return WriterEvents(committed=self.status, failed=self.failed, writing_segment=self.gathered,
                            cpu_clock=time.process_time)


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(socket.socket(fileno=fd).detach())
    start: m.Start = m.decode(conn.recv_bytes())
    logging.basicConfig(level=start.log_level,
                        format="%(asctime)s %(levelname)s %(name)s[persist %(process)d] %(message)s")
    atomic.seam_from_environment()  # lowdiff.testing's fault injection, when a test asked for it
    run_dir = RunDir(start.path, Shard(*start.shard), compressor_params=start.compressor_params)
    run_dir.run_id = start.run_id
    run_dir.branch = start.branch
    w = start.writer
    run_dir.direct_io = bool(w.get("direct_io", True))
    if start.shadow is not None:
        # The replica's first optimizer step imports torch._dynamo (2 s here): before Ready, so that the wait
        # counts as start-up, not as a slow disk.
        import torch._dynamo  # noqa: F401
    reporter = Reporter(conn)
    writer = BackgroundWriter(run_dir, batch_steps=w["batch_steps"], codec=w["codec"], compressor=w["compressor"],
                              queue_depth=w["queue_depth"], retention=RetentionPolicy(w["retention"]),
                              durable_step=w["durable_step"], shadow=start.shadow, events=reporter.events(),
                              remote=w.get("remote"))
    reporter.writer = writer
    paced = w.get("when_behind") == "replica" and start.shadow is not None
    session = Session(conn, writer, reporter, start.trainer_pid,
                      replica=PacedReplica(writer, w["queue_depth"]) if paced else None)
    reporter.send(m.Ready())
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


class Session:
    """One trainer's messages, handled in order (lowdiff/_persist/messages.py)."""

    def __init__(self, conn: Connection, writer: BackgroundWriter, reporter: Reporter, trainer_pid: int, *,
                 replica: PacedReplica | None = None) -> None:
        self.conn = conn
        self.trainer_pid = trainer_pid
        self.parent_gone = lambda: os.getppid() != trainer_pid
        self.inbox = Inbox(conn, self.parent_gone)
        self.writer = writer
        self.reporter = reporter
        self.replica = replica
        self.rings: dict[str, tuple[int, Arena]] = {}
        self.pending: tuple[Staged[StepRecord], bool] | None = None
        self.layouts: dict[int, Any] = {}
        self._groups: list[dict[str, Any]] = []  # the last record's: what a record that repeats them (None) has
        self._rng: dict[str, torch.Tensor] = {}

    def serve(self) -> bool:
        """Handle messages until :class:`~lowdiff._persist.messages.Close` (True) or until the training process is
        gone (False): its socket at end of file, or this process re-parented (a process it forked, a DataLoader
        worker, may still hold its end of the socket). Compared with the trainer's pid, not with the parent found
        at start: the trainer may have died while this process was still importing torch."""
        while True:
            try:
                data = self.inbox.next()
                if data is None:
                    return False
                msg = m.decode(data)
            except (EOFError, OSError, pickle.UnpicklingError):
                return False
            try:
                if self.handle(msg):
                    return True
            except (EOFError, ConnectionError):  # the trainer died in the middle of handing a descriptor over
                return False

    def handle(self, msg: Any) -> bool:
        """Handle one message; True once the trainer has closed the session."""
        writer = self.writer
        match msg:
            case m.Several(messages):
                return any([self.handle(x) for x in messages])
            case m.Record():
                self._record(msg)
            case m.Seal(step, data, end_groups, rng):
                staged, _ = self._take_pending(step)
                staged.item.data = data
                staged.item.end_groups = staged.item.groups if isinstance(end_groups, str) else end_groups  # m.AT_STEP
                if rng is not None:
                    staged.item.rng = _rng_tensors(rng)
                self.submit(staged)
            case m.EndKnown(step, data, end_groups):
                staged, _ = self._take_pending(step)
                staged.item.data = data
                staged.item.end_groups = end_groups
                self.pending = (staged, True)
            case m.Rng(step, rng):  # taken again after an evaluation (opt.capture_rng()); the iteration goes on
                if self.pending is None or self.pending[0].item.step != step:
                    raise RuntimeError(f"lowdiff persistence: an RNG state for step {step}, which is not held")
                self.pending[0].item.rng = _rng_tensors(rng)
            case m.Drop(step):
                staged, _ = self._take_pending(step)
                staged.release()
            case m.Snapshot():
                t = unpack_skeleton(msg.skeleton, msg.regions, msg.places, self.rings["s"][1].buf)
                state = SnapshotState(step=msg.step, param_groups=msg.groups, compressor_name=msg.compressor_name,
                                      extra=msg.extra, rng=_rng_tensors(msg.rng), **t)
                writer.submit_snapshot(Staged(state, None, lambda: self.reporter.free("s", 0, 0)))
            case m.ShadowSnapshot(step):
                if self.replica is not None:
                    self.replica.periodic_snapshot(step)
                else:
                    writer.submit_shadow_snapshot(step)
            case m.BatchSteps(steps):
                writer.set_batch_steps(steps)
            case m.Flush(token):
                self.close_gap()
                writer.flush()
                self.reporter.status()  # before Flushed: the trainer's flush() returns with these counters
                self.reporter.send(m.Flushed(token))
            case m.ArenaFollows("m", _, nbytes):
                self.inbox.open_mailbox(nbytes, descriptor(self.conn, self.parent_gone))
            case m.ArenaFollows(kind, ring_id, nbytes):
                fd = descriptor(self.conn, self.parent_gone)
                old = self.rings.get(kind)
                self.rings[kind] = (ring_id, Arena(nbytes, fd))
                if old is not None:
                    old[1].close()
            case m.Wake():
                pass
            case m.Close():
                writer.close()
                self.reporter.send(m.Closed())
                return True
            case _:
                raise RuntimeError(f"lowdiff persistence: unknown message {type(msg).__name__}")
        return False

    def _record(self, msg: m.Record) -> None:
        if msg.wire is not None:
            remember(self.layouts, msg.layout_id, msg.wire)
        if self.pending is not None:  # cannot happen with a well-behaved trainer: never leave a slot behind
            log.error("lowdiff: step %d arrived before step %d ended; the latter is dropped", msg.step,
                      self.pending[0].item.step)
            self.pending[0].release()
        rid, ring = self.rings["r"]
        assert rid == msg.ring_id, (rid, msg.ring_id)
        # Kept packed: the writer builds its segment from the packed steps (lowdiff._storage.segment_packed).
        packed = Received(ring.buf[msg.offset:msg.offset + msg.nbytes], self.layouts[msg.layout_id])
        if msg.groups is not None:
            self._groups = msg.groups
        if msg.rng is not None:
            self._rng = _rng_tensors(msg.rng)
        rec = StepRecord(step=msg.step, groups=self._groups, grads={}, packed=packed, data=msg.data,
                         skipped=msg.skipped, rng=self._rng, grad_scale=msg.grad_scale)
        ring_id, aid = msg.ring_id, msg.aid
        self.pending = (Staged(rec, None, lambda: self.reporter.free("r", ring_id, aid)), msg.keep_if_orphaned)

    def _take_pending(self, step: int) -> tuple[Staged[StepRecord], bool]:
        if self.pending is None or self.pending[0].item.step != step:
            raise RuntimeError(f"lowdiff persistence: step {step} was never handed over")
        p, self.pending = self.pending, None
        return p

    def submit(self, staged: Staged[StepRecord]) -> None:
        """A record whose iteration has ended."""
        if self.replica is not None:
            self.replica.submit(staged)
        else:
            self.writer.submit_record(staged)

    def close_gap(self) -> None:
        if self.replica is not None:
            self.replica.close_gap()

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
                    log.error("lowdiff: the trainer of %s died and another process holds its lock; the steps "
                              "handed over after step %d are not committed", run_dir.path, writer.durable_step)
                    os._exit(3)
                time.sleep(0.01)
        try:
            if self.pending is not None:
                staged, keep = self.pending
                self.pending = None
                if keep:
                    if staged.item.end_groups is None:
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


def descriptor(conn: Connection, parent_gone: Callable[[], bool]) -> int:
    """The descriptor sent after an ``ArenaFollows``. Its trainer sends it right after the message; one killed in
    between, its socket held open by a process it forked (a DataLoader worker), would leave ``recv_handle`` waiting
    for ever, this process holding its persistence lock: so the parent is checked every second meanwhile (EOFError
    once it is gone, as at end of file)."""
    while not conn.poll(1.0):
        if parent_gone():
            raise EOFError("the trainer died while it handed a descriptor over")
    return recv_handle(conn)


def _rng_tensors(rng: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """RNG states sent as bytes (messages.rng_bytes), as the uint8 tensors records and snapshots hold."""
    return {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in rng.items()}


class _NoLock:
    def release(self) -> None:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
