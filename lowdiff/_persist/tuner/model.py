"""The tuner's cost model: pick the full-snapshot interval F and the log batch size B from measured costs.

Pure arithmetic: no torch, no I/O, no clock, no logging, so it is unit-testable and the benchmark can call the
very same functions. Measuring the inputs is :mod:`lowdiff._persist.tuner.profiler`'s job, the solver
:mod:`lowdiff._persist.tuner.solve`; the derivation is docs/reference/tuner-model.md.

>>> costs = Costs(iteration_s=0.1, diff_bytes=200e3, snapshot_bytes=400e6, snapshot_block_s=0.3,
...               write_bytes_per_s=300e6, write_latency_s=0.008, replay_step_s=0.01)
>>> d = solve(costs, Limits(mtbf_s=24 * 3600))
>>> d.every_steps % d.batch_steps, d.feasible
(0, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Measured inputs of the model; all times in seconds, sizes in bytes (on disk, after the codec)."""

    iteration_s: float
    """T: one training step without checkpoint overhead (median)."""
    diff_bytes: float
    """S_d: bytes the log grows per step."""
    snapshot_bytes: float
    """S_F: bytes of one full snapshot."""
    snapshot_block_s: float
    """C_F: time the training thread is blocked capturing a snapshot (the persist runs in the background)."""
    write_bytes_per_s: float
    """BW_w: write bandwidth of the background writer (slope of write time vs bytes)."""
    write_latency_s: float
    """l_w: fixed cost of one committed write (file creation, fsync, rename; intercept of the fit)."""
    replay_step_s: float
    """t_rep: decode + optimizer step of one replayed step, reading excluded."""
    read_bytes_per_s: float = 0.0
    """BW_r: read bandwidth during recovery; 0 = assume the write bandwidth."""
    read_latency_s: float = 0.0
    """l_r: fixed cost of opening one file during recovery."""
    restart_s: float = 0.0
    """R: relaunch until recovery starts (scheduler, process start, model build); shifts waste, not the optimum."""
    write_interference: float = 0.0
    """alpha: seconds of training lost per second the writer is busy (CPU/GIL/memory-bandwidth contention)."""
    write_interference_high: float | None = None
    """An upper estimate of alpha, used only to check ``max_overhead`` (None: ``write_interference``). On a noisy
    machine the measured alpha is uncertain: the optimum is sought with the low estimate (noise must not read
    as contention), the bound is kept with the high one (noise must not hide contention)."""
    record_bytes: float = 0.0
    """Host bytes of one step's record while it waits for the writer (raw payload); 0: assume ``diff_bytes``."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where a value came from when it was not measured directly (e.g. ``replay_step_s: "apply time"``)."""

    def __post_init__(self) -> None:
        for name in ("iteration_s", "write_bytes_per_s"):
            _check(name, getattr(self, name), lambda v: v > 0, "> 0")
        for name in ("diff_bytes", "snapshot_bytes", "snapshot_block_s", "write_latency_s", "replay_step_s",
                     "read_bytes_per_s", "read_latency_s", "restart_s", "record_bytes"):
            _check(name, getattr(self, name), lambda v: v >= 0, ">= 0")
        _check("write_interference", self.write_interference, lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.write_interference_high is not None:
            _check("write_interference_high", self.write_interference_high,
                   lambda v: self.write_interference <= v <= 1, "in [write_interference, 1]")

    @property
    def read_bw(self) -> float:
        return self.read_bytes_per_s or self.write_bytes_per_s

    def replace(self, **changes: Any) -> Costs:
        return Costs(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What the user asks for (``tuner:`` section) and what the run fixes (queue depth, retention)."""

    mtbf_s: float
    """Mean time between failures of the whole job; the failure rate is 1 / mtbf_s."""
    max_overhead: float = 0.02
    """Bound on the checkpoint overhead as a fraction of wall time (snapshot capture, stalls, interference)."""
    max_log_bytes: int = 0
    """Bound on the log kept on disk, 0 = none. The retained log spans max(keep, 1) snapshot intervals."""
    queue_depth: int = 4
    """``log.queue_depth``: segments' worth of records that may wait before step() blocks."""
    keep_snapshots: int = 0
    """``snapshot.keep`` (0 = keep all)."""
    max_writer_load: float = 0.8
    """Headroom: the writer must be busy at most this fraction of the time, or jitter turns into stalls (above 1
    only where the solver looks for the points nearest an unreachable bound)."""
    every_steps: int | None = None
    """Fixed by the user (an int in the config): only B is tuned, among the divisors of F."""
    batch_steps: int | None = None
    """Fixed by the user: only F is tuned, among the multiples of B."""
    paced: bool = False
    """``log.when_behind: replica``: what the writer has no room for is left out of the log (a snapshot of the
    persistence process's replica covers it) instead of making training wait, so nothing stalls; snapshots cost
    the training thread nothing (C_F = 0, measured) and the writer-load bound alone sets how often they come."""
    max_every_steps: int = 1_000_000
    max_batch_steps: int = 4096
    max_buffer_bytes: int = 1 << 30
    """Host memory the records waiting for the writer may take (``tuner.max_buffer_bytes``): up to queue_depth
    segments of B records wait, so B is never chosen above max_buffer_bytes / (queue_depth x record bytes).
    0: no bound."""

    def __post_init__(self) -> None:
        _check("mtbf_s", self.mtbf_s, lambda v: v > 0, "> 0")
        _check("max_overhead", self.max_overhead, lambda v: 0 < v < 1, "in (0, 1)")
        _check("max_log_bytes", self.max_log_bytes, lambda v: v >= 0, ">= 0")
        _check("queue_depth", self.queue_depth, lambda v: v >= 1, ">= 1")
        _check("keep_snapshots", self.keep_snapshots, lambda v: v >= 0, ">= 0")
        _check("max_writer_load", self.max_writer_load, lambda v: v > 0, "> 0")
        for name in ("every_steps", "batch_steps"):
            v = getattr(self, name)
            if v is not None:
                _check(name, v, lambda x: x >= 1, ">= 1 or None")
        _check("max_batch_steps", self.max_batch_steps, lambda v: v >= 1, ">= 1")
        _check("max_every_steps", self.max_every_steps, lambda v: v >= 1, ">= 1")
        _check("max_buffer_bytes", self.max_buffer_bytes, lambda v: v >= 0, ">= 0")

    def replace(self, **changes: Any) -> Limits:
        return Limits(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def memory_batch_cap(costs: Costs, limits: Limits) -> int | None:
    """The largest B whose waiting records fit ``max_buffer_bytes`` (None: no bound); at least 1."""
    per_step = costs.record_bytes or costs.diff_bytes
    if not limits.max_buffer_bytes or per_step <= 0:
        return None
    return max(1, int(limits.max_buffer_bytes // (limits.queue_depth * per_step)))


def _check(name: str, value: Any, ok: Any, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
        raise ValueError(f"tuner input '{name}' must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class Breakdown:
    """The model evaluated at one (F, B): every intermediate quantity, for the rationale and the tests."""

    every_steps: int
    batch_steps: int
    segment_write_s: float
    """w_seg = l_w + B*S_d/BW_w."""
    snapshot_write_s: float
    """w_F = l_w + S_F/BW_w."""
    stall_s: float
    """Training blocked on the full queue, per snapshot interval."""
    interference_s: float
    """alpha * writer busy time, per snapshot interval."""
    period_s: float
    """Wall time of one snapshot interval: F*T + C_F + stall + interference."""
    overhead: float
    """Fraction of wall time that is checkpoint overhead."""
    writer_load: float
    """Fraction of wall time the background writer is busy."""
    lag_s: float
    """Mean time since the newest durable step completed: the work a failure throws away."""
    replay_steps: float
    """Mean number of logged steps a recovery replays."""
    replay_step_s: float
    """Per replayed step: t_rep + S_d/BW_r + l_r/B."""
    load_s: float
    """Loading the snapshot: l_r + S_F/BW_r."""
    failure_cost_s: float
    """Per failure: restart + load + replay + lost work."""
    waste_fraction: float
    log_bytes: float
    """Log retained on disk: max(keep, 1) * F * S_d."""
    violations: tuple[str, ...]
    overhead_bound: float = 0.0
    """The overhead with the high estimate of alpha: what ``max_overhead`` is checked against."""

    @property
    def waste_s_per_hour(self) -> float:
        return 3600.0 * self.waste_fraction

    @property
    def feasible(self) -> bool:
        return not self.violations


def evaluate(costs: Costs, limits: Limits, every_steps: int, batch_steps: int) -> Breakdown:
    """Expected waste of snapshotting every ``every_steps`` steps with ``batch_steps`` steps per segment.

    Assumes snapshots fall on segment boundaries (F a multiple of B, which :func:`solve` guarantees)."""
    f, b = int(every_steps), int(batch_steps)
    if f < 1 or b < 1:
        raise ValueError(f"every_steps and batch_steps must be >= 1, got {f}, {b}")
    c = costs
    t = c.iteration_s
    lam = 1.0 / limits.mtbf_s
    w_seg = c.write_latency_s + b * c.diff_bytes / c.write_bytes_per_s
    w_snap = c.write_latency_s + c.snapshot_bytes / c.write_bytes_per_s
    writer_busy = (f / b) * w_seg + w_snap
    interference = c.write_interference * writer_busy
    base = f * t + c.snapshot_block_s
    # Snapshot burst: after capture the writer still finishes the segment ending at the snapshot step, then
    # persists the snapshot; meanwhile records pile up, and step() blocks once queue_depth*B+2 items wait.
    busy_after_submit = max(0.0, w_seg - c.snapshot_block_s) + w_snap
    stall_burst = max(0.0, busy_after_submit - (limits.queue_depth * b + 2) * t)
    # Throughput: a writer slower than training throttles it to the writer's pace.
    stall_rate = max(0.0, writer_busy - base - interference)
    # log.when_behind: replica leaves out of the log what the writer has no room for: training never waits.
    stall = 0.0 if limits.paced else max(stall_burst, stall_rate)
    period = base + interference + stall
    overhead = (period - f * t) / period
    step_s = (period - c.snapshot_block_s - stall) / f
    # Lost work: a failure at a uniform time loses the time since the newest durable step completed. Segments
    # commit every B steps, w_seg after their last step: mean w_seg + B*T/2. After each snapshot the writer
    # is busy with it; the segments behind it commit late by d0, shrinking by (B*T - w_seg) per segment.
    snap_durable = max(w_seg, c.snapshot_block_s) + w_snap
    gap = b * step_s - w_seg
    d0 = max(0.0, snap_durable - c.snapshot_block_s - b * step_s)
    extra_area = b * step_s * d0 * (d0 / gap + 1.0) / 2.0 if gap > 0 else d0 * period / 2.0
    lag = w_seg + b * step_s / 2.0 + extra_area / period
    # Replay: the steps since the newest durable snapshot; it becomes durable snap_durable after its step, so
    # for that fraction of the interval recovery starts from the one before (F more steps).
    replay_steps = max(0.0, f / 2.0 - lag / step_s) + f * min(1.0, snap_durable / period)
    r = c.replay_step_s + c.diff_bytes / c.read_bw + c.read_latency_s / b
    load = c.read_latency_s + c.snapshot_bytes / c.read_bw
    failure_cost = c.restart_s + load + replay_steps * r + lag
    waste = overhead + lam * failure_cost * (1.0 - overhead)
    log_bytes = max(limits.keep_snapshots, 1) * f * c.diff_bytes
    violations = []
    if limits.max_log_bytes and log_bytes > limits.max_log_bytes:
        violations.append("max_log_bytes")
    alpha_high = c.write_interference if c.write_interference_high is None else c.write_interference_high
    period_high = period + (alpha_high - c.write_interference) * writer_busy
    overhead_bound = (period_high - f * t) / period_high
    if overhead_bound > limits.max_overhead:
        violations.append("max_overhead")
    if writer_busy / period > limits.max_writer_load:
        violations.append("max_writer_load")
    return Breakdown(f, b, w_seg, w_snap, stall, interference, period, overhead, writer_busy / period, lag,
                     replay_steps, r, load, failure_cost, waste, log_bytes, tuple(violations), overhead_bound)


def young_daly_interval(costs: Costs, limits: Limits, batch_steps: int = 1) -> float:
    """First-order optimum F* = sqrt(2 C / (lambda T r)), with C the per-snapshot cost (capture + interference
    of its persist) and r the cost of replaying one step (read + decode + apply), in place of recompute."""
    c = costs
    w_snap = c.write_latency_s + c.snapshot_bytes / c.write_bytes_per_s
    per_snapshot = c.snapshot_block_s + c.write_interference * w_snap
    r = c.replay_step_s + c.diff_bytes / c.read_bw + c.read_latency_s / batch_steps
    lam = 1.0 / limits.mtbf_s
    if r <= 0 or per_snapshot <= 0:
        return float(limits.max_every_steps) if per_snapshot > 0 else 1.0
    return math.sqrt(2.0 * per_snapshot / (lam * c.iteration_s * r))


def min_batch_steps(costs: Costs, limits: Limits) -> int | None:
    """Smallest B the writer sustains at most ``max_writer_load`` busy on the log alone:
    B_min = ceil(l_w / (load*T - S_d/BW_w)); None when no B does (the log alone outruns the disk)."""
    c = costs
    room = limits.max_writer_load * c.iteration_s - c.diff_bytes / c.write_bytes_per_s
    if room <= 0:
        return None
    return max(1, math.ceil(c.write_latency_s / room - 1e-12))


