"""The tuner: its optimum is the model's true optimum, it moves the right way, it respects its limits; the
profiler measures what it should; the new config keys validate like the others."""

from __future__ import annotations

import json
import logging
import math

import pytest

from lowdiff import Config, ConfigError
from lowdiff._persist.tuner import (
    CLOSEST_MARGIN,
    PROBE_BATCH_STEPS,
    PROBE_STEPS,
    AutoTuner,
    Costs,
    Limits,
    Profiler,
    evaluate,
    fit_write_cost,
    format_decisions,
    min_batch_steps,
    solve,
    young_daly_interval,
)

# Three regimes: a GPU-ish job on a fast disk, a slow network disk with a large per-write cost (B_min > 1 and
# the snapshot burst stalls), and a CPU-bound writer that slows training (interference pushes B up).
COSTS = {
    "fast": Costs(iteration_s=0.3, diff_bytes=2e6, snapshot_bytes=2e9, snapshot_block_s=0.4,
                  write_bytes_per_s=2e9, write_latency_s=0.002, replay_step_s=0.02),
    "slow": Costs(iteration_s=0.05, diff_bytes=500e3, snapshot_bytes=300e6, snapshot_block_s=0.05,
                  write_bytes_per_s=100e6, write_latency_s=0.08, replay_step_s=0.01),
    "contended": Costs(iteration_s=0.1, diff_bytes=1e6, snapshot_bytes=100e6, snapshot_block_s=0.05,
                       write_bytes_per_s=300e6, write_latency_s=0.01, replay_step_s=0.02, write_interference=0.5,
                       read_latency_s=0.002, restart_s=30.0),
}


def _brute_force(costs: Costs, limits: Limits) -> tuple[float, int, int]:
    best = (math.inf, 0, 0)
    for b in range(1, limits.max_batch_steps + 1):
        for f in range(b, limits.max_every_steps + 1, b):
            r = evaluate(costs, limits, f, b)
            if r.feasible and r.waste_fraction < best[0]:
                best = (r.waste_fraction, f, b)
    return best


@pytest.mark.parametrize("name", sorted(COSTS))
@pytest.mark.parametrize("mtbf_h", [0.5, 24.0])
def test_optimum_matches_brute_force(name: str, mtbf_h: float) -> None:
    limits = Limits(mtbf_s=mtbf_h * 3600, max_every_steps=2500, max_batch_steps=40, max_overhead=0.5)
    d = solve(COSTS[name], limits)
    waste, f, b = _brute_force(COSTS[name], limits)
    assert d.feasible
    assert d.breakdown.waste_fraction <= waste * (1 + 1e-12), (d.every_steps, d.batch_steps, f, b)
    assert d.breakdown.waste_fraction == pytest.approx(waste, rel=1e-12)


@pytest.mark.parametrize("fixed", ["every", "batch"])
def test_one_knob_fixed_matches_brute_force(fixed: str) -> None:
    c = COSTS["contended"]
    if fixed == "every":
        limits = Limits(mtbf_s=3600, every_steps=360, max_overhead=0.5)
        cands = [(360, b) for b in range(1, 361) if 360 % b == 0]
    else:
        limits = Limits(mtbf_s=3600, batch_steps=8, max_every_steps=20_000, max_overhead=0.5)
        cands = [(f, 8) for f in range(8, 20_001, 8)]
    d = solve(c, limits)
    best = min((evaluate(c, limits, f, b) for f, b in cands), key=lambda r: (not r.feasible, r.waste_fraction))
    assert (d.every_steps, d.batch_steps) == (best.every_steps, best.batch_steps)
    assert d.every_steps % d.batch_steps == 0


def test_closed_form_young_daly_matches_numeric_optimum_without_stalls() -> None:
    # No writer effects: the model reduces to C_F/(F T) + lambda r F/2 + const, whose optimum is Young/Daly's.
    c = Costs(iteration_s=0.1, diff_bytes=1e3, snapshot_bytes=1e6, snapshot_block_s=0.5, write_bytes_per_s=1e12,
              write_latency_s=0.0, replay_step_s=0.01)
    limits = Limits(mtbf_s=3600, batch_steps=1)
    d = solve(c, limits)
    assert d.every_steps == pytest.approx(young_daly_interval(c, limits), rel=0.02)


def test_higher_failure_rate_gives_smaller_interval() -> None:
    for name, c in COSTS.items():
        fixed_b = [solve(c, Limits(mtbf_s=h * 3600, batch_steps=4, max_overhead=0.5)).every_steps
                   for h in (0.25, 1, 4, 24, 168)]
        assert fixed_b == sorted(fixed_b), (name, fixed_b)
        assert fixed_b[0] < fixed_b[-1], name
        tuned = [solve(c, Limits(mtbf_s=h * 3600, max_overhead=0.5)).every_steps for h in (0.25, 4, 168)]
        assert tuned == sorted(tuned) and tuned[0] < tuned[-1], (name, tuned)


def test_bigger_snapshot_cost_gives_larger_interval() -> None:
    for name, c in COSTS.items():
        fs = [solve(c.replace(snapshot_block_s=cf), Limits(mtbf_s=3600, batch_steps=4, max_overhead=0.5)).every_steps
              for cf in (0.01, 0.05, 0.2, 1.0, 5.0)]
        assert fs == sorted(fs) and fs[0] < fs[-1], (name, fs)


def test_bigger_replay_cost_gives_smaller_interval() -> None:
    c = COSTS["fast"]
    fs = [solve(c.replace(replay_step_s=r), Limits(mtbf_s=3600)).every_steps for r in (0.001, 0.01, 0.1)]
    assert fs == sorted(fs, reverse=True) and fs[0] > fs[-1]


def test_interval_is_a_multiple_of_the_batch() -> None:
    for c in COSTS.values():
        for h in (1, 24):
            d = solve(c, Limits(mtbf_s=h * 3600))
            assert d.every_steps % d.batch_steps == 0


def test_max_overhead_is_respected() -> None:
    c = COSTS["fast"]
    free = solve(c, Limits(mtbf_s=600, max_overhead=0.5))
    assert free.overhead > 0.002  # a high failure rate wants frequent snapshots...
    capped = solve(c, Limits(mtbf_s=600, max_overhead=0.002))
    assert capped.feasible and capped.overhead <= 0.002  # ...the bound wins
    assert capped.every_steps > free.every_steps
    assert capped.waste_s_per_hour >= free.waste_s_per_hour


def test_max_log_bytes_is_respected() -> None:
    c = COSTS["fast"]
    free = solve(c, Limits(mtbf_s=168 * 3600))
    cap = int(free.breakdown.log_bytes / 3)
    for keep in (0, 1, 3):
        d = solve(c, Limits(mtbf_s=168 * 3600, max_log_bytes=cap, keep_snapshots=keep))
        assert d.breakdown.log_bytes <= cap
        assert max(keep, 1) * d.every_steps * c.diff_bytes <= cap
        assert "max_log_bytes" in d.rationale


def test_writer_sustains_the_batch() -> None:
    c = COSTS["slow"]
    limits = Limits(mtbf_s=3600)
    bmin = min_batch_steps(c, limits)
    assert bmin is not None and bmin > 1
    room = limits.max_writer_load * c.iteration_s - c.diff_bytes / c.write_bytes_per_s
    assert bmin == math.ceil(c.write_latency_s / room)
    d = solve(c, limits)
    assert d.batch_steps >= bmin
    assert d.breakdown.writer_load <= limits.max_writer_load


def test_interference_raises_the_batch() -> None:
    c = COSTS["contended"]
    quiet = solve(c.replace(write_interference=0.0), Limits(mtbf_s=24 * 3600))
    loud = solve(c, Limits(mtbf_s=24 * 3600))
    assert loud.batch_steps > quiet.batch_steps
    assert "B raised from B_min" in loud.rationale


def test_infeasible_limits_are_reported() -> None:
    c = COSTS["slow"].replace(diff_bytes=20e6)  # the log alone outruns the disk: 20 MB per 50 ms step
    d = solve(c, Limits(mtbf_s=3600))
    assert not d.feasible and min_batch_steps(c, Limits(mtbf_s=3600)) is None
    assert "LIMITS NOT MET" in d.rationale and "max_writer_load" in d.breakdown.violations


def test_unreachable_bound_does_not_push_the_interval_to_the_maximum() -> None:
    """The log's own writes break max_overhead at every F (here the high estimate of alpha): the largest F comes
    closest by a sliver and would have a recovery replay the whole run. Costs measured with
    ``log.when_behind: replica`` and a slow disk, where the tuner chose every_steps=999984."""
    c = Costs(iteration_s=0.0285, diff_bytes=3.22e6, snapshot_bytes=9.78e6, snapshot_block_s=0.0,
              write_bytes_per_s=307e6, write_latency_s=0.263, replay_step_s=0.0105,
              write_interference=0.0, write_interference_high=0.66)
    lim = Limits(mtbf_s=24 * 3600)
    d = solve(c, lim)
    b = d.batch_steps
    farthest = evaluate(c, lim, lim.max_every_steps // b * b, b)
    assert not d.feasible and "max_overhead" in d.breakdown.violations
    assert d.every_steps < lim.max_every_steps // 100
    assert d.breakdown.overhead_bound <= farthest.overhead_bound + CLOSEST_MARGIN * lim.max_overhead
    assert d.waste_s_per_hour < farthest.waste_s_per_hour / 10
    assert "LIMITS NOT MET" in d.rationale and "the closest point" in d.rationale
    # The same for a log that outruns the disk (the writer load bound): the interval stays a recoverable one.
    slow = solve(COSTS["slow"].replace(diff_bytes=20e6), Limits(mtbf_s=3600))
    assert not slow.feasible and slow.every_steps < Limits(mtbf_s=3600).max_every_steps // 100


def test_replica_mode_never_stalls_and_snapshots_as_often_as_the_disk_takes() -> None:
    """``log.when_behind: replica``: training never waits (what the writer has no room for is left to the replica's
    snapshots) and a snapshot costs the training thread nothing, so the interval is set by the disk's bandwidth:
    the shortest with the writer busy at most 80 % (alpha 0 here), where the model with stalls needs one that
    spreads the snapshot burst's stall under max_overhead."""
    # A 16.7 s snapshot write; 1 GiB of host memory holds 83 records of 3.2 MB per segment (4 segments), so no
    # queue absorbs the burst: waiting for the writer would stall training 6.7 s per snapshot.
    c = Costs(iteration_s=0.03, diff_bytes=3.2e6, snapshot_bytes=5e9, snapshot_block_s=0.0,
              write_bytes_per_s=300e6, write_latency_s=0.01, replay_step_s=0.01)
    lim = Limits(mtbf_s=24 * 3600)
    paced = lim.replace(paced=True)
    waiting, replica = evaluate(c, lim, 1600, 80), evaluate(c, paced, 1600, 80)
    assert waiting.stall_s > 5.0 and replica.stall_s == 0.0
    d, w = solve(c, paced), solve(c, lim)
    assert d.feasible and w.feasible
    assert d.every_steps < w.every_steps / 2
    b = d.batch_steps  # the shortest interval the writer sustains at this batch size
    assert d.breakdown.writer_load <= 0.8
    assert d.every_steps == b or "max_writer_load" in evaluate(c, paced, d.every_steps - b, b).violations
    assert "when_behind: replica" in d.rationale and "when_behind=replica" in d.summary()
    # A log faster than the disk: not met, and the rationale says what happens to the steps left out.
    slow = solve(c.replace(diff_bytes=20e6), paced)
    assert not slow.feasible and "left out of the log" in slow.rationale
    cfg = Config.from_dict({"run_dir": "r", "snapshot": {"every_steps": "auto", "shadow": True},
                            "log": {"persistence": "process", "when_behind": "replica"},
                            "compressor": {"name": "none"}})
    tuner = AutoTuner.from_config(cfg)
    assert tuner is not None and tuner.limits.paced


def test_rationale_lists_every_input() -> None:
    c = COSTS["contended"]
    d = solve(c, Limits(mtbf_s=7200, max_log_bytes=10**10, keep_snapshots=2))
    for token in ("T=100 ms", "S_d=1 MB", "S_F=100 MB", "C_F=50 ms", "BW_w=300 MB/s", "l_w=10 ms", "t_rep=20 ms",
                  "l_r=2 ms", "R=30 s", "alpha=0.5", "MTBF=2 h", "max_overhead=0.02", "max_log_bytes=10 GB",
                  "queue_depth=4", "keep=2", "F* = sqrt", "B_min"):
        assert token in d.rationale, token
    doc = json.loads(json.dumps(d.to_dict()))
    assert doc["every_steps"] == d.every_steps and doc["costs"]["iteration_s"] == 0.1
    assert f"every_steps={d.every_steps}" in format_decisions([doc])


def test_costs_and_limits_validate() -> None:
    with pytest.raises(ValueError, match="iteration_s"):
        COSTS["fast"].replace(iteration_s=0)
    with pytest.raises(ValueError, match="write_interference"):
        COSTS["fast"].replace(write_interference=2.0)
    with pytest.raises(ValueError, match="max_overhead"):
        Limits(mtbf_s=1, max_overhead=1.0)


# -- profiler -----------------------------------------------------------------------------------------------


def test_write_fit_recovers_latency_and_bandwidth() -> None:
    samples = [(n, 0.004 + n / 250e6 * (1 + 0.01 * (i % 3 - 1))) for i, n in
               enumerate([20e3, 80e3, 320e3] * 5 + [50e6] * 2)]
    fit = fit_write_cost(samples)
    assert fit is not None and fit.method == "fit"
    assert fit.latency_s == pytest.approx(0.004, rel=0.1)
    assert fit.bytes_per_s == pytest.approx(250e6, rel=0.05)
    one_size = fit_write_cost([(1e5, 0.01)] * 4, prior_bytes_per_s=1e8)
    assert one_size is not None and one_size.method == "prior bandwidth"
    assert one_size.latency_s == pytest.approx(0.01 - 1e5 / 1e8)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _feed(p: Profiler, clock: FakeClock, steps: int, step_s: float, *, first: int = 0,
          seg_every: int = 8, seg_s: float = 0.01, seg_bytes: float = 8e5) -> None:
    for i in range(first, first + steps):
        clock.now += step_s
        p.on_step(i, apply_s=0.004)
        if i % seg_every == seg_every - 1:
            p.on_segment_written(seg_bytes, seg_s, steps=seg_every)


def test_profiler_measures_and_subtracts_snapshot_blocking() -> None:
    clock = FakeClock()
    p = Profiler(clock=clock)
    assert p.costs() is None and len(p.missing()) == 4
    _feed(p, clock, 40, 0.1)
    clock.now += 0.1
    p.on_snapshot(5e8, block_s=0.5)  # capture inside a step: not iteration time
    clock.now += 0.5
    p.on_step(40)
    p.on_snapshot_written(5e8, 0.01 + 5e8 / 500e6)
    c = p.costs()
    assert c is not None
    assert c.iteration_s == pytest.approx(0.1)
    assert c.snapshot_block_s == 0.5 and c.snapshot_bytes == 5e8
    assert c.diff_bytes == pytest.approx(1e5)
    assert c.write_bytes_per_s == pytest.approx(500e6, rel=0.01)  # the line through both sizes
    assert c.write_latency_s == pytest.approx(0.01 - 8e5 / 500e6, rel=0.01)
    assert c.replay_step_s == pytest.approx(0.004)
    assert "decode + optimizer step" in c.sources["replay_step_s"]
    p.on_replay(steps=100, seconds=1.5, read_bytes=1e8, read_s=0.1)
    c2 = p.costs()
    assert c2 is not None and c2.replay_step_s == pytest.approx(0.015) and c2.read_bytes_per_s == pytest.approx(1e9)


def test_profiler_estimates_write_interference() -> None:
    clock = FakeClock()
    p = Profiler(clock=clock, window_steps=64)
    for i in range(64):
        busy = i % 2 == 1
        clock.now += 0.15 if busy else 0.1  # a write covering the whole step costs alpha = 0.5 of it
        p.on_step(i)
        if busy:
            p.on_segment_written(1e5, 0.1)
    alpha, high, how = p.write_interference()
    assert alpha == pytest.approx(0.5, rel=0.05), how
    assert high is not None and alpha <= high <= 1.0


def test_max_overhead_is_checked_with_the_high_alpha() -> None:
    # The same costs with an uncertain alpha: the point that meets the bound at the low estimate does not at the
    # high one, so the bound is not met (the optimum is still sought with the low estimate).
    base = Costs(iteration_s=0.1, diff_bytes=1e6, snapshot_bytes=1e8, snapshot_block_s=0.01,
                 write_bytes_per_s=2e8, write_latency_s=0.02, replay_step_s=0.05, write_interference=0.0)
    lim = Limits(mtbf_s=3600.0, max_overhead=0.02)
    low = evaluate(base, lim, 100, 10)
    high = evaluate(base.replace(write_interference_high=1.0), lim, 100, 10)
    assert low.overhead == high.overhead and low.overhead <= 0.02 and "max_overhead" not in low.violations
    assert high.overhead_bound > 0.02 and "max_overhead" in high.violations


def _tuner_with_data(clock: FakeClock, step_s: float) -> AutoTuner:
    p = Profiler(clock=clock, window_steps=32)
    t = AutoTuner(mtbf_s=3600, profiler=p, retune_drift=0.2)
    _feed(p, clock, 32, step_s)
    p.on_snapshot(2e8, block_s=0.2)
    p.on_snapshot_written(2e8, 0.01 + 2e8 / 400e6)
    return t


def test_autotuner_decides_then_retunes_on_drift_both_ways(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    t = _tuner_with_data(clock, 0.1)
    assert t.current() == (128, 16)  # bootstrap until measured
    with caplog.at_level(logging.INFO, logger="lowdiff._persist.tuner.auto"):
        d0 = t.update(32)
    assert d0 is not None and d0.reason == "initial" and t.current() == (d0.every_steps, d0.batch_steps)
    assert "T=100 ms" in caplog.text and f"every_steps={d0.every_steps}" in caplog.text
    # 10 % slower: within the drift bound, no new decision.
    _feed(t.profiler, clock, 200, 0.11, first=33)
    assert t.update(233) is None and len(t.decisions) == 1
    # 4x slower steps: F* ~ 1/sqrt(T) (the same snapshot cost is amortized over fewer, longer steps): F goes down.
    _feed(t.profiler, clock, 200, 0.4, first=234)
    d1 = t.update(434)
    assert d1 is not None and d1.reason.startswith("drift: iteration time")
    assert d1.every_steps < d0.every_steps
    # Back to fast: F goes up again.
    _feed(t.profiler, clock, 200, 0.1, first=435)
    d2 = t.update(635)
    assert d2 is not None and d2.every_steps > d1.every_steps
    assert [d.step for d in t.decisions] == [32, 434, 635]
    assert json.loads(json.dumps(t.decisions_as_dicts()))[-1]["reason"].startswith("drift")


def test_autotuner_from_config_and_seed() -> None:
    assert AutoTuner.from_config(Config.from_dict({"run_dir": "r"})) is None
    cfg = Config.from_dict({"run_dir": "r", "snapshot": {"every_steps": "auto", "keep": 2},
                            "log": {"batch_steps": 8, "queue_depth": 3},
                            "tuner": {"mtbf_hours": 2, "max_overhead": 0.05, "max_log_bytes": 10**9}})
    t = AutoTuner.from_config(cfg)
    assert t is not None
    assert t.limits.mtbf_s == 7200 and t.limits.batch_steps == 8 and t.limits.every_steps is None
    assert t.limits.queue_depth == 3 and t.limits.keep_snapshots == 2 and t.limits.max_log_bytes == 10**9
    assert not t.limits.paced
    assert t.current()[1] == 8 and t.current()[0] % 8 == 0
    before = t.current()
    t.seed([{"every_steps": 100, "batch_steps": 4}])  # the config's batch (8) wins; 100 is no multiple of it
    assert t.current() == before
    t.seed([{"every_steps": 400, "batch_steps": 16}])
    assert t.current() == (400, 8)


# -- measuring alpha when a decision needs it (probe) ------------------------------------------------------------


def _feed_regime(p: Profiler, clock: FakeClock, first: int, n: int, *, write_every: int, snapshot_every: int = 0,
                 t0: float = 0.1, alpha: float = 0.5, write_s: float = 0.04, snap_s: float = 0.08,
                 block_s: float = 0.02) -> None:
    """Steps of ``t0`` plus ``alpha`` x (seconds of the step a write overlapped): a segment write of ``write_s``
    inside every ``write_every``-th step (0: none), a snapshot (capture ``block_s``, write ``snap_s``) inside every
    ``snapshot_every``-th."""
    for i in range(first, first + n):
        seg = bool(write_every) and i % write_every == 0
        snap = bool(snapshot_every) and i % snapshot_every == 0
        x = write_s * seg + snap_s * snap
        clock.now += t0 + alpha * x + block_s * snap
        if snap:
            p.on_snapshot(2e7, block_s=block_s)
        p.on_step(i, apply_s=0.004)
        if seg:
            p.on_segment_written(1e5 * write_every, write_s, steps=write_every)
        if snap:
            p.on_snapshot_written(2e7, snap_s)


def _busy_tuner(clock: FakeClock, **kw: float) -> AutoTuner:
    """A tuner whose window has a write in every step (as under B = 1 with frequent snapshots): alpha cannot be
    measured from it (no step without a write)."""
    t = AutoTuner(mtbf_s=kw.pop("mtbf_s", 3600.0), max_overhead=kw.pop("max_overhead", 0.02),
                  profiler=Profiler(clock=clock), **kw)
    _feed_regime(t.profiler, clock, 1, 40, write_every=1, snapshot_every=5)
    return t


def test_probe_when_alpha_unmeasured_and_the_writer_busy() -> None:
    clock = FakeClock()
    t = _busy_tuner(clock)
    assert t.profiler.write_interference()[1] is None and t.profiler.interference_steps()[1] == 0
    d0 = t.update(40)
    # Decided with alpha = 0; with alpha = 1 this choice breaks max_overhead: in force, alpha still to measure.
    assert d0 is not None and d0.reason == "initial" and not d0.is_probe and d0.feasible
    assert evaluate(d0.costs.replace(write_interference_high=1.0), t.limits, d0.every_steps,
                    d0.batch_steps).overhead_bound > 0.02
    assert "alpha not measured" in d0.rationale and not t.settled and not t.probing
    assert t.current() == (d0.every_steps, d0.batch_steps)
    # Eight more steps under it, still no step without a write: the next check starts the probe.
    _feed_regime(t.profiler, clock, 41, 8, write_every=1, snapshot_every=5)
    probe = t.update(48)
    assert probe is not None and probe.is_probe and probe.probe_steps == PROBE_STEPS == 24
    assert probe.reason.startswith("probe: alpha not measured under the decision of step 40")
    fp, bp = t.current()
    assert t.probing and (fp, bp) == (probe.every_steps, probe.batch_steps)
    assert bp == PROBE_BATCH_STEPS == 8 and fp % bp == 0 and fp >= d0.every_steps + 24  # no snapshot in it
    assert "nothing is skipped" in probe.rationale and "durable up to 8 steps" in probe.rationale
    # The probe's steps: a segment write every 8 steps, no snapshot; no decision before its end.
    _feed_regime(t.profiler, clock, 49, 16, write_every=8)
    assert t.update(56) is None and t.update(64) is None and t.probing
    _feed_regime(t.profiler, clock, 65, 8, write_every=8)
    d1 = t.update(72)
    assert d1 is not None and not d1.is_probe and not t.probing and t.settled
    assert d1.reason.startswith("after the probe of steps 49-72: alpha measured")
    # Re-solved with the measured alpha (the steps cost 0.5 s per second of overlap, noise-free here).
    assert d1.costs.write_interference == pytest.approx(0.5) and d1.costs.write_interference_high == pytest.approx(0.5)
    assert (d1.every_steps, d1.batch_steps) == (solve(d1.costs, t.limits).every_steps,
                                                solve(d1.costs, t.limits).batch_steps)
    # ...which the first choice, made with alpha = 0, breaks; the new one keeps the bound.
    assert evaluate(d1.costs, t.limits, d0.every_steps, d0.batch_steps).overhead_bound > 0.02
    assert d1.feasible and d1.breakdown.overhead_bound <= 0.02
    assert t.current() == (d1.every_steps, d1.batch_steps)
    # Busy again at every step (alpha no longer measurable from the window): no second probe without a re-tune.
    _feed_regime(t.profiler, clock, 73, 120, write_every=1, snapshot_every=5)
    assert all(t.update(s) is None for s in range(80, 193, 8))
    assert [d.is_probe for d in t.decisions] == [False, True, False]


def test_no_probe_when_alpha_is_measured() -> None:
    clock = FakeClock()
    t = AutoTuner(mtbf_s=3600.0, profiler=Profiler(clock=clock))
    _feed_regime(t.profiler, clock, 1, 40, write_every=2, snapshot_every=10)  # half the steps without a write
    d = t.update(40)
    assert d is not None and d.costs.write_interference_high == pytest.approx(0.5) and t.settled
    _feed_regime(t.profiler, clock, 41, 80, write_every=2, snapshot_every=10)
    assert all(t.update(s) is None for s in range(48, 121, 8))
    assert not t.probing and len(t.decisions) == 1


def test_no_probe_when_alpha_cannot_break_the_bound() -> None:
    clock = FakeClock()
    t = _busy_tuner(clock, max_overhead=0.9)  # no alpha in [0, 1] breaks this bound
    d = t.update(40)
    assert d is not None and d.costs.write_interference_high is None and t.settled
    _feed_regime(t.profiler, clock, 41, 40, write_every=1, snapshot_every=5)
    assert all(t.update(s) is None for s in range(48, 81, 8)) and not t.probing


def test_alpha_measured_under_the_decision_without_a_probe() -> None:
    """The window lacks steps WITH a write (a quiet writer, as under the bootstrap settings): the decision's own
    settings supply them, and the tuner re-solves as soon as alpha is measured; no probe is needed."""
    clock = FakeClock()
    t = AutoTuner(mtbf_s=3600.0, profiler=Profiler(clock=clock))
    _feed_regime(t.profiler, clock, 1, 40, write_every=16, snapshot_every=32)
    busy, idle = t.profiler.interference_steps()
    assert busy < 8 <= idle
    d0 = t.update(40)
    assert d0 is not None and d0.costs.write_interference_high is None and not t.settled
    _feed_regime(t.profiler, clock, 41, 8, write_every=1, snapshot_every=5)
    d1 = t.update(48)
    assert d1 is not None and not d1.is_probe and not t.probing and t.settled
    assert d1.reason.startswith("alpha measured under the decision of step 40")
    assert d1.costs.write_interference == pytest.approx(0.5)


def test_inconclusive_probe_is_not_repeated_until_the_next_retune() -> None:
    clock = FakeClock()
    t = _busy_tuner(clock)
    t.update(40)
    _feed_regime(t.profiler, clock, 41, 8, write_every=1, snapshot_every=5)
    assert t.update(48).is_probe
    _feed_regime(t.profiler, clock, 49, 24, write_every=1)  # something writes at every step all the same
    d1 = t.update(72)
    assert d1 is not None and "alpha STILL NOT MEASURED" in d1.reason and t.settled
    _feed_regime(t.profiler, clock, 73, 64, write_every=1, snapshot_every=5)
    assert all(t.update(s) is None for s in range(80, 137, 8))
    # A re-tune (iteration time x3): alpha is still unmeasured and matters, so it may be probed once again.
    _feed_regime(t.profiler, clock, 137, 64, write_every=1, snapshot_every=5, t0=0.3)
    d2 = t.update(200)
    assert d2 is not None and d2.reason.startswith("drift") and not t.settled
    _feed_regime(t.profiler, clock, 201, 8, write_every=1, snapshot_every=5, t0=0.3)
    assert t.update(208).is_probe
    assert sum(d.is_probe for d in t.decisions) == 2


def test_probe_is_followed_seeded_past_and_shown() -> None:
    clock = FakeClock()
    t = _busy_tuner(clock)
    t.update(40)
    _feed_regime(t.profiler, clock, 41, 8, write_every=1, snapshot_every=5)
    probe = t.update(48)
    docs = json.loads(json.dumps(t.decisions_as_dicts()))
    assert [d["probe_steps"] for d in docs] == [0, PROBE_STEPS]
    shown = format_decisions(docs)
    assert f"PROBE for {PROBE_STEPS} steps, every_steps={probe.every_steps} batch_steps=8" in shown
    assert "durability lag up to 8 steps" in shown
    # Another rank takes the probe as broadcast; a resumed process starts from the decision before the probe.
    other = AutoTuner(mtbf_s=3600.0)
    other.follow(probe.every_steps, probe.batch_steps, probing=True)
    assert other.probing and other.current() == t.current()
    other.follow(docs[0]["every_steps"], docs[0]["batch_steps"])
    assert not other.probing
    resumed = AutoTuner(mtbf_s=3600.0)
    resumed.seed(docs)
    assert resumed.current() == (docs[0]["every_steps"], docs[0]["batch_steps"]) and not resumed.probing


def test_probe_keeps_a_fixed_knob() -> None:
    clock = FakeClock()
    t = _busy_tuner(clock, batch_steps=2)
    t.update(40)
    _feed_regime(t.profiler, clock, 41, 8, write_every=1, snapshot_every=5)
    probe = t.update(48)
    assert probe is not None and probe.is_probe and probe.batch_steps == 2 and probe.every_steps % 2 == 0
    clock2 = FakeClock()
    t2 = _busy_tuner(clock2, every_steps=60)
    t2.update(40)
    _feed_regime(t2.profiler, clock2, 41, 8, write_every=1, snapshot_every=5)
    probe2 = t2.update(48)
    assert probe2 is not None and probe2.is_probe and probe2.every_steps == 60 and probe2.batch_steps == 6


# -- config ---------------------------------------------------------------------------------------------------


def test_config_accepts_auto_and_tuner_section(tmp_path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("run_dir: r\nsnapshot: {every_steps: auto}\nlog: {batch_steps: auto}\n"
                 "tuner: {mtbf_hours: 0.5, max_overhead: 0.01, max_log_bytes: 1000000, retune_drift: 0.3}\n")
    c = Config.from_yaml(y)
    assert c.snapshot.every_steps == "auto" and c.log.batch_steps == "auto"
    assert (c.tuner.mtbf_hours, c.tuner.max_overhead, c.tuner.max_log_bytes, c.tuner.retune_drift) == \
        (0.5, 0.01, 1000000, 0.3)
    d = Config.from_dict({"run_dir": "r"})
    assert (d.tuner.mtbf_hours, d.tuner.max_overhead, d.tuner.max_log_bytes, d.tuner.retune_drift) == \
        (24.0, 0.02, 0, 0.2)
    assert Config.from_dict(c.to_dict()) == c
    assert Config.from_dict({"run_dir": "r", "tuner": {"max_log_bytes": None}}).tuner.max_log_bytes is None


@pytest.mark.parametrize("data, message", [
    ({"snapshot": {"every_steps": "Auto"}}, "'snapshot.every_steps' must be an integer >= 1 or 'auto'"),
    ({"snapshot": {"every_steps": 0}}, "'snapshot.every_steps' must be an integer >= 1 or 'auto'"),
    ({"log": {"batch_steps": True}}, "'log.batch_steps' must be an integer >= 1 or 'auto'"),
    ({"log": {"batch_steps": 2.5}}, "'log.batch_steps' must be an integer >= 1 or 'auto'"),
    ({"tuner": {"mtbf_hours": 0}}, "'tuner.mtbf_hours' must be a finite number of hours > 0"),
    ({"tuner": {"mtbf_hours": "1h"}}, "'tuner.mtbf_hours' must be a finite number of hours > 0"),
    ({"tuner": {"mtbf_hours": float("inf")}}, "'tuner.mtbf_hours' must be a finite number of hours > 0"),
    ({"tuner": {"max_overhead": 0}}, "'tuner.max_overhead' must be a fraction in (0, 1)"),
    ({"tuner": {"max_overhead": 1.5}}, "'tuner.max_overhead' must be a fraction in (0, 1)"),
    ({"tuner": {"max_log_bytes": -1}}, "'tuner.max_log_bytes' must be an integer >= 0"),
    ({"tuner": {"max_log_bytes": 1.5}}, "'tuner.max_log_bytes' must be an integer >= 0"),
    ({"tuner": {"retune_drift": 0}}, "'tuner.retune_drift' must be a fraction in (0, 1]"),
    ({"tuner": {"retune_drift": False}}, "'tuner.retune_drift' must be a fraction in (0, 1]"),
    ({"tuner": {"mtbf": 3}}, "unknown config key 'tuner.mtbf'; allowed keys here: max_buffer_bytes, "
                             "max_log_bytes, max_overhead, mtbf_hours, retune_drift"),
    ({"tuner": 3}, "'tuner' must be a mapping"),
])
def test_config_rejects_bad_tuner_values(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"run_dir": "r", **data})
    assert message in str(e.value)


# -- wired into training --------------------------------------------------------------------------------------


def test_auto_end_to_end(tmp_path) -> None:
    """every_steps/batch_steps auto on a real run: the tuner decides after the bootstrap snapshot, the schedule
    follows its decisions, tuner.json records them, and recovery stays exact."""
    import torch

    import lowdiff
    from lowdiff._persist.tuner import DECISIONS_FILE
    from lowdiff._storage.format import list_snapshots

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    run = tmp_path / "run"
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, {
        "run_dir": str(run), "compressor": {"name": "topk", "ratio": 0.1},
        "snapshot": {"every_steps": "auto"}, "log": {"batch_steps": "auto"},
        "tuner": {"mtbf_hours": 0.01, "max_overhead": 0.5}})
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    # The chosen interval depends on the measured iteration time (it differs between an idle and a loaded
    # machine): train until a snapshot has followed the first decision, within a bound.
    for step in range(1, 6001):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        st = opt.stats
        decided = st.tuner_decisions
        if step >= 400 and decided and st.last_snapshot_step > decided[0].step:
            break
    opt.close()
    decisions = json.loads((run / DECISIONS_FILE).read_text())["decisions"]
    assert decisions and decisions[0]["reason"] == "initial" and decisions[0]["step"] > 128
    for d in decisions:
        assert d["every_steps"] % d["batch_steps"] == 0 and "rationale" in d
    snaps = sorted(list_snapshots(run))
    assert snaps[:2] == [0, 128]  # bootstrap interval until the first decision
    assert snaps[-1] > decisions[0]["step"]

    def in_force(step: int) -> int:  # decisions apply from the step after they are made
        return [d["every_steps"] for d in decisions if d["step"] < step][-1]

    for a, b in zip(snaps[1:], snaps[2:]):
        changed = any(a < d["step"] < b for d in decisions)
        # A snapshot comes once the interval in force has passed since the previous one; exactly then, unless
        # a decision in between shortened the interval below what had already passed.
        assert b - a >= in_force(b) and (changed or b - a == in_force(b)), (a, b, decisions)
    rec = lowdiff.recover(run)
    assert rec.step == step
    assert all(torch.equal(rec.model[k], v) for k, v in model.state_dict().items())


def test_auto_refused_for_sharded_writes_without_a_process_group() -> None:
    """Several writing ranks need rank 0's decisions broadcast (tests/distributed checks that path)."""
    from lowdiff._persist.tuner.policy import TunedPolicy
    from lowdiff._storage.format import Shard
    from lowdiff._storage.run_dir import RunDir
    from lowdiff.errors import UnsupportedError

    cfg = Config.from_dict({"run_dir": "r", "snapshot": {"every_steps": "auto"}})
    with pytest.raises(UnsupportedError, match="auto"):
        TunedPolicy(cfg, RunDir("r", Shard(0, 2)))
    assert TunedPolicy(cfg, RunDir("r")).tuner is not None


def test_writes_seen_together_are_split() -> None:
    p = Profiler()
    for _ in range(4):
        p.on_writes(segments=1, segment_bytes=1e5, snapshots=0, snapshot_bytes=0, seconds=0.01, steps_per_segment=4)
    p.on_writes(segments=2, segment_bytes=2e5, snapshots=1, snapshot_bytes=1e8, seconds=1.02, steps_per_segment=4)
    assert p._snapshot_writes[-1] == (1e8, pytest.approx(1.0))
    fresh = Profiler()  # no segment time known yet: split by bytes
    fresh.on_writes(segments=1, segment_bytes=1e6, snapshots=1, snapshot_bytes=9e6, seconds=1.0, steps_per_segment=4)
    assert fresh._snapshot_writes[-1] == (9e6, pytest.approx(0.9)) and fresh.diff_bytes() == pytest.approx(2.5e5)


# --- host memory of the records waiting for the writer --------------------------------------------------------


def test_batch_never_exceeds_the_buffer_bound() -> None:
    """B records wait per segment and queue_depth segments may wait: the solver keeps them in max_buffer_bytes,
    even where a larger B would pay (the contended regime raises B) or where no point meets the limits."""
    c = COSTS["contended"].replace(record_bytes=40e6)  # 40 MB per step, as compressor none logs a 10M model
    free = solve(c, Limits(mtbf_s=3600, max_buffer_bytes=0))
    capped = solve(c, Limits(mtbf_s=3600, max_buffer_bytes=1 << 30))
    assert free.batch_steps > 6
    assert capped.batch_steps <= (1 << 30) // (4 * 40e6) == 6
    assert "B capped at 6 by max_buffer_bytes" in capped.rationale
    hopeless = solve(c.replace(write_bytes_per_s=1e6), Limits(mtbf_s=3600, max_buffer_bytes=1 << 30))
    assert not hopeless.feasible and hopeless.batch_steps <= 6
    # Without a measured record size, the on-disk bytes per step stand in.
    assert solve(c.replace(record_bytes=0.0, diff_bytes=100e6), Limits(mtbf_s=3600)).batch_steps <= 2


def test_bootstrap_batch_fits_the_buffer_bound() -> None:
    big = AutoTuner(mtbf_s=3600, record_bytes_hint=200e6)  # 200 MB records: 1 GiB holds 4 x 1
    assert big.current()[1] == 1
    small = AutoTuner(mtbf_s=3600, record_bytes_hint=1e6)
    assert small.current()[1] == 16  # the usual bootstrap batch
    assert AutoTuner(mtbf_s=3600, record_bytes_hint=200e6, max_buffer_bytes=0).current()[1] == 16


def test_buffer_bound_is_configurable_and_checked() -> None:
    cfg = Config.from_dict({"run_dir": "x", "snapshot": {"every_steps": "auto"},
                            "tuner": {"max_buffer_bytes": 123456789}})
    assert AutoTuner.from_config(cfg).limits.max_buffer_bytes == 123456789
    with pytest.raises(ConfigError, match="tuner.max_buffer_bytes"):
        Config.from_dict({"run_dir": "x", "tuner": {"max_buffer_bytes": -1}})
