"""``log.persistence: process``: the training side of the persistence process (lowdiff/_persist/child.py).

:class:`ProcessWriter` has :class:`lowdiff._persist.thread_writer.BackgroundWriter`'s interface, so the checkpointer
drives either. Per step the training thread copies the record's tensors into a slot of a shared ring
(:mod:`lowdiff._transfer.ring`, one concatenating copy per dtype) and sends a small message over a Unix socket;
encoding, checksums, HDF5 writes, fsyncs, retention and the shadow replica run in the other process. A record is handed
over when ``opt.step()`` returns (:meth:`submit_early`), before its iteration ends; the end of the iteration follows as
a seal message (:meth:`submit_record`). So when the training process dies, the persistence process holds every step
whose ``opt.step()`` returned, commits them and exits (docs/guide/durability.md).

Back-pressure: at most ``(queue_depth + 1) x batch_steps + 2`` records are in flight (sent, not yet committed), and
no more than the ring holds; beyond that the step waits for the persistence process (``stats.blocked_s``). Failures
in the persistence process come back as messages and are raised by the checkpointer as today.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path
from typing import Any

from lowdiff._persist import signals
from lowdiff._persist.thread_writer import WriterStats
from lowdiff._storage.lock import take_persistence_lock
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Slot, Staged
from lowdiff._transfer.packing import PackedStep, StepPacker, pack_host, remember
from lowdiff._transfer.ring import Arena, RingAllocator
from lowdiff.errors import CheckpointWriteError

log = logging.getLogger(__name__)

RING_MAX_BYTES = 1 << 30
"""The record ring grows past this only to hold one segment's records: fewer segments in flight instead."""
RING_MIN_BYTES = 4 << 20


_FRAME = struct.Struct("!i")  # multiprocessing.connection's header for a message under 2 GiB (recv_bytes reads it)


def _send_bytes(conn: Connection, msg: Any) -> None:
    """Send ``msg`` whole, as ``conn.recv_bytes`` on the other end reads it: one ``write`` of header and body.

    A signal handler that raises in the middle (KeyboardInterrupt, lowdiff's SIGTERM handler after its
    deferrals, a program's own ``sys.exit`` on SIGTERM) must not leave part of a message unsent or sent twice, nor
    a message taken off a queue and never sent (a kill test lost the step whose seal it was). While it writes,
    lowdiff's own handlers defer (lowdiff/_persist/signals.py); with a handler of the program's own installed, SIGTERM
    and SIGINT are held back instead, which costs two system calls a message."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) >= 1 << 31 or not signals.only_lowdiffs():
        _whole(conn.send_bytes, data)
        return
    frame = memoryview(_FRAME.pack(len(data)) + data)
    fd = conn.fileno()
    try:
        signals.state.sending = True
        while len(frame):
            frame = frame[os.write(fd, frame):]
    finally:
        signals.state.sending = False


_HELD_BACK = {signal.SIGTERM, signal.SIGINT}


def _rng_bytes(rng: dict[str, Any]) -> dict[str, bytes]:
    """A record's or snapshot's RNG states as the message carries them (the child turns them back into tensors):
    the bytes they were captured as, when the states are still those of a capture."""
    raw = getattr(rng, "raw", None)
    if raw is not None and raw.keys() == rng.keys():
        return raw
    return {k: v.numpy().tobytes() for k, v in rng.items()}


def _whole(io: Any, *args: Any) -> Any:
    """One message's socket I/O with SIGTERM and SIGINT held back (in the main thread, where their handlers run):
    a handler that raises in the middle (lowdiff's SIGTERM handler after its deferrals, KeyboardInterrupt) would
    leave half a message on the socket, or a message taken off a queue and never sent (a kill test lost the
    step whose seal it was). The signal is handled as soon as the message is through."""
    if threading.current_thread() is not threading.main_thread():
        return io(*args)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_BACK)
    try:
        return io(*args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class ProcessWriter:
    """The same call order as :class:`lowdiff._persist.thread_writer.BackgroundWriter`, plus :meth:`submit_early` when
    ``opt.step()`` returns and :meth:`drop` for an iteration that an exception interrupted."""

    def __init__(self, run_dir: RunDir, *, batch_steps: int, codec: str, compressor: str, queue_depth: int,
                 retention: RetentionPolicy, durable_step: int, shadow: Any = None,
                 when_behind: str = "wait") -> None:
        self.run_dir = run_dir
        self.batch_steps = batch_steps
        self.stats = WriterStats()
        self.shadow_ok = shadow is not None
        self._queue_depth = queue_depth
        self._durable_step = durable_step
        self._error: BaseException | None = None
        self._reported = False
        self._broken = False
        self._ring: Arena | None = None
        self._alloc = RingAllocator(0)
        self._ring_id = 0
        self._packer = StepPacker()  # records packed here rather than by the stager
        self._layouts_sent: dict[int, None] = {}  # the ids the persistence process knows (packing.remember)
        self._records = 0  # records sent and not yet released by the persistence process
        self._snap: Arena | None = None
        self._snap_id = 0  # which snapshot arena a slot handed out lies in
        self._snap_busy = False
        self._snap_copying: Staged[SnapshotState] | None = None  # handed over once its copies complete
        self._flushed = -1
        self._token = 0
        self._closed = False
        self._dead = False
        self._death_recorded = False
        self._ready = False
        self._outbox: Any = None  # a seal waiting for the next message
        self._kept_if_orphaned = False
        self._rng_sent: Any = None  # the RNG state the last record was handed over with
        self._early_step: int | None = None  # the step handed over early whose iteration has not ended
        self.start_wait_s = 0.0
        """Time step() waited for free ring space before the persistence process had started (not ``blocked_s``)."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the child imports this very lowdiff
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        t0 = time.perf_counter()
        # The child inherits the lock on persist-RANK.lock and holds it until it exits: a trainer restarted on this
        # run directory waits for it (lowdiff._storage.lock.wait_for_persistence).
        lock_fd = take_persistence_lock(run_dir.path, run_dir.shard.index)
        try:
            # In a session of its own: a signal to the trainer's process group (torchrun's SIGTERM and SIGKILL to
            # the other ranks when one fails, a Ctrl-C, a terminal's SIGHUP) does not reach it, even while it is
            # still importing torch, before it ignores SIGTERM.
            self._proc = subprocess.Popen([sys.executable, "-m", "lowdiff._persist.child", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(), lock_fd), env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(lock_fd)
        theirs.close()
        self._conn = Connection(ours.detach())
        # Replies are looked for once per step: one poll(2) on a poller kept for it (Connection.poll builds a
        # selector per call).
        self._replies = select.poll()
        self._replies.register(self._conn.fileno(), select.POLLIN)
        _send_bytes(self._conn, {
            "path": str(run_dir.path), "shard": (run_dir.shard.index, run_dir.shard.count),
            "compressor_params": run_dir.compressor_params, "run_id": run_dir.run_id,
            "branch": run_dir.branch,
            "writer": {"batch_steps": batch_steps, "codec": codec, "compressor": compressor,
                       "queue_depth": queue_depth, "retention": retention.keep_snapshots,
                       "durable_step": durable_step, "when_behind": when_behind},
            "shadow": shadow, "log_level": logging.getLogger("lowdiff").getEffectiveLevel(),
            "trainer_pid": os.getpid()})
        self.start_s = time.perf_counter() - t0
        log.info("lowdiff: persistence process pid %d started for %s", self._proc.pid, run_dir.path)

    @property
    def pid(self) -> int:
        """The persistence process's id."""
        return self._proc.pid

    # -- what the checkpointer reads ------------------------------------------------------------------------

    @property
    def durable_step(self) -> int:
        self._drain()
        return self._durable_step

    @property
    def capacity(self) -> int:
        return self._max_records()

    @property
    def queued(self) -> int:
        return self._records

    @property
    def error(self) -> BaseException | None:
        return self._error if self._broken else None

    def take_error(self) -> BaseException | None:
        self._drain()
        if self._error is None or self._reported:
            return None
        self._reported = True
        return self._error

    def on_thread(self) -> bool:
        return False

    def _max_records(self) -> int:
        return (self._queue_depth + 1) * self.batch_steps + 2

    # -- hand-over -------------------------------------------------------------------------------------------

    @property
    def slots(self) -> ProcessWriter:
        """The stager packs step records straight into this writer's ring (:meth:`alloc`)."""
        return self

    def alloc(self, nbytes: int, pinned: bool) -> Slot | None:
        """A ring slot for a step the stager packs (lowdiff._training.stager.Slots); None when the persistence process
        is gone. Blocks while the ring is full (back-pressure). ``pinned``: the slot receives copies from a GPU, so
        the ring is registered with CUDA as pinned memory for them to run asynchronously."""
        got = self._alloc_record(nbytes)
        if got is None or self._ring is None:
            return None
        if pinned and not self._ring.pinned:
            self._ring.pin()
        aid, offset = got
        ring_id, state = self._ring_id, {"sent": False}

        def release() -> None:  # a record never handed over (its step raised): the slot comes back here
            if not state["sent"] and ring_id == self._ring_id:
                self._alloc.free(aid)
                self._records -= 1

        slot = Slot(self._ring.buf[offset:offset + nbytes], (ring_id, aid, offset, state), release)
        return slot

    def alloc_snapshot(self, nbytes: int, pinned: bool) -> Slot | None:
        """The snapshot arena, for the stager to pack a snapshot into (lowdiff._training.stager.Slots); None when the
        persistence process is gone. Waits until the previous snapshot is written: one is in flight at a time
        (CheckFreq), so the arena is free again then; that wait counts as back-pressure (``stats.blocked_s``)."""
        t0 = time.perf_counter()
        self._settle_snapshot(block=True)  # the previous one: this process frees the arena once it is written
        if not self._wait(lambda: not self._snap_busy):
            return None
        if self._ready:
            self.stats.blocked_s += time.perf_counter() - t0
        if self._snap is None or self._snap.nbytes < nbytes:
            if self._snap is not None:
                self._snap.close()
            self._snap = Arena(max(nbytes, 64))
            self._snap_id += 1
            self._send_arena("s", self._snap_id, self._snap)
        if pinned and not self._snap.pinned:
            self._snap.pin()
        self._snap_busy = True
        snap_id, state = self._snap_id, {"sent": False}

        def release() -> None:  # a snapshot never handed over (its iteration was interrupted): the arena is free
            if not state["sent"] and snap_id == self._snap_id:
                self._snap_busy = False

        return Slot(self._snap.buf[:nbytes], (snap_id, state), release)

    def submit_early(self, record: Staged[StepRecord], keep_if_orphaned: bool) -> None:
        """Hand the step's record over as soon as ``opt.step()`` has applied it (its iteration has not ended).
        ``keep_if_orphaned``: if the training process dies before the iteration ends, commit it anyway (nothing
        tracked changes at the end of an iteration)."""
        # On a GPU: this step's copies into the ring are complete (no returned step may depend on copies still in
        # flight when the trainer dies), and so, perhaps, are a snapshot's before it.
        rec = record.wait()
        self._settle_snapshot(block=False)
        packed = rec.packed
        if packed is None or packed.handle is None or packed.handle[0] != self._ring_id:
            packed = self._pack_here(rec)
            record.release()
            if packed is None:  # the persistence process died: take_error() says so
                return
        ring_id, aid, offset, state = packed.handle
        state["sent"] = True
        layout = packed.layout
        self._kept_if_orphaned = keep_if_orphaned
        self._rng_sent = rec.rng
        rng = _rng_bytes(rec.rng)
        self._send(("rec", rec.step, ring_id, aid, offset, layout.nbytes, layout.id,
                    None if layout.id in self._layouts_sent else layout.wire, rng, rec.groups,
                    rec.data, rec.skipped, keep_if_orphaned))
        if layout.id not in self._layouts_sent:
            remember(self._layouts_sent, layout.id, None)
        self._early_step = rec.step

    def _pack_here(self, rec: StepRecord) -> PackedStep | None:
        """A record the stager did not pack into this ring (layer-wise captures, a replaced ring): packed now."""
        rec.unpack()
        keys = [(n, f) for n, p in rec.grads.items() for f in p] + [("", n) for n in rec.buffers]
        tensors = [t for p in rec.grads.values() for t in p.values()] + list(rec.buffers.values())
        layout, _ = self._packer.plan(keys, tensors)
        assert layout is not None  # host tensors
        slot = self.alloc(layout.nbytes, pinned=False)
        if slot is None:
            return None
        pack_host(layout, tensors, slot.buf)
        return PackedStep(slot.buf, layout, slot.handle)

    def retake_rng(self, record: Staged[StepRecord]) -> None:
        """The RNG state of the record handed over early was taken again (``opt.capture_rng()``, after an
        evaluation). If this process would commit that record as it is should the trainer die now, the new state
        goes at once: a death before the iteration ends would otherwise commit the state from before the
        evaluation's draws. Otherwise it goes with the seal."""
        rec = record.item
        if not self._kept_if_orphaned or rec.step != self._early_step:
            return
        self._rng_sent = rec.rng
        self._send(("rng", rec.step, _rng_bytes(rec.rng)))

    def submit_record(self, record: Staged[StepRecord]) -> None:
        """The iteration of a record handed over early has ended: its final tracked state and groups."""
        rec = record.item
        record.release()
        self._early_step = None
        # The RNG state goes again only if it was taken again after opt.step() (capture_rng).
        rng = None if rec.rng is self._rng_sent else _rng_bytes(rec.rng)
        msg = ("seal", rec.step, rec.data, rec.end_groups, rng)
        if self._kept_if_orphaned:
            # The persistence process would commit this record as it is if the trainer died now: the seal rides
            # with the next message (one socket write per step instead of two).
            self._outbox = msg
        else:
            self._send(msg)

    def drop(self, step: int) -> None:
        self._early_step = None
        self._send(("drop", step))

    def submit_snapshot(self, state: Staged[SnapshotState]) -> None:
        """Hand over a snapshot the stager packed into the snapshot arena (:meth:`alloc_snapshot`). On a GPU whose
        copies into the arena are still running it goes once they complete, seen at a later step's hand-over (or
        at the next snapshot, a flush, a close): training does not wait for a snapshot's copies, which may take
        tens of milliseconds, as it does for a step's. Until then the snapshot is not in the persistence process:
        a trainer that dies meanwhile loses it, not a step (recovery replays from the snapshot before it)."""
        snap = state.item
        packed = snap.packed
        if packed is None or packed.packed.handle is None or packed.packed.handle[0] != self._snap_id:
            state.release()  # staged without the arena: only when the persistence process is gone
            if not self._dead:
                log.error("lowdiff: the snapshot of step %d was not staged into the persistence process's arena; "
                          "it is not written (recovery replays from the snapshot before it)", snap.step)
            return
        self._snap_copying = state
        self._settle_snapshot(block=False)

    def _settle_snapshot(self, *, block: bool) -> None:
        """Send the snapshot whose copies were in flight when it was handed over, if they have completed (with
        ``block``: once they have)."""
        state = self._snap_copying
        if state is None or (not block and state.ready is not None and not state.ready.query()):
            return
        try:
            snap = state.wait()  # an interrupt here leaves it pending: sent (or released) at the next settle
        except Exception as e:  # a CPU snapshot's copy failed on the copy thread (host_copies.CopyInFlight)
            self._snap_copying = None
            log.error("lowdiff: the snapshot of step %d was not copied (%s); it is not written (recovery replays "
                      "from the snapshot before it)", state.item.step, e)
            state.release()
            return
        self._snap_copying = None
        packed = snap.packed
        assert packed is not None and packed.packed.handle is not None
        if packed.packed.handle[0] != self._snap_id:  # replaced meanwhile: only when the process is gone
            state.release()
            return
        packed.packed.handle[1]["sent"] = True
        where = packed.packed.layout
        rng = _rng_bytes(snap.rng)
        self._send(("snap", snap.step, where.regions, where.places, packed.skel, rng, snap.param_groups,
                    snap.compressor_name, snap.extra))

    def submit_shadow_snapshot(self, step: int) -> None:
        self._send(("shadow", step))

    def set_batch_steps(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"batch_steps must be >= 1, got {steps}")
        self.batch_steps = steps
        self._send(("batch", steps))

    def flush(self) -> int:
        """Wait until everything handed over is committed (or failed); returns the durable step."""
        if self._dead or self._closed:
            self._drain()
            return self._durable_step
        self._settle_snapshot(block=True)
        self._token += 1
        token = self._token
        self._send(("flush", token))
        self._wait(lambda: self._flushed >= token)
        return self._durable_step

    def close(self) -> None:
        if self._closed:
            return
        try:
            if not self._dead:
                self.flush()
                self._send(("close",))
                self._wait(lambda: self._dead)
        finally:
            self._closed = True
            self._conn.close()
            pending, self._snap_copying = self._snap_copying, None
            if pending is not None:  # never sent (the process died): its copies must end before the unmapping
                try:
                    pending.wait()
                except Exception:
                    pass
                pending.release()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log.error("lowdiff: persistence process pid %d did not exit; killing it", self._proc.pid)
                self._proc.kill()
                self._proc.wait()
            for arena in (self._ring, self._snap):
                if arena is not None:
                    arena.close()

    # -- internals -------------------------------------------------------------------------------------------

    def _alloc_record(self, nbytes: int) -> tuple[int, int] | None:
        per = max(nbytes, 64) + 64
        # A ring that cannot hold a whole segment's records would wait forever for the persistence process, which
        # frees them only once the segment is written: replace it (a larger record, a larger batch_steps).
        if self._ring is None or (self.batch_steps + 2) * per > self._alloc.capacity:
            if self._ring is not None and self._records:
                self.flush()  # the open segment is committed early, so every slot comes back
                if not self._wait(lambda: self._records == 0):
                    return None
            if self._ring is not None:
                self._ring.close()
            cap = max(RING_MIN_BYTES, (self.batch_steps + 2) * per,
                      min(self._max_records() * per, max(RING_MAX_BYTES, 4 * per)))
            self._ring = Arena(cap)
            self._alloc = RingAllocator(cap)
            self._ring_id += 1
            self._send_arena("r", self._ring_id, self._ring)
        got = self._alloc.alloc(nbytes) if self._records < self._max_records() else None
        if got is None:
            t0, ready = time.perf_counter(), self._ready
            self._push()  # the process may be waiting for that seal to complete the segment that frees slots
            while got is None:
                if self._dead:
                    return None
                self._recv(block=True)
                if self._records < self._max_records():
                    got = self._alloc.alloc(nbytes)
            if ready:
                self.stats.blocked_s += time.perf_counter() - t0
            else:  # the process was still starting (importing torch), not a slow disk
                self.start_wait_s += time.perf_counter() - t0
                log.info("lowdiff: training waited %.1f s for the persistence process to start", self.start_wait_s)
        self._records += 1
        return got

    def _send_arena(self, kind: str, ring_id: int, arena: Arena) -> None:
        # One masked stretch: a SIGINT between the message and its descriptor would leave the child reading the
        # next message as the descriptor.
        _whole(self._send_arena_now, kind, ring_id, arena)

    def _send_arena_now(self, kind: str, ring_id: int, arena: Arena) -> None:
        self._send(("arena", kind, ring_id, arena.nbytes))
        send_handle(self._conn, arena.fd, self._proc.pid)

    def _send(self, msg: Any) -> None:
        """Send ``msg``; a dead persistence process is recorded (raised by the next ``take_error``), not raised.
        Its replies are read once per step (``take_error``) and while waiting, not before every send (a poll
        per message cost more than the send)."""
        if self._dead:
            self._died()
            return
        if self._outbox is not None:
            msg, self._outbox = ("multi", [self._outbox, msg]), None
        try:
            _send_bytes(self._conn, msg)
        except OSError:
            self._dead = True
            self._died()

    def _died(self) -> None:
        """Record the persistence process's death, once: reported at the next step, flush or close, unless an error
        it sent is still to be reported (that one says why). An error reported before it died does not stand in for
        its death: steps after it were silently not logged when it did (an adversarial probe: ENOSPC raised once,
        then the process killed, and training went on with flush() and close() returning normally)."""
        if self._closed or self._death_recorded:
            return
        self._death_recorded = True
        if self._broken and self._error is not None and not self._reported:
            return
        code = self._proc.poll()
        self._error = CheckpointWriteError(f"the lowdiff persistence process (pid {self._proc.pid}) of "
                                           f"{self.run_dir.path} exited (status {code}); steps after "
                                           f"{self._durable_step} are not on disk. Resume from the run directory")
        self._reported, self._broken = False, True

    def _drain(self) -> None:
        while not self._dead and not self._closed and self._replies.poll(0):
            self._recv(block=False)

    def _push(self) -> None:
        self._settle_snapshot(block=False)
        if self._outbox is not None:
            msg, self._outbox = self._outbox, None
            self._send(msg)

    def _wait(self, done: Any) -> bool:
        """Handle messages until ``done()``; False when the persistence process died first (recorded)."""
        self._push()
        while not done():
            if self._dead:
                self._died()
                return False
            self._recv(block=True)
        return True

    def _recv(self, block: bool) -> None:
        try:
            if block:
                self._conn.poll(None)  # waiting may be interrupted (Ctrl-C, SIGTERM); reading a message may not
            msg = pickle.loads(_whole(self._conn.recv_bytes))
        except (EOFError, OSError):
            self._dead = True
            self._died()
            return
        kind = msg[0]
        if kind == "free":
            for ring_kind, ring_id, aid in msg[1]:
                if ring_kind == "s":
                    self._snap_busy = False
                elif ring_id == self._ring_id:
                    self._alloc.free(aid)
                    self._records -= 1
        elif kind == "status":
            _, durable, fields, broken, shadow_ok = msg
            self._durable_step = max(self._durable_step, durable)
            blocked = self.stats.blocked_s
            self.stats = WriterStats(*fields)
            self.stats.blocked_s = blocked
            self._broken = broken
            self.shadow_ok = shadow_ok
        elif kind == "error":
            self._error, self._reported, self._broken = CheckpointWriteError(*msg[1]), False, True
        elif kind == "flushed":
            self._flushed = msg[1]
        elif kind == "ready":
            self._ready = True
        elif kind == "closed":
            self._dead = True
