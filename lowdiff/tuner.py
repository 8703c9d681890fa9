"""The tuner's cost model: pick the full-snapshot interval F and the log batch size B from measured costs.

Pure arithmetic: no torch, no I/O, no clock, no logging, so it is unit-testable and the benchmark can call the
very same functions. Measuring the inputs is :mod:`lowdiff.profiler`'s job; the derivation is docs/reference/tuner-model.md.

>>> costs = Costs(iteration_s=0.1, diff_bytes=200e3, snapshot_bytes=400e6, snapshot_block_s=0.3,
...               write_bytes_per_s=300e6, write_latency_s=0.008, replay_step_s=0.01)
>>> d = solve(costs, Limits(mtbf_s=24 * 3600))
>>> d.every_steps % d.batch_steps, d.feasible
(0, True)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DECISIONS_FILE = "tuner.json"
"""Run-directory file holding every decision of the run (a JSON object with a ``decisions`` list)."""

# Exhaustive search over B up to here, geometric steps beyond: the waste is smooth in B far from B_min.
_EXHAUSTIVE_BATCH = 128


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
    """Headroom: the writer must be busy at most this fraction of the time, or jitter turns into stalls."""
    every_steps: int | None = None
    """Fixed by the user (an int in the config): only B is tuned, among the divisors of F."""
    batch_steps: int | None = None
    """Fixed by the user: only F is tuned, among the multiples of B."""
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
        _check("max_writer_load", self.max_writer_load, lambda v: 0 < v <= 1, "in (0, 1]")
        for name in ("every_steps", "batch_steps"):
            v = getattr(self, name)
            if v is not None:
                _check(name, v, lambda x: x >= 1, ">= 1 or None")
        _check("max_batch_steps", self.max_batch_steps, lambda v: v >= 1, ">= 1")
        _check("max_every_steps", self.max_every_steps, lambda v: v >= 1, ">= 1")
        _check("max_buffer_bytes", self.max_buffer_bytes, lambda v: v >= 0, ">= 0")


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
    stall = max(stall_burst, stall_rate)
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


@dataclass(frozen=True)
class Decision:
    """The tuner's answer, with everything needed to explain and reproduce it."""

    every_steps: int
    batch_steps: int
    waste_s_per_hour: float
    overhead: float
    feasible: bool
    breakdown: Breakdown
    costs: Costs
    limits: Limits
    young_daly_every_steps: float
    min_batch_steps: int | None
    rationale: str
    reason: str = "initial"
    step: int = 0
    probe_steps: int = 0
    """0 for a choice of the solver. > 0: not a choice but a measurement window (lowdiff.profiler): these
    (every_steps, batch_steps) are in force for ``probe_steps`` steps after ``step`` so that the profiler sees
    steps without a concurrent write, then (F, B) is re-solved; the model's numbers are those of the probe's
    settings and only describe the window."""

    @property
    def is_probe(self) -> bool:
        return self.probe_steps > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (what ``RUN_DIR/tuner.json`` and ``lowdiff inspect`` use)."""
        return {
            "step": self.step, "reason": self.reason, "probe_steps": self.probe_steps,
            "every_steps": self.every_steps,
            "batch_steps": self.batch_steps, "waste_s_per_hour": self.waste_s_per_hour,
            "overhead": self.overhead, "feasible": self.feasible,
            "young_daly_every_steps": self.young_daly_every_steps, "min_batch_steps": self.min_batch_steps,
            "costs": {k: (dict(v) if k == "sources" else v) for k, v in asdict(self.costs).items()},
            "limits": asdict(self.limits),
            "breakdown": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.breakdown).items()},
            "rationale": self.rationale,
        }

    def with_context(self, *, reason: str, step: int) -> Decision:
        return self.replace(reason=reason, step=step)

    def replace(self, **changes: Any) -> Decision:
        return Decision(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})

    def summary(self) -> str:
        """One line: the choice and every input number."""
        c, lim = self.costs, self.limits
        if self.is_probe:
            return (f"probe for {self.probe_steps} steps: every_steps={self.every_steps} "
                    f"batch_steps={self.batch_steps} [{self.reason} at step {self.step}] inputs: {inputs_line(c, lim)}")
        return (f"every_steps={self.every_steps} batch_steps={self.batch_steps} "
                f"waste={self.waste_s_per_hour:.2f} s/h overhead={self.overhead:.2%}"
                f"{'' if self.feasible else ' (limits not met: ' + ', '.join(self.breakdown.violations) + ')'}"
                f" [{self.reason} at step {self.step}] inputs: {inputs_line(c, lim)}")


def inputs_line(c: Costs, lim: Limits) -> str:
    """Every input number on one line (decision summaries and rationales)."""
    return (f"T={c.iteration_s * 1e3:.3g} ms S_d={_b(c.diff_bytes)} S_F={_b(c.snapshot_bytes)} "
            f"C_F={c.snapshot_block_s * 1e3:.3g} ms BW_w={_b(c.write_bytes_per_s)}/s "
            f"l_w={c.write_latency_s * 1e3:.3g} ms "
            f"BW_r={_b(c.read_bw)}/s l_r={c.read_latency_s * 1e3:.3g} ms t_rep={c.replay_step_s * 1e3:.3g} ms "
            f"R={c.restart_s:.3g} s alpha={c.write_interference:.3g}{_alpha_high(c)} MTBF={lim.mtbf_s / 3600:.3g} h "
            f"max_overhead={lim.max_overhead:.3g} "
            f"max_log_bytes={_b(lim.max_log_bytes) if lim.max_log_bytes else 'none'} "
            f"queue_depth={lim.queue_depth} keep={lim.keep_snapshots}")


def _alpha_high(c: Costs) -> str:
    return "" if c.write_interference_high is None else f" (bound: {c.write_interference_high:.3g})"


def _b(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


# -- the solver ------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _batch_candidates(costs: Costs, limits: Limits) -> list[int]:
    if limits.batch_steps is not None:
        return [limits.batch_steps]
    cap = memory_batch_cap(costs, limits)
    top = limits.max_batch_steps if cap is None else min(limits.max_batch_steps, cap)
    if limits.every_steps is not None:
        return [d for d in _divisors(limits.every_steps) if d <= top] or [1]
    out = list(range(1, min(top, _EXHAUSTIVE_BATCH) + 1))
    b = float(_EXHAUSTIVE_BATCH)
    while b < top:
        b *= 1.06
        out.append(min(top, int(b)))
    return sorted(set(out))


def _best_for_batch(costs: Costs, limits: Limits, b: int) -> Breakdown | None:
    """Best F (a multiple of b) for this b: the feasible multiples form an interval (overhead and writer load
    fall with F, the log grows with it) and the waste is unimodal on it."""
    if limits.every_steps is not None:
        return evaluate(costs, limits, limits.every_steps, b)
    m_max = limits.max_every_steps // b
    if m_max < 1:
        return None
    if limits.max_log_bytes and costs.diff_bytes > 0:
        per_step = max(limits.keep_snapshots, 1) * costs.diff_bytes
        m_max = min(m_max, int(limits.max_log_bytes // (per_step * b)))
        if m_max < 1:
            return evaluate(costs, limits, b, b)
    memo: dict[int, Breakdown] = {}

    def ev(m: int) -> Breakdown:
        if m not in memo:
            memo[m] = evaluate(costs, limits, m * b, b)
        return memo[m]

    def ok(m: int) -> bool:
        return not (set(ev(m).violations) - {"max_log_bytes"})

    if not ok(m_max):
        return ev(m_max)  # infeasible for this b: the largest F violates least
    lo, hi = 1, m_max
    if not ok(lo):
        while hi - lo > 1:  # smallest feasible multiple
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid
        lo = hi
    hi = m_max
    # A coarse log scan finds the basin, a ternary search refines it, a final scan settles integer ties.
    probes = sorted({lo, hi, *(int(round(lo * (hi / lo) ** (k / 40))) for k in range(41))})
    best = min(probes, key=lambda m: ev(m).waste_fraction)
    i = probes.index(best)
    a, z = probes[max(0, i - 1)], probes[min(len(probes) - 1, i + 1)]
    while z - a > 6:
        m1, m2 = a + (z - a) // 3, z - (z - a) // 3
        if ev(m1).waste_fraction <= ev(m2).waste_fraction:
            z = m2
        else:
            a = m1
    best = min(range(a, z + 1), key=lambda m: (ev(m).waste_fraction, m))
    return ev(best)


def solve(costs: Costs, limits: Limits) -> Decision:
    """Minimize the expected waste over (F, B), F a multiple of B, subject to the limits.

    When no point meets ``max_overhead`` / ``max_writer_load``, returns the point that comes closest (largest
    allowed F) with ``feasible=False``; ``max_log_bytes`` is never exceeded if any F allows it."""
    best: Breakdown | None = None
    for b in _batch_candidates(costs, limits):
        cand = _best_for_batch(costs, limits, b)
        if cand is None:
            continue
        if best is None or _rank(cand) < _rank(best):
            best = cand
    if best is None:  # max_every_steps below every candidate batch size
        best = evaluate(costs, limits, limits.max_every_steps, limits.max_every_steps)
    yd = young_daly_interval(costs, limits, best.batch_steps)
    bmin = min_batch_steps(costs, limits)
    at_bmin = None
    if bmin is not None and best.batch_steps > bmin and limits.batch_steps is None and limits.every_steps is None:
        at_bmin = _best_for_batch(costs, limits, bmin)
    return Decision(best.every_steps, best.batch_steps, best.waste_s_per_hour, best.overhead, best.feasible,
                    best, costs, limits, yd, bmin, _rationale(costs, limits, best, yd, bmin, at_bmin))


def _rank(b: Breakdown) -> tuple[float, ...]:
    if b.feasible:
        return (0.0, 0.0, b.waste_fraction)
    return (1.0, float("max_log_bytes" in b.violations), b.overhead_bound + b.writer_load, b.waste_fraction)


def _rationale(c: Costs, lim: Limits, b: Breakdown, yd: float, bmin: int | None, at_bmin: Breakdown | None) -> str:
    lam_h = 3600.0 / lim.mtbf_s
    src = "".join(f"\n    ({k}: {v})" for k, v in sorted(c.sources.items()))
    lines = [
        f"chose every_steps={b.every_steps}, batch_steps={b.batch_steps}: expected waste "
        f"{b.waste_s_per_hour:.2f} s per hour ({b.waste_fraction:.3%} of wall time)",
        f"  inputs: {inputs_line(c, lim)}{src}",
        f"  Young/Daly with replay: F* = sqrt(2 C / (lambda T r)) = {yd:.0f} steps "
        f"(C = C_F + alpha*w_F = {(c.snapshot_block_s + c.write_interference * b.snapshot_write_s) * 1e3:.3g} ms, "
        f"lambda = {lam_h:.3g}/h, r = {b.replay_step_s * 1e3:.3g} ms/step)",
        f"  smallest sustainable batch: B_min = ceil(l_w / ({lim.max_writer_load:g} T - S_d/BW_w)) = "
        + (f"{bmin}" if bmin is not None else "none (the log alone outruns the disk)"),
        f"  writes: segment {b.segment_write_s * 1e3:.3g} ms, snapshot {b.snapshot_write_s * 1e3:.3g} ms; "
        f"writer busy {b.writer_load:.1%} of the time",
        f"  overhead {b.overhead:.3%}: capture {c.snapshot_block_s * 1e3:.3g} ms + stall {b.stall_s * 1e3:.3g} ms + "
        f"interference {b.interference_s * 1e3:.3g} ms per {b.period_s:.4g} s interval; "
        f"{b.overhead_bound:.3%} with the high estimate of alpha (checked against max_overhead)",
        f"  per failure {b.failure_cost_s:.4g} s: restart {c.restart_s:.3g} + load snapshot {b.load_s:.3g} + "
        f"replay {b.replay_steps:.0f} steps x {b.replay_step_s * 1e3:.3g} ms + lost work {b.lag_s:.3g} s",
        f"  log on disk {_b(b.log_bytes)}"
        + (f" (cap {_b(lim.max_log_bytes)})" if lim.max_log_bytes else " (no cap)"),
    ]
    if lim.every_steps is not None:
        lines.append(f"  every_steps fixed at {lim.every_steps} by the config; B chosen among its divisors")
    if lim.batch_steps is not None:
        lines.append(f"  batch_steps fixed at {lim.batch_steps} by the config; F chosen among its multiples")
    cap = memory_batch_cap(c, lim)
    if cap is not None and lim.batch_steps is None and b.batch_steps >= cap:
        lines.append(f"  B capped at {cap} by max_buffer_bytes {_b(lim.max_buffer_bytes)}: up to queue_depth "
                     f"{lim.queue_depth} x B records of {_b(c.record_bytes or c.diff_bytes)} wait for the writer")
    if at_bmin is not None:
        m = at_bmin
        lines.append(
            f"  B raised from B_min={bmin} because it pays: at B={bmin} (best F={m.every_steps}) the waste is "
            f"{m.waste_s_per_hour:.2f} s/h (stall {m.stall_s * 1e3:.3g} ms + "
            f"interference {m.interference_s * 1e3:.3g} ms "
            f"per interval, lost work {m.lag_s:.3g} s, replay {m.replay_step_s * 1e3:.3g} ms/step) vs "
            f"{b.waste_s_per_hour:.2f} s/h at B={b.batch_steps}")
    if not b.feasible:
        lines.append(f"  LIMITS NOT MET ({', '.join(b.violations)}): no (F, B) satisfies them; this is the "
                     "closest point. Raise tuner.max_overhead, use a faster disk or a smaller log per step")
    return "\n".join(lines)


# -- persisted decisions (lowdiff inspect) ------------------------------------------------------------------


def format_decisions(decisions: Iterable[Mapping[str, Any]]) -> str:
    """Human-readable table of decisions as stored by :meth:`Decision.to_dict` (for ``lowdiff inspect``)."""
    rows = []
    for d in decisions:
        c = d.get("costs", {})
        if d.get("probe_steps"):
            rows.append(
                f"  step {d.get('step')}: PROBE for {d.get('probe_steps')} steps, every_steps={d.get('every_steps')} "
                f"batch_steps={d.get('batch_steps')} ({d.get('reason')}; durability lag up to "
                f"{d.get('batch_steps')} steps meanwhile, nothing skipped)")
            continue
        rows.append(
            f"  step {d.get('step')}: every_steps={d.get('every_steps')} batch_steps={d.get('batch_steps')} "
            f"waste {d.get('waste_s_per_hour', float('nan')):.2f} s/h, overhead {d.get('overhead', 0):.2%} "
            f"({d.get('reason')}; T={c.get('iteration_s', 0) * 1e3:.3g} ms, "
            f"BW_w={_b(c.get('write_bytes_per_s', 0))}/s, l_w={c.get('write_latency_s', 0) * 1e3:.3g} ms)"
            + ("" if d.get("feasible", True) else " LIMITS NOT MET")
        )
    return "\n".join(rows) if rows else "  (no tuner decisions)"


__all__ = ["Costs", "Limits", "Breakdown", "Decision", "evaluate", "solve", "young_daly_interval",
           "min_batch_steps", "format_decisions", "inputs_line", "DECISIONS_FILE"]
