"""The controller: holds the (every_steps, batch_steps) in force and re-solves when measurements drift."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
from lowdiff._persist.tuner.profiler import (
    MIN_INTERFERENCE_STEPS,
    PROBE_BATCH_STEPS,
    PROBE_STEPS,
    Profiler,
)
from lowdiff._persist.tuner.solve import Decision, inputs_line, solve

log = logging.getLogger(__name__)


def _drift(old: float, new: float) -> float:
    return abs(new / old - 1.0) if old > 0 else (0.0 if new == 0 else math.inf)


@dataclass(frozen=True)
class _Probe:
    """A probe in force: (every_steps, batch_steps) of the probe from ``start`` + 1 to ``end``, then re-solve."""

    start: int
    end: int


class AutoTuner:
    """Holds the (every_steps, batch_steps) in force and re-solves when measurements drift.

    ``every_steps`` / ``batch_steps``: an int fixes that knob (only the other is tuned), None tunes it.
    Until the first decision, the bootstrap values are used (a multiple of the batch, so snapshots land on
    segment boundaries).

    The writer's interference alpha is measured from steps with and without a concurrent write. When a decision
    is made without it and it matters (the chosen point, checked with alpha = 1, would break ``max_overhead``),
    the tuner measures it before settling: if the window lacks steps that overlapped a write, the decision goes
    in force and the tuner re-solves as soon as alpha is measured; if it lacks steps without a write, it runs a
    probe: ``probe_steps`` steps with no snapshot and ``probe_batch_steps`` steps per segment (so most steps see
    no write), logged as a :class:`Decision` with ``probe_steps`` > 0, then re-solves with the measured alpha.
    At most one probe per re-tune (docs/reference/tuner-model.md, section 4)."""

    def __init__(self, *, mtbf_s: float, max_overhead: float = 0.02, max_log_bytes: int = 0,
                 retune_drift: float = 0.2, queue_depth: int = 4, keep_snapshots: int = 0,
                 every_steps: int | None = None, batch_steps: int | None = None,
                 restart_s: float = 0.0, profiler: Profiler | None = None, check_every_steps: int = 8,
                 bootstrap_every_steps: int = 128, bootstrap_batch_steps: int = 16,
                 probe_steps: int = PROBE_STEPS, probe_batch_steps: int = PROBE_BATCH_STEPS,
                 max_buffer_bytes: int = 1 << 30, record_bytes_hint: float | None = None,
                 paced: bool = False) -> None:
        """``record_bytes_hint``: an upper bound on one step's record (the dense gradient bytes), known before
        the first step: the bootstrap batch is capped so its waiting records fit ``max_buffer_bytes``."""
        self.limits = Limits(mtbf_s=mtbf_s, max_overhead=max_overhead, max_log_bytes=max_log_bytes,
                             queue_depth=queue_depth, keep_snapshots=keep_snapshots,
                             every_steps=every_steps, batch_steps=batch_steps, max_buffer_bytes=max_buffer_bytes,
                             paced=paced)
        if not 0 < retune_drift:
            raise ValueError(f"retune_drift must be > 0, got {retune_drift}")
        if probe_steps < 1 or probe_batch_steps < 1:
            raise ValueError(f"probe_steps and probe_batch_steps must be >= 1, got {probe_steps}, {probe_batch_steps}")
        self.retune_drift = retune_drift
        self.restart_s = restart_s
        self.profiler = profiler or Profiler()
        self.check_every_steps = check_every_steps
        self.probe_steps = probe_steps
        self.probe_batch_steps = probe_batch_steps
        self.decisions: list[Decision] = []
        """Every decision of this process, oldest first (see :meth:`Decision.to_dict`); probes among them
        (``Decision.probe_steps`` > 0)."""
        if record_bytes_hint and max_buffer_bytes:
            bootstrap_batch_steps = max(1, min(bootstrap_batch_steps,
                                               int(max_buffer_bytes // (queue_depth * record_bytes_hint))))
        b = batch_steps or bootstrap_batch_steps
        if every_steps is not None:
            b = batch_steps or _largest_divisor_at_most(every_steps, bootstrap_batch_steps)
        f = every_steps or max(b, bootstrap_every_steps // b * b)
        self._current = (f, b)
        self._last_check = -1
        self._last_decision_step = -(10**18)
        self._probe: _Probe | None = None
        self._probing = False
        """A probe's settings are in force (rank 0: its own probe; other ranks: as broadcast)."""
        self._alpha_pending: int | None = None
        """Step of the decision in force that was made without alpha where alpha matters (measure, then
        re-solve), or None."""

    @classmethod
    def from_config(cls, config: Any, profiler: Profiler | None = None,
                    record_bytes_hint: float | None = None) -> AutoTuner | None:
        """An AutoTuner when ``snapshot.every_steps`` or ``log.batch_steps`` is ``"auto"``, else None."""
        every, batch = config.snapshot.every_steps, config.log.batch_steps
        if every != "auto" and batch != "auto":
            return None
        t = config.tuner
        return cls(mtbf_s=t.mtbf_hours * 3600.0, max_overhead=t.max_overhead, max_log_bytes=t.max_log_bytes or 0,
                   retune_drift=t.retune_drift, queue_depth=config.log.queue_depth,
                   keep_snapshots=config.snapshot.keep, every_steps=None if every == "auto" else every,
                   batch_steps=None if batch == "auto" else batch, profiler=profiler,
                   max_buffer_bytes=t.max_buffer_bytes, record_bytes_hint=record_bytes_hint,
                   paced=config.log.when_behind == "replica")

    def current(self) -> tuple[int, int]:
        """(every_steps, batch_steps) in force now (a probe's while :attr:`probing`)."""
        return self._current

    @property
    def probing(self) -> bool:
        """A probe is in force: its batch size applies at once (not at the next snapshot) and so does the
        decision's that ends it (:class:`lowdiff._persist.checkpointer.Checkpointer` cuts the open segment)."""
        return self._probing

    @property
    def settled(self) -> bool:
        """Decided, and nothing left to measure before the decision stands: no probe in force and no decision
        waiting for alpha (a benchmark should time only settled steps)."""
        return bool(self.decisions) and self._probe is None and self._alpha_pending is None

    def seed(self, decisions: Sequence[Mapping[str, Any]]) -> None:
        """Start from the newest decision of an earlier process of the same run (read from tuner.json), instead
        of the bootstrap values, until this process has measured enough to decide itself. Probes are skipped:
        a process that stopped during one resumes with the decision before it."""
        decisions = [d for d in decisions if not (isinstance(d, Mapping) and d.get("probe_steps"))]
        if not decisions:
            return
        try:
            f, b = int(decisions[-1]["every_steps"]), int(decisions[-1]["batch_steps"])
        except (KeyError, TypeError, ValueError):
            log.warning("lowdiff tuner: ignoring an unreadable earlier decision %r", decisions[-1])
            return
        if self.limits.every_steps is not None:
            f = self.limits.every_steps
        if self.limits.batch_steps is not None:
            b = self.limits.batch_steps
        if f >= 1 and b >= 1 and f % b == 0:
            self._current = (f, b)

    def follow(self, every_steps: int, batch_steps: int, probing: bool = False) -> None:
        """Put (every_steps, batch_steps) in force as decided elsewhere (under DDP: by rank 0's tuner);
        ``probing``: they are a probe's."""
        if every_steps < 1 or batch_steps < 1 or every_steps % batch_steps:
            raise ValueError(f"every_steps={every_steps} must be a positive multiple of batch_steps={batch_steps}")
        self._current = (int(every_steps), int(batch_steps))
        self._probing = bool(probing)

    def update(self, step: int) -> Decision | None:
        """Call once per step (cheap). Returns the new decision (or probe) when one was made, else None."""
        if self._last_check >= 0 and step - self._last_check < self.check_every_steps:
            return None
        self._last_check = step
        if self._probe is not None:
            return self._end_probe(step) if step >= self._probe.end else None
        if self._alpha_pending is not None:
            d = self._pursue_alpha(step)
            if d is not None or self._alpha_pending is not None:
                return d
        if self.decisions and step - self._last_decision_step < self.profiler.min_steps * 4:
            return None  # let the windows refill after a change before judging drift again
        reason = self._why_solve()
        if reason is None:
            return None
        costs = self.profiler.costs(restart_s=self.restart_s)
        if costs is None:
            return None
        d = solve(costs, self.limits).with_context(reason=reason, step=step)
        at_full = _at_full_interference(d)
        if at_full is None:
            return self._put_in_force(d)
        # alpha was not measured and the bound depends on it: the decision goes in force (its settings keep the
        # writer busy, so steps with a write come), and the next checks measure alpha, by a probe if steps
        # without a write are what is missing (_pursue_alpha).
        self._alpha_pending = step
        busy, idle = self.profiler.interference_steps()
        note = (f"\n  alpha not measured ({busy} steps overlapped a write, {idle} none; {MIN_INTERFERENCE_STEPS} of "
                f"each needed) and it matters: with alpha = 1 this choice's overhead would be "
                f"{at_full.overhead_bound:.3%} against max_overhead {self.limits.max_overhead:.3g} (writer busy "
                f"{d.breakdown.writer_load:.1%} of the time). In force meanwhile; re-solved once alpha is measured, "
                f"with a probe ({self.probe_steps} steps with the writer mostly idle) if steps without a write are "
                f"missing")
        return self._put_in_force(d.replace(rationale=d.rationale + note))

    def decide(self, costs: Costs, *, reason: str, step: int) -> Decision:
        """Solve for ``costs`` now, record and log the decision (also usable with costs measured offline)."""
        return self._put_in_force(solve(costs, self.limits).with_context(reason=reason, step=step))

    def _put_in_force(self, d: Decision) -> Decision:
        self.decisions.append(d)
        self._last_decision_step = d.step
        old = self._current
        self._current = (d.every_steps, d.batch_steps)
        self._probing = d.is_probe
        level = logging.INFO if d.feasible or d.is_probe else logging.WARNING
        log.log(level, "lowdiff tuner: %s%s", d.summary(),
                "" if old == self._current else f" (was every_steps={old[0]} batch_steps={old[1]})")
        log.debug("lowdiff tuner rationale:\n%s", d.rationale)
        return d

    # -- measuring alpha (the writer's interference) --------------------------------------------------------

    def _pursue_alpha(self, step: int) -> Decision | None:
        """The decision in force was made without alpha, and alpha matters: re-solve once alpha is measured; if
        enough steps overlapped a write but too few did not, probe; after a full window without enough steps
        that overlapped a write, give up until the next re-tune."""
        since = self._alpha_pending
        assert since is not None
        _, high, how = self.profiler.write_interference()
        costs = self.profiler.costs(restart_s=self.restart_s)
        if high is not None and costs is not None:
            self._alpha_pending = None
            return self._put_in_force(solve(costs, self.limits).with_context(
                reason=f"alpha measured under the decision of step {since}: {how}", step=step))
        busy, idle = self.profiler.interference_steps()
        if busy >= MIN_INTERFERENCE_STEPS:
            self._alpha_pending = None
            return self._start_probe(step, busy, idle)
        if step - since >= self.profiler.window_steps:
            self._alpha_pending = None
            log.info("lowdiff tuner: alpha still not measured %d steps after the decision of step %d (%d steps "
                     "overlapped a write, %d none; %d of each needed): no probe, the bound stays checked with alpha "
                     "= 0 until the next re-tune", step - since, since, busy, idle, MIN_INTERFERENCE_STEPS)
        return None

    def _probe_settings(self) -> tuple[int, int]:
        """(every_steps, batch_steps) for a probe starting now: the batch ``probe_batch_steps`` (a fixed knob
        stays fixed) and an interval that puts no snapshot in the probe. The checkpointer snapshots at the first
        step with ``step - last snapshot >= every_steps`` and did so at this step if it was due, so fewer than
        the current interval have passed since the last snapshot: current + probe_steps is enough."""
        f, _ = self._current
        lim = self.limits
        if lim.batch_steps is not None:
            bp = lim.batch_steps
        elif lim.every_steps is not None:
            bp = _largest_divisor_at_most(lim.every_steps, self.probe_batch_steps)
        else:
            bp = self.probe_batch_steps
            cap = memory_batch_cap(self._last_decision().costs, lim)  # a probe follows a decision
            if cap is not None:
                bp = min(bp, cap)
        fp = lim.every_steps if lim.every_steps is not None else bp * math.ceil((f + self.probe_steps) / bp)
        return fp, bp

    def _start_probe(self, step: int, busy: int, idle: int) -> Decision:
        d = self._last_decision()
        fp, bp = self._probe_settings()
        lim = self.limits
        costs = self.profiler.costs(restart_s=self.restart_s) or d.costs
        at_full = evaluate(d.costs.replace(write_interference_high=1.0), lim, d.every_steps, d.batch_steps)
        bd = evaluate(costs, lim, fp, bp)
        end = step + self.probe_steps
        f_now, b_now = self._current
        lines = [
            f"probe: measuring the writer's interference alpha over steps {step + 1}-{end}, with the writer "
            f"mostly idle",
            f"  why: alpha not measured ({busy} steps in the window overlapped a write, "
            f"{idle} none; {MIN_INTERFERENCE_STEPS} of each needed) and it matters: the decision of step {d.step} "
            f"(every_steps={d.every_steps} batch_steps={d.batch_steps}, writer busy {d.breakdown.writer_load:.1%} of "
            f"the time) has an overhead of {d.breakdown.overhead_bound:.3%} with alpha = 0 and "
            f"{at_full.overhead_bound:.3%} with alpha = 1, against max_overhead {lim.max_overhead:.3g}",
            f"  during the probe: every_steps={fp} (no snapshot before step {end + 1}), batch_steps={bp} (one "
            f"segment write per {bp} steps), applied at once; then (F, B) is re-solved with the measured alpha",
            f"  nothing is skipped: every step is still logged. Durability lags more: a step is durable up to {bp} "
            f"steps after it (was {b_now}), {bd.lag_s:.3g} s of work behind on average in the model (was "
            f"{evaluate(costs, lim, f_now, b_now).lag_s:.3g} s), and the next snapshot (interval was {f_now}) waits "
            f"for the end of the probe",
            f"  inputs: {inputs_line(costs, lim)}",
        ]
        if lim.every_steps is not None and lim.every_steps <= self.probe_steps:
            lines.append(f"  every_steps is fixed at {lim.every_steps} by the config: snapshots continue during the "
                         "probe and may leave too few steps without a write")
        if bp == 1:
            lines.append("  batch_steps is fixed at 1 by the config: a segment is written every step, so the probe "
                         "may leave too few steps without a write")
        probe = Decision(fp, bp, bd.waste_s_per_hour, bd.overhead, bd.feasible, bd, costs, lim,
                         young_daly_interval(costs, lim, bp), min_batch_steps(costs, lim), "\n".join(lines),
                         reason=f"probe: alpha not measured under the decision of step {d.step} ({busy} steps "
                                f"overlapped a write, {idle} none)",
                         step=step, probe_steps=self.probe_steps)
        self._probe = _Probe(start=step, end=end)
        return self._put_in_force(probe)

    def _end_probe(self, step: int) -> Decision:
        probe = self._probe
        assert probe is not None
        self._probe = None
        costs = self.profiler.costs(restart_s=self.restart_s)
        if costs is None:  # cannot happen once decided (the measurements only accumulate); keep the last one
            costs = self._last_decision().costs
        how = costs.sources.get("write_interference", "")
        result = "alpha measured" if costs.write_interference_high is not None else "alpha STILL NOT MEASURED"
        return self._put_in_force(solve(costs, self.limits).with_context(
            reason=f"after the probe of steps {probe.start + 1}-{probe.end}: {result} ({how})", step=step))

    def _last_decision(self) -> Decision:
        return next(d for d in reversed(self.decisions) if not d.is_probe)

    def _why_solve(self) -> str | None:
        if not self.decisions:
            return "initial"
        ref = self._last_decision().costs
        t = self.profiler.iteration_s()
        fit = self.profiler.write_fit()
        changes = []
        if t is not None and _drift(ref.iteration_s, t) > self.retune_drift:
            changes.append(f"iteration time {ref.iteration_s * 1e3:.3g} -> {t * 1e3:.3g} ms")
        if fit is not None:
            # The disk is judged by what it costs at the sizes in use (a segment of B steps, a snapshot), not
            # by the fit's slope and intercept alone: with small writes the bandwidth is poorly determined and
            # may swing widely while the write times it predicts stay put.
            b = self._current[1]
            for what, nbytes in (("segment", b * ref.diff_bytes), ("snapshot", ref.snapshot_bytes)):
                old = ref.write_latency_s + nbytes / ref.write_bytes_per_s
                new = fit.latency_s + nbytes / fit.bytes_per_s
                if _drift(old, new) > self.retune_drift:
                    changes.append(f"{what} write time {old * 1e3:.3g} -> {new * 1e3:.3g} ms (bandwidth "
                                   f"{ref.write_bytes_per_s / 1e6:.3g} -> {fit.bytes_per_s / 1e6:.3g} MB/s, latency "
                                   f"{ref.write_latency_s * 1e3:.3g} -> {fit.latency_s * 1e3:.3g} ms)")
        return "drift: " + ", ".join(changes) if changes else None

    def decisions_as_dicts(self) -> list[dict[str, Any]]:
        return [d.to_dict() for d in self.decisions]


def _at_full_interference(d: Decision) -> Breakdown | None:
    """When ``d`` was made without a measured alpha (``write_interference_high`` None, the profiler's mark) and
    its overhead, checked with alpha = 1, would break ``max_overhead``: the model at that point with alpha = 1
    (alpha then matters and should be measured). Otherwise None: measured, or no alpha could break the bound."""
    c = d.costs
    if c.write_interference_high is not None:
        return None
    full = evaluate(c.replace(write_interference_high=1.0), d.limits, d.every_steps, d.batch_steps)
    return full if full.overhead_bound > d.limits.max_overhead else None


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)

