"""Online measurement of the tuner's inputs, and the controller that re-solves when conditions drift.

The checkpointer feeds a :class:`Profiler` from two threads:

* training thread: :meth:`Profiler.on_step` once per optimizer step, :meth:`Profiler.on_snapshot` after
  capturing a snapshot (its blocking time), :meth:`Profiler.on_blocked` when ``step()`` waited for the queue;
* writer thread: :meth:`Profiler.on_segment_written` / :meth:`Profiler.on_snapshot_written` after each commit.

:class:`AutoTuner` turns the measurements into :class:`lowdiff.tuner.Costs`, asks :func:`lowdiff.tuner.solve`
and re-solves when the iteration time, the write bandwidth or the per-write latency drift by more than
``tuner.retune_drift``; the interval goes down as well as up. When a decision was made without the writer's
interference and it matters, it measures it (under the decision, or by a short probe with the writer mostly
idle) and re-solves. Every decision and probe is logged with its inputs and kept in :attr:`AutoTuner.decisions`.

>>> p = Profiler(clock=iter(range(1000)).__next__)
>>> for s in range(30):
...     p.on_step(s)
>>> p.iteration_s()
1.0
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lowdiff.tuner import (
    Breakdown,
    Costs,
    Decision,
    Limits,
    evaluate,
    inputs_line,
    memory_batch_cap,
    min_batch_steps,
    solve,
    young_daly_interval,
)

log = logging.getLogger(__name__)

# Until measured: a bandwidth prior used only when every observed write has about the same size (then the
# intercept and the slope of time = l_w + bytes/BW cannot be told apart), and the replay cost as a fraction of
# the iteration time (replay skips forward and backward; a quarter of a step errs towards snapshotting more).
PRIOR_WRITE_BYTES_PER_S = 200e6
ASSUMED_REPLAY_FRACTION = 0.25

# The writer's interference alpha needs this many steps both with and without a concurrent write in the window.
MIN_INTERFERENCE_STEPS = 8
# A probe (alpha not measured, and it matters; see AutoTuner): this many steps with no snapshot and this many
# steps per segment. 8 steps per segment leave most steps without a write (a segment write overlaps one or two
# steps), so 24 steps give well over MIN_INTERFERENCE_STEPS idle ones while the 64-step window still holds 40
# steps of the regime before the probe (the busy ones); 24 and 8 are multiples of the 8-step check interval at
# which DDP ranks take rank 0's settings, so the probe starts and ends on segment boundaries.
PROBE_STEPS = 24
PROBE_BATCH_STEPS = 8


@dataclass(frozen=True)
class WriteFit:
    """time = latency_s + bytes / bytes_per_s, fitted on committed writes."""

    latency_s: float
    bytes_per_s: float
    samples: int
    method: str
    """"fit" (two or more sizes), "prior bandwidth" (one size only) or "slope only" (negative intercept)."""


def fit_write_cost(samples: Sequence[tuple[float, float]], prior_bytes_per_s: float = PRIOR_WRITE_BYTES_PER_S
                   ) -> WriteFit | None:
    """Fit the per-write fixed cost and the bandwidth from (bytes, seconds) of committed writes.

    Writes are grouped by size (factor-of-2 buckets) and each bucket contributes its median, so a few slow
    writes on a noisy machine do not tilt the line; buckets are weighted by their number of writes."""
    pts = [(float(b), float(s)) for b, s in samples if b >= 0 and s > 0]
    if not pts:
        return None
    buckets: dict[int, list[tuple[float, float]]] = {}
    for b, s in pts:
        buckets.setdefault(int(math.log2(b + 1)), []).append((b, s))
    xs, ys, ws = [], [], []
    for group in buckets.values():
        xs.append(statistics.median(b for b, _ in group))
        ys.append(statistics.median(s for _, s in group))
        ws.append(len(group))
    if max(xs) < 4 * max(min(xs), 1.0):
        bw = prior_bytes_per_s
        lat = max(0.0, statistics.median(s - b / bw for b, s in pts))
        return WriteFit(lat, bw, len(pts), "prior bandwidth")
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    slope = sxy / sxx if sxx > 0 else 0.0
    lat = my - slope * mx
    if slope <= 0:  # bigger writes were not slower: only the fixed cost is visible
        return WriteFit(max(0.0, statistics.median(ys)), prior_bytes_per_s, len(pts), "prior bandwidth")
    if lat < 0:  # through the origin instead
        slope = sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
        return WriteFit(0.0, 1.0 / slope, len(pts), "slope only")
    return WriteFit(lat, 1.0 / slope, len(pts), "fit")


class Profiler:
    """Sliding-window measurements of everything :class:`lowdiff.tuner.Costs` needs. Thread-safe."""

    def __init__(self, *, window_steps: int = 64, window_writes: int = 64, min_steps: int = 16,
                 clock: Callable[[], float] = time.perf_counter,
                 prior_write_bytes_per_s: float = PRIOR_WRITE_BYTES_PER_S) -> None:
        self.min_steps = min_steps
        self.window_steps = window_steps
        self.prior_write_bytes_per_s = prior_write_bytes_per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_mark: float | None = None
        self._pending_overhead_s = 0.0
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window_steps)
        """(start, end, duration without lowdiff's tunable overhead) per step."""
        self._apply_s: deque[float] = deque(maxlen=window_steps)
        self._record_bytes: deque[float] = deque(maxlen=window_steps)
        self._segments: deque[tuple[float, float, float]] = deque(maxlen=window_writes)
        """(bytes, seconds, steps) per committed segment."""
        self._snapshot_writes: deque[tuple[float, float]] = deque(maxlen=8)
        self._captures: deque[tuple[float, float]] = deque(maxlen=8)
        self._write_spans: deque[tuple[float, float]] = deque(maxlen=4 * window_writes)
        self._replay: tuple[int, float, float, float] | None = None

    # -- training thread ---------------------------------------------------------------------------------------

    def on_step(self, step: int, *, apply_s: float | None = None, record_bytes: float | None = None) -> None:
        """Mark the end of one optimizer step. ``apply_s``: time of the inner optimizer step plus decode (the
        replay-cost estimate when no replay was measured); ``record_bytes``: the step's raw payload."""
        now = self._clock()
        with self._lock:
            if self._last_mark is not None:
                net = now - self._last_mark - self._pending_overhead_s
                if net > 0:
                    self._steps.append((self._last_mark, now, net))
            self._last_mark = now
            self._pending_overhead_s = 0.0
            if apply_s is not None and apply_s >= 0:
                self._apply_s.append(float(apply_s))
            if record_bytes is not None and record_bytes >= 0:
                self._record_bytes.append(float(record_bytes))

    def on_snapshot(self, nbytes: float, block_s: float) -> None:
        """A snapshot was captured: ``block_s`` is the time the training thread spent copying state (0 when a
        shadow replica in the writer provides it; ``nbytes`` 0 when unknown: the written size is used)."""
        with self._lock:
            self._captures.append((float(nbytes), float(block_s)))
            self._pending_overhead_s += max(0.0, float(block_s))

    def on_blocked(self, seconds: float) -> None:
        """``step()`` waited ``seconds`` for room in the writer's queue (a stall, not iteration time)."""
        with self._lock:
            self._pending_overhead_s += max(0.0, float(seconds))

    def on_replay(self, steps: int, seconds: float, read_bytes: float = 0.0, read_s: float = 0.0) -> None:
        """A measured replay: ``seconds`` of decode + apply for ``steps`` steps, and its reading."""
        with self._lock:
            self._replay = (int(steps), float(seconds), float(read_bytes), float(read_s))

    # -- writer thread -------------------------------------------------------------------------------------------

    def on_segment_written(self, nbytes: float, seconds: float, steps: float | None = None) -> None:
        """A log segment of ``nbytes`` holding ``steps`` steps was committed in ``seconds`` (write + fsync +
        rename)."""
        end = self._clock()
        with self._lock:
            self._segments.append((float(nbytes), float(seconds), float(steps or 0)))
            self._write_spans.append((end - seconds, end))

    def on_snapshot_written(self, nbytes: float, seconds: float) -> None:
        """A full snapshot of ``nbytes`` was committed in ``seconds`` by the background writer."""
        end = self._clock()
        with self._lock:
            self._snapshot_writes.append((float(nbytes), float(seconds)))
            self._write_spans.append((end - seconds, end))

    def on_writes(self, *, segments: int, segment_bytes: float, snapshots: int, snapshot_bytes: float,
                  seconds: float, steps_per_segment: float, segment_steps: int | None = None) -> None:
        """Several commits seen at once (from the writer's counters, when it does not report each write):
        segments share time, bytes and steps evenly; a snapshot among them gets the time left after the
        segments' usual time (or its share of the bytes). More than one snapshot at once is skipped.
        ``segment_steps``: the steps those segments hold in all, when the writer counts them (a segment cut
        short, or written just after a change of the batch size, does not hold ``steps_per_segment``)."""
        if seconds <= 0 or segments < 0 or snapshots < 0:
            return
        if segment_steps is not None and segments > 0:
            steps_per_segment = segment_steps / segments
        if snapshots == 0 and segments > 0:
            for _ in range(segments):
                self.on_segment_written(segment_bytes / segments, seconds / segments, steps=steps_per_segment)
        elif snapshots == 1 and segments == 0:
            self.on_snapshot_written(snapshot_bytes, seconds)
        elif snapshots == 1:
            with self._lock:
                typical = statistics.median(s for _, s, _ in self._segments) if self._segments else None
            snap_s = seconds - segments * typical if typical is not None else 0.0
            if snap_s <= 0:  # no usable segment time yet, or a noisy one: split by bytes
                snap_s = seconds * snapshot_bytes / (snapshot_bytes + segment_bytes)
            self.on_snapshot_written(snapshot_bytes, snap_s)
            if seconds - snap_s > 0:
                for _ in range(segments):
                    self.on_segment_written(segment_bytes / segments, (seconds - snap_s) / segments,
                                            steps=steps_per_segment)

    # -- queries -------------------------------------------------------------------------------------------------

    def iteration_s(self) -> float | None:
        with self._lock:
            if len(self._steps) < self.min_steps:
                return None
            return statistics.median(d for _, _, d in self._steps)

    def write_fit(self) -> WriteFit | None:
        with self._lock:
            samples = [(b, s) for b, s, _ in self._segments] + list(self._snapshot_writes)
        return fit_write_cost(samples, self.prior_write_bytes_per_s)

    def diff_bytes(self) -> float | None:
        with self._lock:
            counted = [(b, n) for b, _, n in self._segments if n > 0]
            if counted:
                return sum(b for b, _ in counted) / sum(n for _, n in counted)
            if self._record_bytes:
                return statistics.median(self._record_bytes)
            return None

    def _overlaps(self) -> tuple[list[float], list[float]]:
        """Per step in the window: seconds of it during which a write ran, and its duration."""
        with self._lock:
            steps = list(self._steps)
            spans = list(self._write_spans)
        xs = [sum(max(0.0, min(s1, w1) - max(s0, w0)) for w0, w1 in spans) for s0, s1, _ in steps]
        return xs, [d for _, _, d in steps]

    @staticmethod
    def _classify(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[int], list[int]]:
        # A step counts as busy when a write covered a tenth of it (tiny overlaps only add noise), as idle when
        # no write touched it at all.
        busy = [i for i, x in enumerate(xs) if x >= 0.1 * ys[i]]
        idle = [i for i, x in enumerate(xs) if x == 0]
        return busy, idle

    def interference_steps(self) -> tuple[int, int]:
        """(busy, idle) steps in the window: steps a write covered by a tenth or more, steps no write touched.
        :meth:`write_interference` needs ``MIN_INTERFERENCE_STEPS`` of each."""
        xs, ys = self._overlaps()
        busy, idle = self._classify(xs, ys)
        return len(busy), len(idle)

    def write_interference(self) -> tuple[float, float | None, str]:
        """alpha from step durations: duration = T0 + alpha * (seconds of the step during which a write ran).

        Returns the estimate minus and plus two standard errors, clamped to [0, 1] (the low one is minimized
        with, the high one checked against ``max_overhead``), and how they were obtained. Without steps both with
        and without overlapping writes it is not measured: 0, None (:class:`AutoTuner` then probes, when it
        matters: see :data:`PROBE_STEPS`)."""
        with self._lock:
            have_writes = bool(self._write_spans)
        xs, ys = self._overlaps()
        if not have_writes or len(ys) < self.min_steps:
            return 0.0, None, "not measured (no writes in the window)"
        busy, idle = self._classify(xs, ys)
        if len(busy) < MIN_INTERFERENCE_STEPS or len(idle) < MIN_INTERFERENCE_STEPS:
            return 0.0, None, (f"not measured (too few steps with and without a concurrent write: {len(busy)} busy, "
                               f"{len(idle)} idle of {len(ys)}, {MIN_INTERFERENCE_STEPS} of each needed)")
        # Extra time of a busy step over the idle median, per second of overlap, over the middle half of the
        # busy steps (one preempted step must not decide). On a shared machine step times jitter far more than
        # a write costs, so what is used is the estimate minus two standard errors: noise reads as 0, not as 1.
        t0 = statistics.median(ys[i] for i in idle)
        ratios = sorted((ys[i] - t0) / xs[i] for i in busy)
        mid = ratios[len(ratios) // 4: len(ratios) - len(ratios) // 4]
        est = statistics.fmean(mid)
        mean_x = statistics.fmean(xs[i] for i in busy)
        se = math.hypot(statistics.stdev(ratios) / math.sqrt(len(ratios)),
                        statistics.stdev(ys[i] for i in idle) / math.sqrt(len(idle)) / mean_x)
        used = min(1.0, max(0.0, est - 2 * se))
        high = min(1.0, max(used, est + 2 * se))
        return used, high, (f"step time vs overlap with writes: {est:.2f} +- {se:.2f}, used {used:.2f}, "
                            f"bound checked with {high:.2f} ({len(busy)} busy, {len(idle)} idle steps)")

    def missing(self) -> list[str]:
        """What is not measured yet (empty: :meth:`costs` can answer)."""
        out = []
        if self.iteration_s() is None:
            out.append(f"iteration time (needs {self.min_steps} steps)")
        with self._lock:
            have_capture = bool(self._captures)
            # One segment and one snapshot: two sizes far apart separate the fixed cost from the bandwidth.
            have_writes = bool(self._segments) and bool(self._snapshot_writes)
        if not have_capture:
            out.append("snapshot capture (needs one snapshot)")
        if not have_writes:
            out.append("write cost (needs one committed segment and one committed snapshot)")
        if self.diff_bytes() is None:
            out.append("log bytes per step (needs one segment)")
        return out

    def costs(self, *, restart_s: float = 0.0) -> Costs | None:
        """Current estimates, or None while :meth:`missing` is not empty."""
        if self.missing():
            return None
        t = self.iteration_s()
        fit = self.write_fit()
        sd = self.diff_bytes()
        assert t is not None and fit is not None and sd is not None
        with self._lock:
            # On-disk size (after the codec) is what the writer moves; the captured size stands in until then.
            written = [b for b, _ in self._snapshot_writes]
            snap_bytes = statistics.median(written or [b for b, _ in self._captures])
            block_s = statistics.median(s for _, s in self._captures)
            apply = statistics.median(self._apply_s) if self._apply_s else None
            replay = self._replay
        sources = {"write cost": f"{fit.method} over {fit.samples} writes"}
        read_bw = 0.0
        if replay is not None and replay[0] > 0:
            rep = replay[1] / replay[0]
            sources["replay_step_s"] = f"measured replay of {replay[0]} steps"
            if replay[2] > 0 and replay[3] > 0:
                read_bw = replay[2] / replay[3]
        elif apply is not None:
            rep = apply
            sources["replay_step_s"] = "decode + optimizer step time during training"
        else:
            rep = ASSUMED_REPLAY_FRACTION * t
            sources["replay_step_s"] = f"assumed {ASSUMED_REPLAY_FRACTION:g} x T (not measured)"
        if not read_bw:
            sources["read_bytes_per_s"] = "assumed equal to the write bandwidth"
        with self._lock:
            record_bytes = statistics.median(self._record_bytes) if self._record_bytes else 0.0
        alpha, alpha_high, how = self.write_interference()
        sources["write_interference"] = how
        return Costs(iteration_s=t, diff_bytes=sd, snapshot_bytes=snap_bytes, snapshot_block_s=block_s,
                     write_bytes_per_s=fit.bytes_per_s, write_latency_s=fit.latency_s, replay_step_s=rep,
                     read_bytes_per_s=read_bw, restart_s=restart_s, write_interference=alpha,
                     write_interference_high=alpha_high, sources=sources, record_bytes=record_bytes)


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
                 max_buffer_bytes: int = 1 << 30, record_bytes_hint: float | None = None) -> None:
        """``record_bytes_hint``: an upper bound on one step's record (the dense gradient bytes), known before
        the first step: the bootstrap batch is capped so its waiting records fit ``max_buffer_bytes``."""
        self.limits = Limits(mtbf_s=mtbf_s, max_overhead=max_overhead, max_log_bytes=max_log_bytes,
                             queue_depth=queue_depth, keep_snapshots=keep_snapshots,
                             every_steps=every_steps, batch_steps=batch_steps, max_buffer_bytes=max_buffer_bytes)
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
                   max_buffer_bytes=t.max_buffer_bytes, record_bytes_hint=record_bytes_hint)

    def current(self) -> tuple[int, int]:
        """(every_steps, batch_steps) in force now (a probe's while :attr:`probing`)."""
        return self._current

    @property
    def probing(self) -> bool:
        """A probe is in force: its batch size applies at once (not at the next snapshot) and so does the
        decision's that ends it (:class:`lowdiff.checkpointer.Checkpointer` cuts the open segment)."""
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


__all__ = ["Profiler", "AutoTuner", "WriteFit", "fit_write_cost", "PRIOR_WRITE_BYTES_PER_S",
           "ASSUMED_REPLAY_FRACTION", "MIN_INTERFERENCE_STEPS", "PROBE_STEPS", "PROBE_BATCH_STEPS"]
