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

    def __init__(self, config: Config, compressor_name: str, shard: Shard = UNSHARDED) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.compressor_name = compressor_name
        self.shard = shard
        self._writer: BackgroundWriter | None = None
        self._lock: WriterLock | None = None
        # snapshot.every_steps / log.batch_steps "auto": measured online, solved by lowdiff.tuner (docs/TUNER.md).
        self.tuner = AutoTuner.from_config(config)
        if self.tuner is not None and shard.count > 1:
            raise UnsupportedError("snapshot.every_steps / log.batch_steps 'auto' is not supported with sharded "
                                   "(multi-rank) writes yet: every rank must snapshot at the same steps. Set "
                                   "integers (the tuner's choice on one rank, from its log, is a good start)")
        self._last_snapshot_step = 0
        self._batch_anchor = 0
        self._seen = WriterStats()
        self._prior_decisions: list[dict[str, Any]] = []

    def open(self) -> None:
        """Create the directory layout, take the lock and remove stale ``*.tmp`` files (rank 0 only: the
        lock stands for the whole job)."""
        for d in (self.run_dir, self.run_dir / SNAPSHOT_DIR, self.run_dir / LOG_DIR):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = WriterLock(self.run_dir)
        removed = clean_stale_tmp(self.run_dir)
        if removed:
            log.info("lowdiff: removed %d uncommitted file(s) left by an earlier crash", len(removed))

    def start(self, durable_step: int, shadow: Any = None) -> None:
        cfg = self.config
        if self.tuner is not None:
            self._seed_tuner()
        self._last_snapshot_step = self._batch_anchor = durable_step
        self._seen = WriterStats()  # the new writer counts from zero
        codec = resolve_codec(cfg.log.codec, cfg.compressor.name)
        self._writer = BackgroundWriter(self.run_dir, batch_steps=self.batch_steps, codec=codec,
                                        compressor=self.compressor_name, queue_depth=cfg.log.queue_depth,
                                        keep_snapshots=cfg.snapshot.keep, durable_step=durable_step,
                                        shard=self.shard, shadow=shadow)

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
        prof = self.tuner.profiler if self.tuner is not None else None
        if prof is not None:
            prof.on_step(record.step, apply_s=apply_s, record_bytes=record.payload_nbytes)
        self._writer.submit_record(record)
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

    # -- auto-tuning (docs/TUNER.md) ----------------------------------------------------------------------------

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
        b, w = self.batch_steps, self._writer
        if b == w.batch_steps and (step - self._batch_anchor) % b == 0:
            return
        # Waits for the queued records: rare (a new decision or a re-aligned interval), and it keeps the size
        # change in order with the records. A writer-side set_batch_steps would avoid the wait.
        w.flush()
        w.batch_steps = b
        self._batch_anchor = step

    def _tune(self, step: int) -> None:
        assert self.tuner is not None and self._writer is not None
        prof, st, seen = self.tuner.profiler, self._writer.stats, self._seen
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
                           steps_per_segment=self._writer.batch_steps)
            self._seen = dataclasses.replace(st)
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

