"""The checkpointer: every staged step record to the writer, and a full snapshot when the policy says.

Path of one step, top down: the wrapper stages the record (:mod:`lowdiff._training.stager`) and calls :meth:`on_step`;
the checkpointer asks its :class:`~lowdiff._persist.snapshot_policy.SnapshotPolicy` whether this step is a snapshot step
and hands record and snapshot to the :class:`~lowdiff._persist.thread_writer.BackgroundWriter`, which commits them
through the :class:`~lowdiff._storage.run_dir.RunDir`. Nothing below calls back up.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lowdiff._persist.coordinator import Coordinator
from lowdiff._persist.snapshot_policy import FixedInterval, SnapshotPolicy
from lowdiff._persist.thread_writer import BackgroundWriter
from lowdiff._persist.writer import Writer, WriterStats
from lowdiff._storage.format import STOP_DIR, Shard, snapshot_name
from lowdiff._storage.later import Later
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Staged
from lowdiff.config import Config, resolve_codec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointStats:
    """What the checkpointer has done so far in this process (``opt.stats``); a reading, not a live view.

    Counters cover the writer started by ``wrap()`` / ``resume()`` in this process."""

    durable_step: int
    """The newest step guaranteed on disk."""
    steps_committed: int
    """Steps in the log segments committed so far."""
    segments: int
    snapshots: int
    log_bytes: int
    snapshot_bytes: int
    write_s: float
    """Time the writer spent writing and committing files."""
    blocked_s: float
    """Time training waited because the writer's queue was full (the disk is slower than the log grows)."""
    steps_skipped: int
    """``log.when_behind: replica``: steps left out of the log because the disk was behind (a snapshot of the
    persistence process's replica covers each of them); 0 otherwise."""
    queued: int
    """Items waiting in the writer's queue now."""
    every_steps: int
    """Snapshot interval in force (the tuner's current choice under ``auto``)."""
    batch_steps: int
    """Steps per log segment in force (the tuner's current choice under ``auto``)."""
    last_snapshot_step: int
    shadow: bool
    """Whether snapshots are written from the shadow replica (``snapshot.shadow``, still healthy)."""
    tuner_probing: bool
    """Whether a tuner probe of the writer's interference is in force."""
    tuner_settled: bool
    """Whether the snapshot interval and batch size stand: fixed ones always; under ``auto``, decided with nothing
    left to measure (no probe in force, no decision waiting for the writer's interference). Time only settled
    steps in a benchmark."""
    tuner_decisions: tuple[Any, ...]
    """The tuner's decisions in this process (:class:`lowdiff._persist.tuner.Decision`), oldest first."""
    write_error: str | None
    """The background write failure in force (the log is not being written until the next snapshot commits),
    or None."""
    writer_cpu_s: float = 0.0
    """CPU time the writer has used so far: the writer thread's, or the whole persistence process's with
    ``log.persistence: process`` (as of its last report: every commit, and every ``flush()``)."""
    host_buffers_reused: int = 0
    """Step records staged into reused host buffers (compressor none on the CPU) instead of fresh allocations."""
    snapshot_buffers_reused: int = 0
    """Snapshots staged into the host buffers of an earlier, persisted snapshot."""
    layerwise: LayerwiseStats | None = None
    """Layer-wise capture (``log.capture: layerwise``), None when gradients are copied in step()."""
    remote_durable_step: int | None = None
    """``remote.url``: the newest step whose files are all in the remote store (-1: none confirmed yet); None
    without a remote (or on a rank other than 0, whose persistence side uploads every rank's files)."""
    remote_lag_steps: int = 0
    """Steps durable on the local disk and not yet in the remote store."""
    remote_lag_bytes: int = 0
    """Bytes of committed files still to upload (as of the mirror's last pass)."""
    remote_lag_s: float = 0.0
    """How long the oldest committed file not yet uploaded has waited (0: caught up)."""


@dataclass(frozen=True)
class LayerwiseStats:
    hits: int
    """Gradients taken from the copies the hooks made during backward."""
    misses: int
    """Gradients copied again in step() because they changed after their hook ran (clipping, accumulation)."""
    active: bool
    """False once the hooks were removed as useless (gradients changed after backward, step after step)."""


def make_policy(config: Config, run_dir: RunDir, coordinator: Coordinator | None,
                record_bytes_hint: float | None) -> SnapshotPolicy:
    if config.snapshot.every_steps == "auto" or config.log.batch_steps == "auto":
        from lowdiff._persist.tuner.policy import TunedPolicy

        return TunedPolicy(config, run_dir, coordinator=coordinator, record_bytes_hint=record_bytes_hint)
    return FixedInterval(int(config.snapshot.every_steps), int(config.log.batch_steps))


class Checkpointer:
    """Owns the writer and the snapshot policy while training. Call order: :meth:`start` (after the run directory
    holds a committed snapshot), then per step :meth:`check` (before the inner step), :meth:`needs_capture` and
    :meth:`on_step`; :meth:`flush` / :meth:`close` at the end."""

    def __init__(self, config: Config, run_dir: RunDir, policy: SnapshotPolicy) -> None:
        self.config = config
        self._blocked_reported = 0.0  # back-pressure already reported, seconds
        self.run_dir = run_dir
        self.policy = policy
        self.retention = RetentionPolicy(config.snapshot.keep)
        self._writer: Writer | None = None
        self._last_submitted = 0
        self.remote: dict[str, Any] | None = remote_settings(config)
        """The ``remote`` section the writer's mirror gets (lowdiff/_persist/mirror.py), None without one."""
        self.on_stop: Callable[[int], None] | None = None
        """Called by :meth:`close` with the durable step once the log is whole (lowdiff._training.opening writes the
        compressor's memory of a clean stop there)."""

    def start(self, durable_step: int, shadow: Any = None) -> None:
        cfg = self.config
        self.policy.start(durable_step)
        self._last_submitted = durable_step
        settings: dict[str, Any] = dict(
            batch_steps=self.policy.batch_steps, codec=resolve_codec(cfg.log.codec, cfg.compressor.name),
            compressor=cfg.compressor.name, queue_depth=cfg.log.queue_depth, retention=self.retention,
            durable_step=durable_step, shadow=shadow, when_behind=cfg.log.when_behind, remote=self.remote)
        if cfg.log.persistence == "process" and (why := _process_unavailable()) is None:
            from lowdiff._persist.process_writer import ProcessWriter

            self._writer = ProcessWriter(self.run_dir, **settings)
        else:
            if cfg.log.persistence == "process":
                log.warning("lowdiff: log.persistence: process cannot run here (%s); %s uses a writer thread, so a "
                            "crash of this process can lose up to log.batch_steps steps not yet written (set "
                            "log.persistence: thread to silence this)", why, self.run_dir.path)
            self._writer = BackgroundWriter(self.run_dir, **settings)

    def restart(self, shadow: Any) -> None:
        """A new writer from step 0 with this shadow replica (snapshot 0 was written again before the first step);
        nothing has been handed to the old one."""
        if self._writer is not None:
            self._writer.close()
            self.check()
        self.start(durable_step=0, shadow=shadow)

    @property
    def slots(self) -> Any:
        """Where the stager packs step records (lowdiff._training.stager.Slots): the writer's host buffers or ring."""
        return self._writer.slots if self._writer is not None else None

    def on_writer_thread(self) -> bool:
        """Whether the caller runs on the background writer's thread."""
        return self._writer is not None and self._writer.on_thread()

    @property
    def writer_stats(self) -> WriterStats:
        return self._writer.stats if self._writer else WriterStats()

    @property
    def durable_step(self) -> int:
        return self._writer.durable_step if self._writer else 0

    def stats(self) -> CheckpointStats:
        st, pol = self.writer_stats, self.policy
        return CheckpointStats(
            durable_step=self.durable_step, steps_committed=st.log_steps, segments=st.segments,
            snapshots=st.snapshots, log_bytes=st.log_bytes, snapshot_bytes=st.snapshot_bytes, write_s=st.write_s,
            blocked_s=st.blocked_s, steps_skipped=st.steps_skipped, queued=self._writer.queued if self._writer else 0,
            every_steps=pol.every_steps, batch_steps=pol.batch_steps, last_snapshot_step=pol.last_snapshot_step,
            shadow=bool(self._writer and self._writer.shadow_ok), tuner_probing=pol.probing, tuner_settled=pol.settled,
            tuner_decisions=pol.decisions, writer_cpu_s=st.cpu_s,
            write_error=str(err) if (err := self._writer.error if self._writer else None) is not None else None,
            **self._remote_stats(st))

    def _remote_stats(self, st: WriterStats) -> dict[str, Any]:
        if self.remote is None or self.run_dir.shard.index != 0:
            return {}
        since = st.remote_behind_since
        return dict(remote_durable_step=st.remote_durable_step,
                    remote_lag_steps=max(0, self.durable_step - max(st.remote_durable_step, 0)) if since else 0,
                    remote_lag_bytes=st.remote_lag_bytes, remote_lag_s=max(0.0, time.time() - since) if since else 0.0)

    def needs_capture(self, step: int) -> bool:
        """Whether the wrapper must stage a snapshot of its state at ``step`` (a snapshot step that the shadow
        replica does not provide)."""
        return (self._writer is not None and self.policy.wants_snapshot(step)
                and not self._writer.shadow_ok)

    def on_hold(self, record: Staged[StepRecord], *, keep_if_orphaned: bool) -> None:
        """``opt.step()`` has applied the step of ``record``; its iteration has not ended. A persistence process
        takes the record now (so a crash of the training process cannot lose it); a writer thread at
        :meth:`on_step`."""
        if self._writer is not None:
            self._writer.submit_early(record, keep_if_orphaned)

    @property
    def wants_end_known(self) -> bool:
        """Whether :meth:`on_end_known` is worth its cost: the persistence process holds records before their
        iteration ends; the writer thread does not (reading a GradScaler's state is a device sync)."""
        return self._writer is not None and not isinstance(self._writer, BackgroundWriter)

    def on_end_known(self, record: Staged[StepRecord], data: dict[str, Any], end_groups: list[dict[str, Any]],
                     later: Sequence[Later] = ()) -> None:
        """The end state of the held ``record``'s iteration is known (its tracked objects' end calls have run),
        before the iteration formally ends: a persistence process commits the record with it should the training
        process die now (once ``later``, the values in it still being copied from a device, are complete)."""
        if self._writer is not None:
            self._writer.end_known(record, data, end_groups, later)

    def before_seal(self) -> None:
        """The held record's iteration is about to be sealed (its end state taken, which may copy values from the
        device): a persistence process takes the record first, as it was when ``opt.step()`` returned."""
        if self._writer is not None:
            self._writer.before_seal()

    def on_rng_retaken(self, record: Staged[StepRecord]) -> None:
        """The RNG state of the held ``record`` was taken again (``opt.capture_rng()``). A persistence process
        that holds the record, and would commit it as it is if the training process died now, gets the new state
        at once; a writer thread sees it when the iteration ends."""
        if self._writer is not None:
            self._writer.retake_rng(record)

    def on_drop(self, step: int) -> None:
        """The iteration of ``step`` was interrupted and is not logged (its record was handed over early)."""
        if self._writer is not None:
            self._writer.drop(step)

    def on_step(self, record: Staged[StepRecord], *, snapshot: Staged[SnapshotState] | None = None,
                snapshot_block_s: float = 0.0, apply_s: float | None = None) -> None:
        """Hand the step's staged record (and, at a snapshot step, the staged snapshot) to the writer.

        ``apply_s``: decode + inner optimizer step of this step (the tuner's replay-cost estimate);
        ``snapshot_block_s``: how long staging the snapshot held the training thread. Never raises a background
        failure: the step has already been applied, and :meth:`check` reports failures before the next inner
        step, so an exception always means "this step did not happen"."""
        writer = self._writer
        if writer is None:
            record.release()
            if snapshot is not None:
                snapshot.release()
            return
        step = record.item.step
        self.policy.observe_step(step, apply_s=apply_s, record_bytes=record.item.payload_nbytes)
        writer.submit_record(record)
        self._last_submitted = step
        if self.policy.wants_snapshot(step):
            cut = self.policy.at_snapshot(step)
            if cut is not None:
                # In the writer's queue after this step's record: the cut and the new size land exactly here.
                writer.set_batch_steps(cut)
            if snapshot is not None:
                self.policy.observe_snapshot(step, nbytes=_state_nbytes(snapshot.item), block_s=snapshot_block_s)
                writer.submit_snapshot(snapshot)
            elif writer.shadow_ok:
                writer.submit_shadow_snapshot(step)
                self.policy.observe_snapshot(step, nbytes=0, block_s=0.0)  # no blocking here: the replica has it
        elif snapshot is not None:
            snapshot.release()
        cut = self.policy.after_step(step, writer.stats)
        if cut is not None:
            writer.set_batch_steps(cut)

    def waited(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for a snapshot's copy (lowdiff._training.stager): counted with the
        waits for the writer (``opt.stats.blocked_s``, which the tuner reads as stalls)."""
        if seconds > 0 and self._writer is not None:
            self._writer.stats.blocked_s += seconds

    def report_backpressure(self, step: int) -> None:
        """Warn when training has waited for the writer (the disk is slower than the log grows), at most once per
        ``log.backpressure_warn_s`` of added waiting."""
        st = self.writer_stats
        if st.blocked_s - self._blocked_reported < self.config.log.backpressure_warn_s:
            return
        self._blocked_reported = st.blocked_s
        mb_s = st.log_bytes / st.write_s / 1e6 if st.write_s > 0 else 0.0
        log.warning("lowdiff: training has waited %.1f s in all for the checkpoint writer by step %d: the log grows "
                    "faster than the disk takes it (writer: %.0f MB/s). Use a compressor, a faster disk, or larger "
                    "steps (more tokens per step); nothing is lost meanwhile", st.blocked_s, step, mb_s)

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
        self.policy.on_flush(self._last_submitted)
        self.check()
        return step

    def close(self) -> None:
        """Commit everything handed over, then (the log whole) ``on_stop(durable_step)``, then release the run
        directory."""
        try:
            if self._writer is not None:
                self._writer.close()
                self.check()
                if self.on_stop is not None:
                    self.on_stop(self._writer.durable_step)
                if self.remote is not None and self.run_dir.shard.index == 0:
                    self._last_upload(self._writer.durable_step)
        finally:
            self.run_dir.release()

    def _wait_for_sibling_stops(self, durable: int) -> None:
        """Under torch.distributed each rank writes its shard of a clean stop's file in its own ``close()``: rank 0
        uploads the set only once every shard is there (up to ``remote.close_timeout_s``), else a recovery from the
        bucket would find the set incomplete and restart the compressors' memory."""
        shard = self.run_dir.shard
        stops = self.run_dir.path / STOP_DIR
        if shard.count < 2 or not (stops / snapshot_name(durable, shard)).exists():
            return
        names = [snapshot_name(durable, Shard(i, shard.count)) for i in range(shard.count)]
        deadline = time.monotonic() + float(self.remote["close_timeout_s"]) if self.remote else 0.0
        while not all((stops / n).exists() for n in names) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _last_upload(self, durable: int) -> None:
        """After the writer's mirror: what this process committed after the writer closed (a clean stop's stop
        file; lowdiff._training.opening), then say which steps are not remote-durable."""
        assert self.remote is not None
        self._wait_for_sibling_stops(durable)
        remote = self.writer_stats.remote_durable_step
        if remote >= durable:
            from lowdiff._persist.mirror import Mirror

            remote = min(remote, Mirror(self.run_dir.path, self.remote, WriterStats(), durable_step=durable).close())
        if remote >= durable:
            log.info("lowdiff: every step up to %d is in %s", durable, self.remote["url"])
            return
        log.warning("lowdiff: steps %d to %d are not remote-durable: they are on the local disk in %s only, not yet "
                    "in %s (remote.close_timeout_s: %s s passed). A later run with this remote uploads them; until "
                    "then a loss of this machine loses them", max(remote, -1) + 1, durable, self.run_dir.path,
                    self.remote["url"], self.remote["close_timeout_s"])


def remote_settings(config: Config) -> dict[str, Any] | None:
    """The ``remote`` section as the mirror takes it (a plain dict: it crosses to the persistence process)."""
    rc = config.remote
    if rc.url is None:
        return None
    return {"url": rc.url, "storage_options": dict(rc.storage_options), "close_timeout_s": rc.close_timeout_s,
            "lag_warn_s": rc.lag_warn_s}


def _state_nbytes(state: SnapshotState) -> int:
    tensors = [*state.params.values(), *state.buffers.values()]
    tensors += [v for st in state.optimizer_state.values() for v in st.values() if hasattr(v, "element_size")]
    tensors += [v for st in state.compressor_state.values() for v in st.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _process_unavailable() -> str | None:
    """Why a persistence process cannot run on this platform, or None: it shares memory with the trainer through
    an anonymous memory file (``memfd_create``, Linux) whose descriptor crosses a Unix socket."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return f"no memfd_create on {sys.platform}"
    try:
        os.close(os.memfd_create("lowdiff-probe", os.MFD_CLOEXEC))
    except OSError as e:  # a seccomp profile that forbids it
        return f"memfd_create failed: {e}"
    return None
