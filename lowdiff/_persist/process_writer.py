"""``log.persistence: process``: the training side of the persistence process (lowdiff/_persist/child.py).

:class:`ProcessWriter` is a :class:`lowdiff._persist.writer.Writer`, as the writer thread is, so the checkpointer
drives either; the process and the socket are a :class:`lowdiff._persist.process_channel.Channel`. Per step the training
thread copies the record's tensors into a slot of a shared ring (:mod:`lowdiff._transfer.ring`, one concatenating copy
per dtype) and sends a small message over a Unix socket; encoding, checksums, HDF5 writes, fsyncs, retention and the
shadow replica run in the other process. A record is handed over when ``opt.step()`` returns (:meth:`submit_early`; on
a GPU once its copies are seen complete), before its iteration ends; a seal (:meth:`submit_record`) follows at its end.
A dead trainer's persistence process commits what it holds, then exits.

Back-pressure: at most ``(queue_depth + 1) x batch_steps + 2`` records are in flight (sent, not yet committed), and no
more than the ring holds; beyond that the step waits (``stats.blocked_s``). Failures come back as messages."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lowdiff._persist import messages as m
from lowdiff._persist.handover import CopyingRecord, pack_here
from lowdiff._persist.process_channel import Channel
from lowdiff._persist.writer import WriterStats
from lowdiff._storage.later import Later, pending
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.segment import StepRecord, scale_of
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Slot, Staged
from lowdiff._transfer.packing import StepPacker, remember
from lowdiff._transfer.ring import Arena, RingAllocator

log = logging.getLogger(__name__)

RING_MAX_BYTES = 1 << 30
"""The record ring grows past this only to hold one segment's records: fewer segments in flight instead."""
RING_MIN_BYTES = 4 << 20
_ring_min_bytes = RING_MIN_BYTES


def set_ring_min_bytes(nbytes: int) -> int:
    """The smallest record ring a writer made from now on allocates (lowdiff.testing.small_rings); returns the
    previous bound."""
    global _ring_min_bytes
    previous, _ring_min_bytes = _ring_min_bytes, nbytes
    return previous


class ProcessWriter:
    """The :class:`lowdiff._persist.writer.Writer` of ``log.persistence: process``: records are handed over when
    ``opt.step()`` returns (:meth:`submit_early`), sealed when their iteration ends (:meth:`submit_record`) or
    dropped (:meth:`drop`); the stager packs them straight into this writer's ring (:attr:`slots`)."""

    def __init__(self, run_dir: RunDir, *, batch_steps: int, codec: str, compressor: str, queue_depth: int,
                 retention: RetentionPolicy, durable_step: int, shadow: Any = None,
                 when_behind: str = "wait", remote: Mapping[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.batch_steps = batch_steps
        self._queue_depth = queue_depth
        self._ring: Arena | None = None
        self._alloc = RingAllocator(0)
        self._ring_id = 0
        self._packer = StepPacker()  # records packed here rather than by the stager
        self._layouts_sent: dict[int, None] = {}  # the ids the persistence process knows (packing.remember)
        self._records = 0  # records sent and not yet released by the persistence process
        self._snap: Arena | None = None
        self._snap_id, self._snap_busy = 0, False  # which snapshot arena a slot handed out lies in; whether taken
        self._snap_copying: Staged[SnapshotState] | None = None  # handed over once its copies complete
        self._token = 0
        self._kept_if_orphaned = False
        self._rng_sent: Any = None  # the RNG state the last record was handed over with
        self._repeat: tuple[Any, Any] = (None, None)  # its RNG bytes and groups: a record repeating them sends None
        self._early_step: int | None = None  # the step handed over early whose iteration has not ended
        self._copying = CopyingRecord(self._hand_over, self._send_end)  # its copies still running on the GPU
        self.start_wait_s = 0.0
        """Time step() waited for free ring space before the persistence process had started (not ``blocked_s``)."""
        self._chan = Channel(run_dir, m.Start(
            path=str(run_dir.path), shard=(run_dir.shard.index, run_dir.shard.count),
            compressor_params=run_dir.compressor_params, run_id=run_dir.run_id, branch=run_dir.branch,
            writer={"batch_steps": batch_steps, "codec": codec, "compressor": compressor,
                    "queue_depth": queue_depth, "retention": retention.keep_snapshots,
                    "durable_step": durable_step, "when_behind": when_behind, "direct_io": run_dir.direct_io,
                    "remote": dict(remote) if remote is not None else None},
            shadow=shadow, log_level=logging.getLogger("lowdiff").getEffectiveLevel(), trainer_pid=os.getpid()),
            on_freed=self._freed, before_wait=self._before_wait)
        self.start_s = self._chan.start_s

    @property
    def pid(self) -> int:
        """The persistence process's id."""
        return self._chan.proc.pid

    @property
    def stats(self) -> WriterStats:
        """The writer's counters as of the persistence process's last report; ``blocked_s`` is this side's."""
        return self._chan.stats

    @property
    def shadow_ok(self) -> bool:
        return self._chan.shadow_ok

    # -- what the checkpointer reads ------------------------------------------------------------------------

    @property
    def durable_step(self) -> int:
        self._chan.drain()
        return self._chan.durable_step

    @property
    def capacity(self) -> int:
        return self._max_records()

    @property
    def queued(self) -> int:
        return self._records

    @property
    def error(self) -> BaseException | None:
        return self._chan.error

    def take_error(self) -> BaseException | None:
        return self._chan.take_error()

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

        return Slot(self._ring.view(offset, nbytes), (ring_id, aid, offset, state), release)

    def alloc_snapshot(self, nbytes: int, pinned: bool) -> Slot | None:
        """The snapshot arena for the stager (lowdiff._training.stager.Slots; None: the process is gone), once the
        previous snapshot is written (one in flight, as CheckFreq): a wait counted as back-pressure (blocked_s)."""
        t0 = time.perf_counter()
        self._settle_snapshot(block=True)  # the previous one: this process frees the arena once it is written
        if not self._chan.wait(lambda: not self._snap_busy):
            return None
        if self._chan.ready:
            self.stats.blocked_s += time.perf_counter() - t0
        if self._snap is None or self._snap.nbytes < nbytes:
            if self._snap is not None:
                self._snap.close()
            self._snap = Arena(max(nbytes, 64))
            self._snap_id += 1
            self._chan.send_arena("s", self._snap_id, self._snap.fd, self._snap.nbytes)
        if pinned and not self._snap.pinned:
            self._snap.pin()
        self._snap_busy = True
        snap_id, state = self._snap_id, {"sent": False}

        def release() -> None:  # a snapshot never handed over (its iteration was interrupted): the arena is free
            if not state["sent"] and snap_id == self._snap_id:
                self._snap_busy = False

        return Slot(self._snap.buf[:nbytes], (snap_id, state), release)

    def submit_early(self, record: Staged[StepRecord], keep_if_orphaned: bool) -> None:
        """Hand the record over once its copies into the ring are seen complete (lowdiff._persist.handover);
        ``keep_if_orphaned``: commit it even if the trainer dies before its iteration ends (nothing tracked at it)."""
        self._copying.put(record, keep_if_orphaned)

    def _before_wait(self) -> None:
        self._copying.send(block=True)  # the persistence process may be waiting for it
        self._settle_snapshot(block=False)

    def _hand_over(self, record: Staged[StepRecord], keep_if_orphaned: bool) -> None:
        rec = record.wait()  # its copies are complete (or seen complete): no wait
        self._settle_snapshot(block=False)  # a snapshot's before it, perhaps
        packed = rec.packed
        if packed is None or packed.handle is None or packed.handle[0] != self._ring_id:
            packed = pack_here(rec, self._packer, self.alloc)
            record.release()
            if packed is None:  # the persistence process died: take_error() says so
                return
        ring_id, aid, offset, state = packed.handle
        state["sent"] = True
        layout = packed.layout
        self._kept_if_orphaned = keep_if_orphaned
        self._rng_sent, raw, (raw_sent, groups_sent) = rec.rng, m.rng_bytes(rec.rng), self._repeat
        self._chan.send(m.Record(rec.step, ring_id, aid, offset, layout.nbytes, layout.id,
                            None if layout.id in self._layouts_sent else layout.wire, None if raw == raw_sent else raw,
                            None if rec.groups is groups_sent else rec.groups, rec.data, rec.skipped,
                            keep_if_orphaned, scale_of(rec)), wake=self._records + 2 >= self._max_records())
        self._repeat = raw, rec.groups
        if layout.id not in self._layouts_sent:
            remember(self._layouts_sent, layout.id, None)
        self._early_step = rec.step

    def retake_rng(self, record: Staged[StepRecord]) -> None:
        """The RNG state of the record handed over early was taken again (``opt.capture_rng()``): at once if this
        process would commit that record as it is should the trainer die now, else with the seal (or the end)."""
        rec = record.item  # a record not handed over yet goes with the state taken now
        if self._copying.holds(record) or not self._kept_if_orphaned or rec.step != self._early_step:
            return
        self._rng_sent = rec.rng
        self._chan.send(m.Rng(rec.step, m.rng_bytes(rec.rng)))

    def before_seal(self) -> None:
        self._copying.send(block=True)  # the record, before the seal's copies are made (they may still run)

    def end_known(self, record: Staged[StepRecord], data: dict[str, Any], end_groups: list[dict[str, Any]],
                  later: Sequence[Later] = ()) -> None:
        """The end state of the record handed over early is known: once it is sent (after the record, when
        ``later`` are copied: lowdiff._persist.handover) this process commits the record should the trainer die."""
        self._copying.end_known(record, data, end_groups, later)

    def _send_end(self, record: Staged[StepRecord], data: dict[str, Any], end_groups: list[dict[str, Any]]) -> None:
        rec = record.item
        if rec.step != self._early_step:  # its iteration ended (sealed or dropped) meanwhile
            return
        self._chan.send(m.EndKnown(rec.step, data, end_groups))
        self._kept_if_orphaned = True
        if rec.rng is not self._rng_sent:  # taken again (capture_rng) while this waited: retake_rng sent nothing
            self._rng_sent = rec.rng
            self._chan.send(m.Rng(rec.step, m.rng_bytes(rec.rng)))

    def submit_record(self, record: Staged[StepRecord]) -> None:
        """The iteration of a record handed over early has ended: its final tracked state and groups."""
        self._copying.send(block=True)  # its iteration is over: the next opt.step() has begun
        rec = record.item
        record.release()
        self._early_step = None
        # The RNG state goes again only if it was taken again after opt.step() (capture_rng).
        rng = None if rec.rng is self._rng_sent else m.rng_bytes(rec.rng)
        msg = m.Seal(rec.step, rec.data, m.AT_STEP if rec.end_groups is rec.groups else rec.end_groups, rng)
        if self._kept_if_orphaned or pending(msg):
            # Committed as it is should the trainer die now (or values in it are still being copied): it rides with
            # the next message, whose copies come after them (one message per step instead of two).
            self._chan.hold(msg)
        else:
            self._chan.send(msg)

    def drop(self, step: int) -> None:
        if self._copying.discard(step):  # never handed over: nothing to tell the persistence process
            return
        self._copying.send(block=True)
        self._early_step = None
        self._chan.send(m.Drop(step))

    def submit_snapshot(self, state: Staged[SnapshotState]) -> None:
        """Hand over a snapshot the stager packed into the snapshot arena (:meth:`alloc_snapshot`); on a GPU once its
        copies (tens of ms, not waited for) are seen complete at a later hand-over, snapshot, flush or close. A
        trainer that dies before then loses it, not a step (recovery replays from the snapshot before it)."""
        self._copying.send(block=True)  # a snapshot step: the record before the snapshot
        snap = state.item
        packed = snap.packed
        if packed is None or packed.packed.handle is None or packed.packed.handle[0] != self._snap_id:
            state.release()  # staged without the arena: only when the persistence process is gone
            if not self._chan.dead:
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
        self._chan.send(m.Snapshot(snap.step, where.regions, where.places, packed.skel, m.rng_bytes(snap.rng),
                              snap.param_groups, snap.compressor_name, snap.extra))

    def submit_shadow_snapshot(self, step: int) -> None:
        self._copying.send(block=True)
        self._chan.send(m.ShadowSnapshot(step))

    def set_batch_steps(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"batch_steps must be >= 1, got {steps}")
        self._copying.send(block=True)
        self.batch_steps = steps
        self._chan.send(m.BatchSteps(steps))

    def flush(self) -> int:
        """Wait until everything handed over is committed (or failed); returns the durable step."""
        chan = self._chan
        if chan.dead or chan.closed:
            chan.drain()
            return chan.durable_step
        self._copying.send(block=True)
        self._settle_snapshot(block=True)
        self._token += 1
        token = self._token
        chan.send(m.Flush(token))
        chan.wait(lambda: chan.flushed >= token)
        return chan.durable_step

    def close(self) -> None:
        chan = self._chan
        if chan.closed:
            return
        try:
            if not chan.dead:
                self.flush()
                chan.send(m.Close())
                chan.wait(lambda: chan.dead)
        finally:
            self._copying.discard()  # never handed over (the process died): its copies end before the unmapping
            pending, self._snap_copying = self._snap_copying, None
            chan.closed = True
            if pending is not None:  # never sent (the process died): its copies must end before the unmapping
                try:
                    pending.wait()
                except Exception:
                    pass
                pending.release()
            chan.shut()
            for arena in (self._ring, self._snap):
                if arena is not None:
                    arena.close()

    def _alloc_record(self, nbytes: int) -> tuple[int, int] | None:
        per = max(nbytes, 64) + 64
        # A ring that cannot hold a whole segment's records would wait forever for the persistence process, which
        # frees them only once the segment is written: replace it (a larger record, a larger batch_steps).
        if self._ring is None or (self.batch_steps + 2) * per > self._alloc.capacity:
            if self._ring is not None and self._records:
                self.flush()  # the open segment is committed early, so every slot comes back
                if not self._chan.wait(lambda: self._records == 0):
                    return None
            if self._ring is not None:
                self._ring.close()
            cap = max(_ring_min_bytes, (self.batch_steps + 2) * per,
                      min(self._max_records() * per, max(RING_MAX_BYTES, 4 * per)))
            self._ring, self._alloc = Arena(cap), RingAllocator(cap)
            self._ring_id += 1
            self._chan.send_arena("r", self._ring_id, self._ring.fd, self._ring.nbytes)
        got = self._alloc.alloc(nbytes) if self._records < self._max_records() else None
        if got is None:
            t0, ready = time.perf_counter(), self._chan.ready
            # The process may be waiting for the seal held back to complete the segment that frees slots.
            self._copying.send(block=True)
            self._settle_snapshot(block=False)
            self._chan.push()
            while got is None:
                if self._chan.dead:
                    return None
                self._chan.recv(block=True)
                if self._records < self._max_records():
                    got = self._alloc.alloc(nbytes)
            if ready:
                self.stats.blocked_s += time.perf_counter() - t0
            else:  # the process was still starting (importing torch), not a slow disk
                self.start_wait_s += time.perf_counter() - t0
                log.info("lowdiff: training waited %.1f s for the persistence process to start", self.start_wait_s)
        self._records += 1
        return got

    def _freed(self, slots: list[tuple[str, int, int]]) -> None:
        for ring_kind, ring_id, aid in slots:
            if ring_kind == "s":
                self._snap_busy = False
            elif ring_id == self._ring_id:
                self._alloc.free(aid)
                self._records -= 1
