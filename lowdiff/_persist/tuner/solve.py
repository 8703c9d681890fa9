"""The tuner's solver: the (every_steps, batch_steps) that minimizes expected waste, as a logged Decision."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from lowdiff._persist.tuner.model import (
    Breakdown,
    Costs,
    Limits,
    evaluate,
    memory_batch_cap,
    min_batch_steps,
    young_daly_interval,
)

# Exhaustive search over B up to here, geometric steps beyond: the waste is smooth in B far from B_min.
_EXHAUSTIVE_BATCH = 128

CLOSEST_MARGIN = 0.25
"""When no point meets ``max_overhead`` or ``max_writer_load``: the points within this fraction of each bound of
the closest point's overhead and writer load are taken as equally close, and the one with the least waste wins."""


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
    """0 for a choice of the solver. > 0: not a choice but a measurement window (lowdiff._persist.tuner.auto): these
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
            f"max_overhead={lim.max_overhead:.3g}{' when_behind=replica' if lim.paced else ''} "
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

    When no point meets ``max_overhead`` / ``max_writer_load``, returns ``feasible=False`` and, among the points
    that come closest (within :data:`CLOSEST_MARGIN` of each bound of the closest one), the one with the least
    waste; ``max_log_bytes`` is never exceeded if any F allows it."""
    best = _search(costs, limits)
    closest, searched = None, limits
    if set(best.violations) - {"max_log_bytes"}:
        # The closest point is nearly always the largest F: it buys a sliver of overhead when the log itself
        # breaks the bound (its writes' interference, a disk slower than the log), and a recovery would replay
        # up to the whole run. Points about as close are as good an answer; among them, the least waste.
        closest = best
        searched = limits.replace(
            max_overhead=min(0.999, max(limits.max_overhead,
                                        best.overhead_bound + CLOSEST_MARGIN * limits.max_overhead)),
            max_writer_load=max(limits.max_writer_load, best.writer_load + CLOSEST_MARGIN * limits.max_writer_load))
        near = _search(costs, searched)
        best = evaluate(costs, limits, near.every_steps, near.batch_steps)  # its violations of the user's limits
    yd = young_daly_interval(costs, limits, best.batch_steps)
    bmin = min_batch_steps(costs, limits)
    at_bmin = None
    if bmin is not None and best.batch_steps > bmin and limits.batch_steps is None and limits.every_steps is None:
        at_bmin = _best_for_batch(costs, searched, bmin)
    return Decision(best.every_steps, best.batch_steps, best.waste_s_per_hour, best.overhead, best.feasible,
                    best, costs, limits, yd, bmin, _rationale(costs, limits, best, yd, bmin, at_bmin, closest))


def _search(costs: Costs, limits: Limits) -> Breakdown:
    """The feasible point of least waste, else the point that violates the limits least."""
    best: Breakdown | None = None
    for b in _batch_candidates(costs, limits):
        cand = _best_for_batch(costs, limits, b)
        if cand is None:
            continue
        if best is None or _rank(cand) < _rank(best):
            best = cand
    if best is None:  # max_every_steps below every candidate batch size
        best = evaluate(costs, limits, limits.max_every_steps, limits.max_every_steps)
    return best


def _rank(b: Breakdown) -> tuple[float, ...]:
    if b.feasible:
        return (0.0, 0.0, b.waste_fraction)
    return (1.0, float("max_log_bytes" in b.violations), b.overhead_bound + b.writer_load, b.waste_fraction)


def _rationale(c: Costs, lim: Limits, b: Breakdown, yd: float, bmin: int | None, at_bmin: Breakdown | None,
               closest: Breakdown | None = None) -> str:
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
    if lim.paced:
        lines.append("  log.when_behind: replica: training never waits for the writer (no stall) and snapshots are "
                     "written from the persistence process's replica (C_F = 0): the interval is the shortest the "
                     f"disk takes beside the log (the writer busy at most {lim.max_writer_load:.0%} of the time) "
                     "unless the writer's interference makes a longer one pay")
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
        lines.append(f"  LIMITS NOT MET ({', '.join(b.violations)}): no (F, B) satisfies them. Raise "
                     "tuner.max_overhead, use a faster disk or a smaller log per step")
        if lim.paced and "max_writer_load" in b.violations:
            lines.append("  log.when_behind: replica: training does not wait; the steps the disk cannot take are "
                         "left out of the log, and snapshots of the replica written as the writer frees up cover them")
        if closest is not None:
            lines.append(
                f"  the closest point, every_steps={closest.every_steps} batch_steps={closest.batch_steps}, has "
                f"overhead {closest.overhead_bound:.3%} (high alpha) and writer load {closest.writer_load:.1%} for "
                f"{closest.waste_s_per_hour:.2f} s/h of waste; this one, within {CLOSEST_MARGIN:.0%} of each bound "
                f"of it, has {b.overhead_bound:.3%} and {b.writer_load:.1%}")
    return "\n".join(lines)


# -- persisted decisions (lowdiff inspect) ------------------------------------------------------------------
