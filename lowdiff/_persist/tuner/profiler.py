"""Online measurement of the tuner's inputs, and the controller that re-solves when conditions drift.

The checkpointer feeds a :class:`Profiler` from two threads:

* training thread: :meth:`Profiler.on_step` once per optimizer step, :meth:`Profiler.on_snapshot` after
  capturing a snapshot (its blocking time), :meth:`Profiler.on_blocked` when ``step()`` waited for the queue;
* writer thread: :meth:`Profiler.on_segment_written` / :meth:`Profiler.on_snapshot_written` after each commit.

:class:`AutoTuner` turns the measurements into :class:`lowdiff._persist.tuner.Costs`, asks
:func:`lowdiff._persist.tuner.solve` and re-solves when the iteration time, the write bandwidth or the per-write latency
drift by more than ``tuner.retune_drift``; the interval goes down as well as up. When a decision was made without the
writer's interference and it matters, it measures it (under the decision, or by a short probe with the writer mostly
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lowdiff._persist.tuner.model import Costs

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
    """Sliding-window measurements of everything :class:`lowdiff._persist.tuner.Costs` needs. Thread-safe."""

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


