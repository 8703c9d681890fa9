"""Owns the run directory while training: writer lock, background writer, full-vs-differential decision."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowdiff.config import Config, resolve_codec
from lowdiff.distributed import Coordinator
from lowdiff.errors import UnsupportedError
from lowdiff.profiler import AutoTuner
from lowdiff.storage.atomic import clean_stale_tmp, write_json_atomic
from lowdiff.storage.format import LOG_DIR, SNAPSHOT_DIR, UNSHARDED, Shard
from lowdiff.storage.lock import WriterLock
from lowdiff.storage.log_writer import BackgroundWriter, WriterStats
from lowdiff.storage.segment import StepRecord
from lowdiff.storage.snapshot import SnapshotState
from lowdiff.tuner import DECISIONS_FILE

log = logging.getLogger(__name__)


class Checkpointer:
    """Decides full vs differential per step and hands both to the background writer."""

    def __init__(self, config: Config, compressor_name: str, shard: Shard = UNSHARDED,
                 coordinator: Coordinator | None = None, record_bytes_hint: float | None = None) -> None:
        """``coordinator``: under DDP with ``auto`` settings, the group rank 0's tuning decisions are broadcast
        over (every rank must snapshot at the same steps and cut segments alike); without one, a gloo group of
        its own is created (a collective call: every rank constructs its Checkpointer at the same point).
        ``record_bytes_hint``: an upper bound on one step's record, the same on every rank (the tuner's bootstrap
        batch is capped by ``tuner.max_buffer_bytes`` with it)."""
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.compressor_name = compressor_name
        self.shard = shard
        self._writer: BackgroundWriter | None = None
        self._lock: WriterLock | None = None
        # snapshot.every_steps / log.batch_steps "auto": measured online, solved by lowdiff.tuner (docs/reference/tuner-model.md).
        self.tuner = AutoTuner.from_config(config, record_bytes_hint=record_bytes_hint)
        self._coord: Coordinator | None = None
        if self.tuner is not None and shard.count > 1:
            # Rank 0's tuner decides; the others follow (docs/reference/tuner-model.md, "Several ranks").
            coord = coordinator if coordinator is not None else Coordinator(ddp=True)
            if not coord.active or coord.world_size != shard.count or coord.rank != shard.index:
                raise UnsupportedError(
                    f"snapshot.every_steps / log.batch_steps 'auto' with {shard.count} writing ranks needs "
                    "torch.distributed initialized with one process per shard (rank 0 decides for all); "
                    "set integers otherwise")
            self._coord = coord
        self._last_snapshot_step = 0
        self._batch_anchor = 0
        self._last_submitted = 0
        self._writer_batch = 0
        """Steps per segment last handed to the writer (it applies a change when it reaches it in its queue)."""
        self._seen = WriterStats()
        self._prior_decisions: list[dict[str, Any]] = []
        self._probe_applied = False
        """Whether the writer runs with a tuner probe's batch size (docs/reference/tuner-model.md, section 4)."""
        self.run_id: str | None = None
        """The run id every file written is stamped with (the manifest's; set when the run directory is opened)."""

    def open(self) -> None:
        """Create the directory layout, take the lock and remove stale ``*.tmp`` files (rank 0 only: the
        lock stands for the whole job)."""
        for d in (self.run_dir, self.run_dir / SNAPSHOT_DIR, self.run_dir / LOG_DIR):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = WriterLock(self.run_dir)
        removed = clean_stale_tmp(self.run_dir)
        if removed:
            log.info("lowdiff: removed %d uncommitted file(s) left by an earlier crash", len(removed))

    @property
    def _leads(self) -> bool:
        """Whether this rank measures and decides (every rank but 0 follows rank 0 under DDP)."""
        return self.shard.index == 0

    def _sync_tuner(self) -> None:
        """Under DDP: put rank 0's (every_steps, batch_steps) in force on every rank. Called by every rank at the
        same steps (start, then every ``check_every_steps`` steps: the only steps rank 0 can decide at)."""
        if self._coord is None:
            return
        assert self.tuner is not None
        f, b, probing = self._coord.broadcast_ints([*self.tuner.current(), int(self.tuner.probing)],
                                                   "tuner decision")
        if not self._leads:
            self.tuner.follow(f, b, probing=bool(probing))

    def start(self, durable_step: int, shadow: Any = None) -> None:
        cfg = self.config
        if self.tuner is not None:
            self._seed_tuner()
            self._sync_tuner()  # every rank starts from rank 0's values (its tuner.json, or the bootstrap)
        self._last_snapshot_step = self._batch_anchor = self._last_submitted = durable_step
        self._seen = WriterStats()  # the new writer counts from zero
        self._probe_applied = False
        codec = resolve_codec(cfg.log.codec, cfg.compressor.name)
        self._writer_batch = self.batch_steps
        self._writer = BackgroundWriter(self.run_dir, batch_steps=self._writer_batch, codec=codec,
                                        compressor=self.compressor_name, queue_depth=cfg.log.queue_depth,
                                        keep_snapshots=cfg.snapshot.keep, durable_step=durable_step,
                                        shard=self.shard, shadow=shadow, run_id=self.run_id,
                                        compressor_params={"ratio": cfg.compressor.ratio, "rank": cfg.compressor.rank})

    def on_writer_thread(self) -> bool:
        """Whether the caller runs on the background writer's thread."""
        return self._writer is not None and self._writer.on_thread()

    @property
    def stats(self) -> WriterStats:
        return self._writer.stats if self._writer else WriterStats()

    @property
    def durable_step(self) -> int:
        return self._writer.durable_step if self._writer else 0

    @property
    def every_steps(self) -> int:
        """Snapshot interval in force (the tuner's current choice under ``auto``)."""
        return self.tuner.current()[0] if self.tuner is not None else int(self.config.snapshot.every_steps)

    @property
    def batch_steps(self) -> int:
        """Steps per log segment in force (the tuner's current choice under ``auto``)."""
        return self.tuner.current()[1] if self.tuner is not None else int(self.config.log.batch_steps)

    def wants_snapshot(self, step: int) -> bool:
        if self.tuner is None:
            return step % self.every_steps == 0
        # Counted from the previous snapshot (or the resume point): a new interval applies at once, and since it
        # is a multiple of the batch, snapshots land on segment boundaries.
        return step - self._last_snapshot_step >= self.every_steps

    def on_step(self, record: StepRecord, capture: Callable[[], SnapshotState],
                apply_s: float | None = None) -> None:
        """``apply_s``: time of decode + inner optimizer step of this step (the tuner's replay-cost estimate).

        Never raises a background failure: the step has already been applied, and step() reports failures
        before the next inner step, so an exception always means "this step did not happen"."""
        if self._writer is None:
            return
        prof = self.tuner.profiler if self.tuner is not None and self._leads else None
        if prof is not None:
            prof.on_step(record.step, apply_s=apply_s, record_bytes=record.payload_nbytes)
        self._writer.submit_record(record)
        self._last_submitted = record.step
        if self.wants_snapshot(record.step):
            if self.tuner is not None:
                self._realign(record.step)
            if self._writer.shadow_ok:
                self._writer.submit_shadow_snapshot(record.step)
                if prof is not None:
                    prof.on_snapshot(0, 0.0)  # the writer's replica provides it: no blocking here
            else:
                t0 = time.perf_counter()
                state = capture()
                if prof is not None:
                    prof.on_snapshot(_state_nbytes(state), time.perf_counter() - t0)
                self._writer.submit_snapshot(state)
            self._last_snapshot_step = record.step
        if self.tuner is not None:
            self._tune(record.step)

    # -- auto-tuning (docs/reference/tuner-model.md) ----------------------------------------------------------------------------

    def _seed_tuner(self) -> None:
        """Start from the previous process's last decision instead of the bootstrap values."""
        assert self.tuner is not None
        path = self.run_dir / DECISIONS_FILE
        if not path.is_file():
            return
        try:
            self._prior_decisions = list(json.loads(path.read_text())["decisions"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("lowdiff: ignoring unreadable %s (%s); the tuner starts from scratch", path, e)
            self._prior_decisions = []
        self.tuner.seed(self._prior_decisions)

    def _realign(self, step: int) -> None:
        """At a snapshot step (its record already queued): switch to the tuner's batch size, and cut the open
        segment if the snapshot falls inside it, so segments never straddle a snapshot."""
        assert self.tuner is not None and self._writer is not None
        b = self.batch_steps
        if b == self._writer_batch and (step - self._batch_anchor) % b == 0:
            return
        # An item in the writer's queue, after this step's record: the cut and the new size land exactly here,
        # in order with the records, and the training thread does not wait.
        self._writer.set_batch_steps(b)
        self._writer_batch = b
        self._batch_anchor = step

    def _tune(self, step: int) -> None:
        assert self.tuner is not None and self._writer is not None
        if self._coord is not None:
            # Rank 0 decides only at multiples of check_every_steps, and every rank takes its choice there:
            # one broadcast of three integers (F, B, probing) per check_every_steps steps, at the same steps on
            # every rank.
            if step % self.tuner.check_every_steps:
                if self._leads:
                    self._poll_writes()
                return
            if self._leads:
                self._poll_writes()
                self._decide(step)
            self._sync_tuner()
            self._apply_probe(step)
            return
        self._poll_writes()
        self._decide(step)
        self._apply_probe(step)

    def _apply_probe(self, step: int) -> None:
        """When a tuner probe starts or ends (at this step, on every rank alike under DDP): its batch size, or
        the decision's after it, applies at once instead of at the next snapshot. The open segment is cut after
        this step's record; the probe puts no snapshot in its window (its every_steps is long enough), and the
        next snapshot after it cuts again if it falls inside a segment (``_realign``)."""
        assert self.tuner is not None and self._writer is not None
        probing = self.tuner.probing
        if probing == self._probe_applied:
            return
        self._probe_applied = probing
        b = self.batch_steps
        self._writer.set_batch_steps(b)
        self._writer_batch = b
        self._batch_anchor = step

    def _poll_writes(self) -> None:
        assert self.tuner is not None and self._writer is not None
        prof, seen = self.tuner.profiler, self._seen
        st = dataclasses.replace(self._writer.stats)  # one reading of counters the writer thread bumps
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
        assert self.tuner is not None
        if self.tuner.update(step) is not None and self.shard.index == 0:
            path = self.run_dir / DECISIONS_FILE
            try:
                write_json_atomic(path, {"decisions": self._prior_decisions + self.tuner.decisions_as_dicts()})
            except OSError as e:
                log.warning("lowdiff: could not record the tuner's decision in %s: %s", path, e)

    def check(self) -> None:
        """Raise (or warn about) a failure of the background writer in the calling thread."""
        if self._writer is None:
            return
        err = self._writer.take_error()
        if err is None:
            return
        if self.config.on_write_error == "raise":
            raise err
        log.warning("lowdiff: %s; training continues, checkpointing resumes at the next snapshot", err)

    def flush(self) -> int:
        if self._writer is None:
            return 0
        step = self._writer.flush()
        # The flush wrote the partial segment: the writer's next segment starts after the last submitted step.
        self._batch_anchor = self._last_submitted
        self.check()
        return step

    def close(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
                self.check()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None


def _state_nbytes(state: SnapshotState) -> int:
    tensors = [*state.params.values(), *state.buffers.values()]
    tensors += [v for st in state.optimizer_state.values() for v in st.values() if hasattr(v, "element_size")]
    tensors += [v for st in state.compressor_state.values() for v in st.values()]
    return sum(t.numel() * t.element_size() for t in tensors)

