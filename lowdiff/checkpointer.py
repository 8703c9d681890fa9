"""Owns the run directory while training: writer lock, background writer, full-vs-differential decision."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from pathlib import Path

from lowdiff.config import Config
from lowdiff.errors import CheckpointWriteError
from lowdiff.storage.atomic import clean_stale_tmp
from lowdiff.storage.format import LOG_DIR, SNAPSHOT_DIR, Shard
from lowdiff.storage.lock import WriterLock
from lowdiff.storage.log_writer import BackgroundWriter, WriterStats
from lowdiff.storage.segment import StepRecord
from lowdiff.storage.snapshot import SnapshotState

log = logging.getLogger(__name__)


class Checkpointer:
    """Decides full vs differential per step and hands both to the background writer."""

    def __init__(self, config: Config, compressor_name: str, shard: Shard = Shard()) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.compressor_name = compressor_name
        self.shard = shard
        self._writer: BackgroundWriter | None = None
        self._lock: WriterLock | None = None
        self._disabled_by_error = False

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
        self._writer = BackgroundWriter(self.run_dir, batch_steps=cfg.log.batch_steps, codec=cfg.log.codec,
                                        compressor=self.compressor_name, queue_depth=cfg.log.queue_depth,
                                        keep_snapshots=cfg.snapshot.keep, durable_step=durable_step,
                                        shard=self.shard, shadow=shadow)

    @property
    def stats(self) -> WriterStats:
        return self._writer.stats if self._writer else WriterStats()

    @property
    def durable_step(self) -> int:
        return self._writer.durable_step if self._writer else 0

    def wants_snapshot(self, step: int) -> bool:
        return step % self.config.snapshot.every_steps == 0

    def on_step(self, record: StepRecord, capture: Callable[[], SnapshotState]) -> None:
        self.check()
        if self._writer is None or self._disabled_by_error:
            return
        self._writer.submit_record(record)
        if self.wants_snapshot(record.step):
            if self._writer.shadow_ok:
                self._writer.submit_shadow_snapshot(record.step)
            else:
                self._writer.submit_snapshot(capture())

    def snapshot_now(self, state: SnapshotState) -> None:
        assert self._writer is not None
        self._writer.submit_snapshot(state)

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


__all__ = ["Checkpointer", "CheckpointWriteError", "WriterLock"]
