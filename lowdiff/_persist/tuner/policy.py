"""The tuned snapshot policy: puts the controller's (every_steps, batch_steps) in force while training.

Used when ``snapshot.every_steps`` or ``log.batch_steps`` is ``auto``. It feeds the :class:`Profiler` from the
training thread (step times, snapshot blocking, the writer's counters handed in by the checkpointer), asks the
:class:`AutoTuner` to decide, records every decision in the run directory, and under DDP makes every rank take
rank 0's choice at the same steps (docs/reference/tuner-model.md, "Several ranks").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowdiff._persist.coordinator import Coordinator
from lowdiff._persist.tuner.auto import AutoTuner
from lowdiff._persist.tuner.solve import Decision
from lowdiff._persist.writer import WriterStats
from lowdiff._storage.format import Shard
from lowdiff._storage.run_dir import RunDir
from lowdiff.config import Config
from lowdiff.errors import UnsupportedError


class TunedPolicy:
    """``coordinator``: under DDP, the group rank 0's decisions are broadcast over (every rank must snapshot at
    the same steps and cut segments alike); without one, a gloo group of its own is created (a collective call:
    every rank constructs its policy at the same point). ``record_bytes_hint``: an upper bound on one step's
    record, the same on every rank (the bootstrap batch is capped by ``tuner.max_buffer_bytes`` with it)."""

    def __init__(self, config: Config, run_dir: RunDir, *, coordinator: Coordinator | None = None,
                 record_bytes_hint: float | None = None) -> None:
        tuner = AutoTuner.from_config(config, record_bytes_hint=record_bytes_hint)
        if tuner is None:
            raise ValueError("TunedPolicy needs snapshot.every_steps or log.batch_steps set to 'auto'")
        self.tuner = tuner
        self.run_dir = run_dir
        shard: Shard = run_dir.shard
        self._leads = shard.index == 0
        """Whether this rank measures and decides (every rank but 0 follows rank 0 under DDP)."""
        self._coord: Coordinator | None = None
        if shard.count > 1:
            coord = coordinator if coordinator is not None else Coordinator(ddp=True)
            if not coord.active or coord.world_size != shard.count or coord.rank != shard.index:
                raise UnsupportedError(
                    f"snapshot.every_steps / log.batch_steps 'auto' with {shard.count} writing ranks needs "
                    "torch.distributed initialized with one process per shard (rank 0 decides for all); "
                    "set integers otherwise")
            self._coord = coord
        self.last_snapshot_step = 0
        self._batch_anchor = 0
        self._writer_batch = 0
        """Steps per segment last handed to the writer (it applies a change when it reaches it in its queue)."""
        self._seen = WriterStats()
        self._prior_decisions: list[dict[str, Any]] = []
        self._probe_applied = False
        """Whether the writer runs with a probe's batch size (docs/reference/tuner-model.md, section 4)."""

    @property
    def every_steps(self) -> int:
        return self.tuner.current()[0]

    @property
    def batch_steps(self) -> int:
        return self.tuner.current()[1]

    @property
    def probing(self) -> bool:
        return self.tuner.probing

    @property
    def settled(self) -> bool:
        return self.tuner.settled

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(self.tuner.decisions)

    def start(self, durable_step: int) -> None:
        # Start from the previous process's last decision instead of the bootstrap values.
        self._prior_decisions = self.run_dir.read_decisions()
        self.tuner.seed(self._prior_decisions)
        self._sync()  # every rank starts from rank 0's values (its tuner.json, or the bootstrap)
        self.last_snapshot_step = self._batch_anchor = durable_step
        self._seen = WriterStats()  # a new writer counts from zero
        self._probe_applied = False
        self._writer_batch = self.batch_steps

    def wants_snapshot(self, step: int) -> bool:
        # Counted from the previous snapshot (or the resume point): a new interval applies at once, and since it
        # is a multiple of the batch, snapshots land on segment boundaries.
        return step - self.last_snapshot_step >= self.every_steps

    def observe_step(self, step: int, *, apply_s: float | None, record_bytes: float) -> None:
        if self._leads:
            self.tuner.profiler.on_step(step, apply_s=apply_s, record_bytes=record_bytes)

    def at_snapshot(self, step: int) -> int | None:
        """Switch to the tuner's batch size at a snapshot step, and cut the open segment if the snapshot falls
        inside it, so segments never straddle a snapshot."""
        self.last_snapshot_step = step
        b = self.batch_steps
        if b == self._writer_batch and (step - self._batch_anchor) % b == 0:
            return None
        return self._cut(step, b)

    def observe_snapshot(self, step: int, *, nbytes: float, block_s: float) -> None:
        if self._leads:
            self.tuner.profiler.on_snapshot(nbytes, block_s)

    def on_flush(self, last_step: int) -> None:
        """A flush wrote the partial segment: the writer's next segment starts after ``last_step``."""
        self._batch_anchor = last_step

    def after_step(self, step: int, writer: WriterStats) -> int | None:
        if self._coord is not None:
            # Rank 0 decides only at multiples of check_every_steps, and every rank takes its choice there: one
            # broadcast of three integers (F, B, probing) per check_every_steps steps, at the same steps on every
            # rank.
            if step % self.tuner.check_every_steps:
                if self._leads:
                    self._poll_writes(writer)
                return None
            if self._leads:
                self._poll_writes(writer)
                self._decide(step)
            self._sync()
            return self._apply_probe(step)
        self._poll_writes(writer)
        self._decide(step)
        return self._apply_probe(step)

    # -- internals -----------------------------------------------------------------------------------------------

    def _cut(self, step: int, b: int) -> int:
        self._writer_batch = b
        self._batch_anchor = step
        return b

    def _sync(self) -> None:
        """Under DDP: put rank 0's (every_steps, batch_steps) in force on every rank."""
        if self._coord is None:
            return
        f, b, probing = self._coord.broadcast_ints([*self.tuner.current(), int(self.tuner.probing)],
                                                   "tuner decision")
        if not self._leads:
            self.tuner.follow(f, b, probing=bool(probing))

    def _apply_probe(self, step: int) -> int | None:
        """When a probe starts or ends (at this step, on every rank alike under DDP): its batch size, or the
        decision's after it, applies at once. The probe puts no snapshot in its window, and the next snapshot
        after it cuts again if it falls inside a segment (:meth:`at_snapshot`)."""
        probing = self.tuner.probing
        if probing == self._probe_applied:
            return None
        self._probe_applied = probing
        return self._cut(step, self.batch_steps)

    def _poll_writes(self, st: WriterStats) -> None:
        prof, seen = self.tuner.profiler, self._seen
        st = dataclasses.replace(st)  # one reading of counters the writer thread bumps
        if st.blocked_s > seen.blocked_s:
            prof.on_blocked(st.blocked_s - seen.blocked_s)
            seen.blocked_s = st.blocked_s
        # Writes since the last poll, from the writer's counters (it bumps write_s, then the count, then the
        # bytes: wait until the bytes have caught up with the count).
        dseg, dsnap = st.segments - seen.segments, st.snapshots - seen.snapshots
        complete = ((not dseg or st.log_bytes > seen.log_bytes)
                    and (not dsnap or st.snapshot_bytes > seen.snapshot_bytes))
        if (dseg or dsnap) and complete:
            prof.on_writes(segments=dseg, segment_bytes=st.log_bytes - seen.log_bytes, snapshots=dsnap,
                           snapshot_bytes=st.snapshot_bytes - seen.snapshot_bytes, seconds=st.write_s - seen.write_s,
                           steps_per_segment=self._writer_batch, segment_steps=st.log_steps - seen.log_steps)
            self._seen = st

    def _decide(self, step: int) -> None:
        if self.tuner.update(step) is not None and self._leads:
            self.run_dir.record_decisions(self._prior_decisions + self.tuner.decisions_as_dicts())
