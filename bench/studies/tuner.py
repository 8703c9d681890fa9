"""The tuner against a grid search, CheckFreq's policy and fixed intervals, on costs measured on this machine.

    python bench/studies/tuner.py                                 # measure + simulate (~10 min on 2 shared cores)
    python bench/studies/tuner.py --smoke --out-dir /tmp/x        # seconds

Protocol
1. Measure (real lowdiff code, this machine). Model: bench/_common.py's FULL_MODEL GPT trained with AdamW and
   Top-k 1 %. T = median step time with lowdiff ``enabled: false`` (compression and decode included, no I/O).
   C_F = time to copy parameters + optimizer state off the live tensors (what a snapshot capture does).
   Per disk (fast: tmpfs /dev/shm; slow: ext4 /tmp with fsync; "50 MB/s disk": the slow one with every byte
   lowdiff commits limited to 50 MB/s through lowdiff's fault-injection seam, an emulated network disk),
   samples alternating between the disks so all see the same machine load:
     * a real lowdiff run (B = 8, no snapshot after step 0): S_d = log bytes on disk per step, S_F = the
       step-0 snapshot file;
     * l_w and BW_w: least-squares fit (lowdiff._persist.tuner.fit_write_cost) of time vs bytes over real
       write_segment calls (B = 1, 4, 16 steps of Top-k payload) and write_snapshot calls (the model's state);
     * t_rep, BW_r: a short real replay (lowdiff.recover of that run): (decode + apply) / steps, bytes / read time;
     * alpha (write interference): step time while a thread writes segments back to back vs idle, interleaved.
2. Simulate (discrete events, independent of the tuner's closed-form model). Training thread, bounded queue
   (queue_depth*B + 2 items) and a sequential writer are simulated item by item over several snapshot intervals
   until the schedule is periodic; failures are Poisson in wall-clock time; a failure loses the work since the
   newest durable step, then pays restart + snapshot load + replay of the log since the newest durable snapshot
   (failures during recovery restart it). Jobs of N steps are repeated until ~TARGET failures happened, with
   the same random stream for every policy (common random numbers). Waste = wall time - N*T.
   Approximation: after a restart the run re-enters the periodic schedule at its step phase (the writer's queue
   is assumed in its steady state, and snapshots not durable at the failure are not retaken).
3. Policies: the tuner (lowdiff._persist.tuner.solve on the measured costs); the best point of a grid over (F, B) with
   F a multiple of B (then refined around the best point); CheckFreq's interval k = max(ceil((t_persist -
   t_stall) / T), 1), k += 2 while its simulated overhead exceeds 5 %, failure rate ignored; fixed F = 50, 100,
   500. Baselines get lowdiff's best batch size for their interval (the tuner's B with F fixed), so only the
   interval policy differs.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common.py
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import FULL_MODEL, SMOKE_MODEL, ModelSpec, machine_info, output_paths, pyplot, train_step, write_json  # noqa: E402

import lowdiff  # noqa: E402
from lowdiff._compressors.topk import k_for  # noqa: E402
from lowdiff._persist.tuner import (  # noqa: E402
    Costs,
    Limits,
    evaluate,
    fit_write_cost,  # noqa: E402
    solve,
)
from lowdiff._storage.format import LOG_DIR, SNAPSHOT_DIR  # noqa: E402
from lowdiff._storage.segment import StepRecord, write_segment  # noqa: E402
from lowdiff._storage.snapshot import SnapshotState, write_snapshot  # noqa: E402
from lowdiff.testing import intercept_writes, real_pwritev  # noqa: E402

TOPK_RATIO = 0.01
QUEUE_DEPTH = 4
FIXED_INTERVALS = (50, 100, 500)
CHECKFREQ_MAX_OVERHEAD = 0.05


# -- 1. measurement -------------------------------------------------------------------------------------------------


def _median_time(fn: Any, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _capture(model: torch.nn.Module, opt: torch.optim.Optimizer) -> SnapshotState:
    """What a snapshot capture does on CPU: owned copies of parameters and optimizer state."""
    opt_state = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        opt_state[names[id(p)]] = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                                   for k, v in st.items()}
    return SnapshotState(step=1, params={n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()},
                         optimizer_state=opt_state, param_groups=[{"lr": 1e-3, "params": list(names.values())}])


def _topk_records(model: torch.nn.Module, first: int, n: int, gen: torch.Generator) -> list[StepRecord]:
    recs = []
    for i in range(n):
        grads = {}
        for name, p in model.named_parameters():
            k = k_for(p.numel(), TOPK_RATIO)
            grads[name] = {"values": torch.randn(k, generator=gen),
                           "indices": torch.randperm(p.numel(), generator=gen)[:k].sort().values}
        recs.append(StepRecord(step=first + i, groups=[{"lr": 1e-3}], grads=grads))
    return recs


def measure_model(spec: ModelSpec, steps: int) -> dict[str, Any]:
    model = spec.build()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = spec.batches(4)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-tuner-off-"))
    try:
        opt = lowdiff.wrap(inner, model, {"run_dir": str(work / "run"), "enabled": False,
                                          "compressor": {"name": "topk", "ratio": TOPK_RATIO}})
        for i in range(2):
            train_step(model, opt, batches[i % 4])
        it = iter(range(10**9))
        t = _median_time(lambda: train_step(model, opt, batches[next(it) % 4]), steps)
        # Optimizer step alone (the "apply time" estimate of the replay cost, for comparison with the replay).
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        apply_s = _median_time(inner.step, max(3, steps // 2))
        cap = _capture(model, inner)
        block_s = _median_time(lambda: _capture(model, inner), 5)
        nparams = sum(p.numel() for p in model.parameters())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"model": model, "inner": inner, "batches": batches, "iteration_s": t, "apply_s": apply_s,
            "snapshot_block_s": block_s, "state": cap, "params": nparams}


@dataclass(frozen=True)
class Disk:
    base: Path
    throttle_bytes_per_s: float = 0.0
    """> 0: every byte lowdiff commits goes through a write limited to this rate (lowdiff.testing.intercept_writes,
    the seam every committed byte passes), emulating a network disk on top of ``base``."""


@contextlib.contextmanager
def _on(disk: Disk) -> Iterator[None]:
    if disk.throttle_bytes_per_s <= 0:
        yield
        return

    def throttled(fd: int, data: Any, offset: int) -> int:
        n = real_pwritev(fd, data, offset)
        time.sleep(n / disk.throttle_bytes_per_s)
        return int(n)

    with intercept_writes(pwritev=throttled):
        yield


def _interference(m: dict[str, Any], runs: dict[str, tuple[Path, Disk]], rounds: int, steps: int,
                  records: list[StepRecord]) -> dict[str, dict[str, Any]]:
    """Step time while a thread writes segments back to back to each disk vs with no writer. Each round runs
    an idle window and one busy window per disk, in a rotating order, so a drifting machine load cancels out."""
    model, inner, batches = m["model"], m["inner"], m["batches"]
    it = iter(range(10**9))

    def window() -> float:
        return _median_time(lambda: train_step(model, inner, batches[next(it) % 4]), steps)

    def busy_window(run: Path, disk: Disk) -> tuple[float, float]:
        stop, busy_s = threading.Event(), [0.0]

        def writer() -> None:
            first = 10**6
            while not stop.is_set():
                recs = [StepRecord(step=first + i, groups=r.groups, grads=r.grads) for i, r in enumerate(records)]
                t0 = time.perf_counter()
                write_segment(run, recs, "lz4", "topk")
                busy_s[0] += time.perf_counter() - t0
                first += len(recs)

        with _on(disk):
            th = threading.Thread(target=writer, daemon=True)
            t0 = time.perf_counter()
            th.start()
            busy = window()
            wall = time.perf_counter() - t0
            stop.set()
            th.join()
        return busy, min(1.0, busy_s[0] / wall)

    names = list(runs)
    slow: dict[str, list[float]] = {n: [] for n in names}
    duty: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = [None, *names]
        order = order[r % len(order):] + order[: r % len(order)]
        times: dict[str | None, tuple[float, float]] = {}
        for who in order:
            times[who] = (window(), 0.0) if who is None else busy_window(*runs[who])
        for n in names:
            slow[n].append(times[n][0] / times[None][0] - 1.0)
            duty[n].append(times[n][1])
    out = {}
    for n in names:
        raw = statistics.median(x / max(d, 1e-3) for x, d in zip(slow[n], duty[n]))
        out[n] = {"alpha_raw": raw, "alpha": min(1.0, max(0.0, raw)), "slowdowns": slow[n], "writer_duty": duty[n]}
    return out


def measure_disks(m: dict[str, Any], disks: dict[str, Disk], smoke: bool) -> dict[str, dict[str, Any]]:
    """Per disk: S_d, S_F, l_w, BW_w, t_rep, BW_r, alpha. Samples alternate between the disks so that both
    see the same (shared, drifting) machine load."""
    works = {n: Path(tempfile.mkdtemp(prefix="lowdiff-tuner-", dir=d.base)) for n, d in disks.items()}
    model, inner, batches = m["model"], m["inner"], m["batches"]
    out: dict[str, dict[str, Any]] = {n: {"dir": str(d.base), "throttle_bytes_per_s": d.throttle_bytes_per_s}
                                      for n, d in disks.items()}
    try:
        # A real run per disk: S_d, S_F, and a log to replay.
        steps, batch = (4, 2) if smoke else (16, 8)
        for n, work in works.items():
            with _on(disks[n]):
                opt = lowdiff.wrap(inner, model, {"run_dir": str(work / "run"), "snapshot": {"every_steps": 10**9},
                                                  "compressor": {"name": "topk", "ratio": TOPK_RATIO},
                                                  "log": {"batch_steps": batch}})
                for i in range(steps):
                    train_step(model, opt, batches[i % 4])
                opt.close()
            out[n]["diff_bytes"] = sum(p.stat().st_size for p in (work / "run" / LOG_DIR).iterdir()) / steps
            out[n]["snapshot_bytes"] = sum(p.stat().st_size for p in (work / "run" / SNAPSHOT_DIR).iterdir())
        # A short real replay, alternating disks: t_rep = (decode + apply) / steps, BW_r = bytes / read time.
        reps: dict[str, list[Any]] = {n: [] for n in works}
        for _ in range(1 if smoke else 2):
            for n, work in works.items():
                reps[n].append(lowdiff.recover(work / "run", workers=1).report)
        for n, rs in reps.items():
            out[n]["replay_step_s"] = statistics.median((r.times.decode_s + r.times.apply_s) / max(1, r.steps_replayed)
                                                        for r in rs)
            out[n]["replay_steps"] = rs[0].steps_replayed
            reads = [r.bytes_read / r.times.read_s for r in rs if r.times.read_s > 0]
            out[n]["read_bytes_per_s"] = statistics.median(reads) if reads else 0.0
            out[n]["load_snapshot_s"] = statistics.median(r.times.load_snapshot_s for r in rs)
            out[n]["replay_summary"] = rs[-1].summary()
        # Write cost: real segment and snapshot writes of this model's sizes, alternating disks.
        for work in works.values():
            for d in (work / "fit" / LOG_DIR, work / "fit" / SNAPSHOT_DIR):
                d.mkdir(parents=True)
        pool = _topk_records(model, 1, 16, torch.Generator().manual_seed(0))
        samples: dict[str, list[tuple[float, float]]] = {n: [] for n in works}
        state = m["state"]
        step = 1
        for _ in range(2 if smoke else 5):
            for b in (1, 4) if smoke else (1, 4, 16):
                for n, work in works.items():
                    recs = [StepRecord(step=step + i, groups=r.groups, grads=r.grads) for i, r in enumerate(pool[:b])]
                    with _on(disks[n]):
                        t0 = time.perf_counter()
                        nb = write_segment(work / "fit", recs, "lz4", "topk")
                        samples[n].append((nb, time.perf_counter() - t0))
                step += b
            state.step = step
            for n, work in works.items():
                with _on(disks[n]):
                    t0 = time.perf_counter()
                    nb = write_snapshot(work / "fit", state, "lz4")
                    samples[n].append((nb, time.perf_counter() - t0))
            step += 1
        for n in works:
            fit = fit_write_cost(samples[n])
            assert fit is not None
            out[n].update(write_latency_s=fit.latency_s, write_bytes_per_s=fit.bytes_per_s, fit_method=fit.method,
                          write_samples=samples[n])
        if smoke:  # seconds matter more than alpha here
            for n in works:
                out[n].update(alpha_raw=0.0, alpha=0.0, slowdowns=[], writer_duty=[], skipped="smoke")
        else:
            runs = {n: (w / "fit", disks[n]) for n, w in works.items()}
            for n, r in _interference(m, runs, rounds=6, steps=3, records=pool[:8]).items():
                out[n].update(r)
    finally:
        for w in works.values():
            shutil.rmtree(w, ignore_errors=True)
    return out


def costs_from(m: dict[str, Any], d: dict[str, Any], restart_s: float) -> Costs:
    return Costs(iteration_s=m["iteration_s"], diff_bytes=d["diff_bytes"], snapshot_bytes=d["snapshot_bytes"],
                 snapshot_block_s=m["snapshot_block_s"], write_bytes_per_s=d["write_bytes_per_s"],
                 write_latency_s=d["write_latency_s"], replay_step_s=d["replay_step_s"],
                 read_bytes_per_s=d["read_bytes_per_s"], restart_s=restart_s, write_interference=d["alpha"],
                 sources={"replay_step_s": f"measured replay of {d['replay_steps']} steps (decode + apply)",
                          "write cost": f"{d['fit_method']} over {len(d['write_samples'])} writes"})


# -- 2. simulation ----------------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    """One period (F steps) of the failure-free steady state, times relative to the period's start (training
    resumes after the snapshot at step kF), steps relative to kF."""

    every: int
    batch: int
    period_s: float
    step_end: list[float]
    """[j] for j = 0..F: when step kF+j completed (j = 0: the snapshot step, in the previous period: < 0)."""
    resume: list[float]
    """[j]: when training starts step kF+j+1 (after capture/queue waits); resume[0] = 0, resume[F] = period."""
    log_t: list[float]
    log_step: list[int]
    """Commits of segments: time and last step, relative, covering the two previous periods too."""
    snap_t: list[float]
    snap_step: list[int]
    overhead: float
    writer_load: float


def simulate_timeline(every: int, batch: int, c: Costs, queue_depth: int = QUEUE_DEPTH) -> Timeline:
    f, b = every, batch
    t_it, cf, alpha = c.iteration_s, c.snapshot_block_s, c.write_interference
    w_seg = c.write_latency_s + b * c.diff_bytes / c.write_bytes_per_s
    w_snap = c.write_latency_s + c.snapshot_bytes / c.write_bytes_per_s
    qcap = queue_depth * b + 2
    periods = max(4, math.ceil((8 * qcap + 256) / f) + 1)
    n = periods * f
    step_end = [0.0] * (n + 1)
    resume = [0.0] * (n + 1)
    gets: list[float] = []
    charges: list[tuple[float, float]] = []
    ci = 0
    commits: list[tuple[float, int]] = []
    snaps: list[tuple[float, int]] = [(0.0, 0)]
    t = free = 0.0
    fill = 0
    busy = 0.0
    for i in range(1, n + 1):
        t += t_it
        while ci < len(charges) and charges[ci][0] <= t:  # the writer slows training while it writes
            t += charges[ci][1]
            ci += 1
        if len(gets) >= qcap:
            t = max(t, gets[-qcap])
        step_end[i] = t
        g = max(t, free)
        gets.append(g)
        fill += 1
        if fill == b:
            fill = 0
            free = g + w_seg
            busy += w_seg
            commits.append((free, i))
            charges.append((g, alpha * w_seg))
        else:
            free = g
        if i % f == 0:
            t += cf
            if len(gets) >= qcap:
                t = max(t, gets[-qcap])
            g = max(t, free)
            gets.append(g)
            free = g + w_snap
            busy += w_snap
            snaps.append((free, i))
            charges.append((g, alpha * w_snap))
        resume[i] = t
    base_step = n - f
    t0 = resume[base_step]
    period = resume[n] - t0
    lo = base_step - 3 * f
    log = [(tt - t0, s - base_step) for tt, s in commits if lo < s <= n]
    sn = [(tt - t0, s - base_step) for tt, s in snaps if lo < s <= n]
    return Timeline(f, b, period, [step_end[base_step + j] - t0 for j in range(f + 1)],
                    [resume[base_step + j] - t0 for j in range(f + 1)],
                    [x for x, _ in log], [s for _, s in log], [x for x, _ in sn], [s for _, s in sn],
                    (period - f * t_it) / period, (f / b * w_seg + w_snap) / period)


class _Clock:
    """Absolute positions on the periodic timeline."""

    def __init__(self, tl: Timeline) -> None:
        self.tl = tl

    def _split(self, i: int) -> tuple[int, int]:
        k = (i - 1) // self.tl.every
        return k, i - k * self.tl.every

    def step_end(self, i: int) -> float:
        k, j = self._split(i)
        return k * self.tl.period_s + self.tl.step_end[j]

    def resume(self, i: int) -> float:
        if i == 0:
            return 0.0
        k, j = self._split(i)
        return k * self.tl.period_s + self.tl.resume[j]

    def durable(self, t: float) -> tuple[int, int]:
        """(newest durable step, newest durable snapshot) at time t of an uninterrupted run."""
        tl = self.tl
        k = math.floor(t / tl.period_s)
        u = t - k * tl.period_s
        i = bisect.bisect_right(tl.log_t, u) - 1
        d = k * tl.every + (tl.log_step[i] if i >= 0 else -3 * tl.every)
        j = bisect.bisect_right(tl.snap_t, u) - 1
        s = k * tl.every + (tl.snap_step[j] if j >= 0 else -3 * tl.every)
        return max(d, s), s


@dataclass
class SimResult:
    every: int
    batch: int
    waste_s_per_hour: float
    ci95_s_per_hour: float
    overhead: float
    failures: int
    jobs: int
    job_steps: int
    mean_job_hours: float
    model_waste_s_per_hour: float
    job_wastes: list[float]
    job_walls: list[float]

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("job_wastes", "job_walls")}


def jobs_for(c: Costs, mtbf_s: float, job_steps: int, target_failures: int) -> int:
    """Jobs to simulate for about ``target_failures`` failures (the same count for every policy, so that job j
    of each policy meets the same failure times: paired comparisons)."""
    return max(1, math.ceil(target_failures * mtbf_s / (job_steps * c.iteration_s)))


def paired(a: SimResult, b: SimResult) -> dict[str, Any]:
    """Waste of ``a`` minus waste of ``b`` (s per hour) with a 95 % interval from the per-job differences."""
    n = len(a.job_wastes)
    wall = (sum(a.job_walls) + sum(b.job_walls)) / (2 * n)
    d = a.waste_s_per_hour - b.waste_s_per_hour
    diffs = [(x - y) / wall * 3600 for x, y in zip(a.job_wastes, b.job_wastes)]
    ci = 1.96 * statistics.stdev(diffs) / math.sqrt(n) if n > 1 else float("nan")
    verdict = "better" if d + ci < 0 else "worse" if d - ci > 0 else "tie"
    return {"diff_s_per_hour": d, "ci95_s_per_hour": ci, "verdict": verdict}


class _Draws:
    """Failure inter-arrival times of one job: its row of the table, then its own overflow stream."""

    def __init__(self, row: list[float], mtbf_s: float, key: tuple[int, int]) -> None:
        self.row, self.mtbf_s, self.key, self.i = row, mtbf_s, key, 0
        self.extra: np.random.Generator | None = None

    def __call__(self) -> float:
        self.i += 1
        if self.i <= len(self.row):
            return self.row[self.i - 1]
        if self.extra is None:
            self.extra = np.random.default_rng(list(self.key))
        return float(self.extra.exponential(self.mtbf_s))


def simulate(every: int, batch: int, c: Costs, mtbf_s: float, job_steps: int, jobs: int,
             seed: int = 0) -> SimResult:
    tl = simulate_timeline(every, batch, c)
    clock = _Clock(tl)
    # Job j always draws its failure times from row j (then from its own overflow stream): the same times for
    # every policy, so policies are compared on the same failures.
    per_job = job_steps * c.iteration_s / mtbf_s
    width = math.ceil(per_job + 6 * math.sqrt(per_job) + 8)
    table = np.random.default_rng(seed).exponential(mtbf_s, size=(jobs, width)).tolist()
    read_bw = c.read_bw
    load = c.read_latency_s + c.snapshot_bytes / read_bw
    per_step = c.replay_step_s + c.diff_bytes / read_bw
    end = clock.step_end(job_steps)
    wastes, walls, failures = [], [], 0
    for j in range(jobs):
        draw = _Draws(table[j], mtbf_s, (seed, j))
        wall, d, s, pos = 0.0, 0, 0, 0.0
        while True:
            u = draw()
            if pos + u >= end:
                wall += end - pos
                break
            failures += 1
            wall += u
            dd, ss = clock.durable(pos + u)
            nd = max(d, dd)
            ns = ss if ss > d else s  # snapshots older than the restart point were not retaken
            ns = min(max(ns, s), nd)
            replay = nd - ns
            rec = c.restart_s + load + replay * per_step + math.ceil(replay / batch) * c.read_latency_s
            while True:  # a failure during recovery starts it over
                u2 = draw()
                if u2 >= rec:
                    wall += rec
                    break
                failures += 1
                wall += u2
            d, s = nd, ns
            pos = clock.resume(d)
        wastes.append(wall - job_steps * c.iteration_s)
        walls.append(wall)
    rate = sum(wastes) / sum(walls) * 3600
    # 95 % interval of the ratio estimator over jobs (delta method).
    if jobs > 1:
        mw = sum(walls) / jobs
        resid = [(w - rate / 3600 * wl) / mw for w, wl in zip(wastes, walls)]
        ci = 1.96 * statistics.stdev(resid) / math.sqrt(jobs) * 3600
    else:
        ci = float("nan")
    model = evaluate(c, Limits(mtbf_s=mtbf_s, queue_depth=QUEUE_DEPTH), every, batch).waste_s_per_hour
    return SimResult(every, batch, rate, ci, tl.overhead, failures, jobs, job_steps,
                     sum(walls) / jobs / 3600, model, wastes, walls)


# -- 3. policies and scenarios -------------------------------------------------------------------------------------


def checkfreq_interval(c: Costs, overhead_of: Any) -> tuple[int, int]:
    """CheckFreq (FAST'21): k = max(ceil((t_persist - t_snapshot_stall) / t_iter), 1), then k += 2 while the
    measured overhead exceeds 5 %; returns (initial k, final k)."""
    t_persist = c.write_latency_s + c.snapshot_bytes / c.write_bytes_per_s
    k0 = max(math.ceil((t_persist - c.snapshot_block_s) / c.iteration_s), 1)
    k = k0
    while overhead_of(k) > CHECKFREQ_MAX_OVERHEAD and k < 10**6:
        k += 2
    return k0, k


def _grid(limits: Limits, smoke: bool) -> list[tuple[int, int]]:
    bs = [1, 4, 16, 64] if smoke else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    top = 20_000 if smoke else 200_000
    out = []
    for b in bs:
        nf = 6 if smoke else 28
        for k in range(nf):
            f = int(round(8 * (top / 8) ** (k / (nf - 1)) / b)) * b
            if f >= b:
                out.append((max(f, b), b))
    return sorted(set(out))


def run_scenario(name: str, c: Costs, mtbf_h: float, args: argparse.Namespace) -> dict[str, Any]:
    mtbf_s = mtbf_h * 3600
    limits = Limits(mtbf_s=mtbf_s, queue_depth=QUEUE_DEPTH)
    sim_cache: dict[tuple[int, int], SimResult] = {}
    jobs = jobs_for(c, mtbf_s, args.job_steps, args.failures)

    def sim(f: int, b: int) -> SimResult:
        if (f, b) not in sim_cache:
            sim_cache[(f, b)] = simulate(f, b, c, mtbf_s, args.job_steps, jobs, seed=args.seed)
        return sim_cache[(f, b)]

    def with_best_batch(f: int) -> tuple[int, int]:
        d = solve(c, Limits(mtbf_s=mtbf_s, queue_depth=QUEUE_DEPTH, every_steps=f))
        return f, d.batch_steps

    t0 = time.perf_counter()
    tuned = solve(c, limits)
    tuner_res = sim(tuned.every_steps, tuned.batch_steps)
    grid = [sim(f, b) for f, b in _grid(limits, args.smoke)]
    best = min(grid, key=lambda r: r.waste_s_per_hour)
    # Refine around the best grid point: neighbouring batch sizes, and F on a fine multiplicative grid.
    refine_b = sorted({max(1, round(best.batch * x)) for x in (0.5, 0.75, 1, 1.5, 2)})
    for b in refine_b:
        for x in ([0.7, 1, 1.4] if args.smoke else [0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.4, 1.6]):
            f = max(b, int(round(best.every * x / b)) * b)
            grid.append(sim(f, b))
    best = min(grid, key=lambda r: r.waste_s_per_hour)
    feasible = [r for r in grid if r.overhead <= limits.max_overhead]
    best_feasible = min(feasible, key=lambda r: r.waste_s_per_hour) if feasible else None
    k0, k = checkfreq_interval(c, lambda kk: sim(*with_best_batch(kk)).overhead)
    cf_res = sim(*with_best_batch(k))
    fixed = {f: sim(*with_best_batch(f)) for f in FIXED_INTERVALS}
    elapsed = time.perf_counter() - t0
    ratio = tuner_res.waste_s_per_hour / best.waste_s_per_hour
    vs = {"grid_best": paired(tuner_res, best), "checkfreq": paired(tuner_res, cf_res),
          **{f"F={f}": paired(tuner_res, r) for f, r in fixed.items()}}
    out = {
        "scenario": name, "mtbf_hours": mtbf_h, "costs": {k_: v for k_, v in asdict(c).items() if k_ != "sources"},
        "tuner": {**tuner_res.to_dict(), "decision_waste_s_per_hour": tuned.waste_s_per_hour,
                  "young_daly_every_steps": tuned.young_daly_every_steps, "min_batch_steps": tuned.min_batch_steps,
                  "rationale": tuned.rationale},
        "grid_best": best.to_dict(),
        "grid_best_within_max_overhead": best_feasible.to_dict() if best_feasible else None,
        "checkfreq": {**cf_res.to_dict(), "k_initial": k0, "k_final": k},
        "fixed": {str(f): r.to_dict() for f, r in fixed.items()},
        "tuner_over_grid_best": ratio,
        "tuner_minus": vs,
        "tuner_beats_checkfreq": vs["checkfreq"]["verdict"] == "better",
        "tuner_beats_fixed": all(vs[f"F={f}"]["verdict"] == "better" for f in fixed),
        "tuner_not_worse_than_fixed": all(vs[f"F={f}"]["verdict"] != "worse" for f in fixed),
        "grid": [r.to_dict() for r in grid], "simulated_points": len(sim_cache), "elapsed_s": elapsed,
    }
    print(f"[{name}] tuner F={tuned.every_steps} B={tuned.batch_steps}: {tuner_res.waste_s_per_hour:.2f} s/h "
          f"(model {tuned.waste_s_per_hour:.2f}); grid best F={best.every} B={best.batch}: "
          f"{best.waste_s_per_hour:.2f} s/h; ratio {ratio:.3f}; CheckFreq k={k}: {cf_res.waste_s_per_hour:.2f}; "
          + ", ".join(f"F={f}: {r.waste_s_per_hour:.2f}" for f, r in fixed.items()) + f"  [{elapsed:.0f} s]",
          flush=True)
    return out


# -- 4. output -----------------------------------------------------------------------------------------------------


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    cols = 2 if len(results) % 2 == 0 else 1  # MTBF 1 h | 24 h side by side, one row per disk
    rows = math.ceil(len(results) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.9 * rows), squeeze=False)
    for ax, r in zip(axes.flat, results):
        by_b: dict[int, list[tuple[int, float]]] = {}
        for g in r["grid"]:
            by_b.setdefault(g["batch"], []).append((g["every"], g["waste_s_per_hour"]))
        shown = sorted(by_b, key=lambda b: abs(math.log(b / max(1, r["tuner"]["batch"]))))[:4]
        for b in sorted(shown):
            pts = sorted(by_b[b])
            if len(pts) > 2:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, alpha=0.7, label=f"grid B={b}")
        t, g, cf = r["tuner"], r["grid_best"], r["checkfreq"]
        ax.plot([t["every"]], [t["waste_s_per_hour"]], "r*", ms=14, label=f"tuner F={t['every']} B={t['batch']}")
        ax.plot([g["every"]], [g["waste_s_per_hour"]], "ko", mfc="none", ms=11,
                label=f"grid best F={g['every']} B={g['batch']}")
        ax.plot([cf["every"]], [cf["waste_s_per_hour"]], "g^", ms=9, label=f"CheckFreq k={cf['every']}")
        for f, fx in r["fixed"].items():
            ax.plot([fx["every"]], [fx["waste_s_per_hour"]], "bs", ms=6)
            ax.annotate(f"F={f}", (fx["every"], fx["waste_s_per_hour"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("snapshot interval F (steps)")
        ax.set_ylabel("expected waste (s per hour)")
        ax.set_title(f"{r['scenario']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Tuner benchmark",
        "",
        f"Produced by `{doc['command']}` on {doc['machine']['date']} ({doc['machine']['platform']}, "
        f"{doc['machine']['cpu_count']} cores, load average at start {doc['machine']['loadavg_start']}).",
        "Costs measured on this machine with real lowdiff writes and a real replay; the job is simulated",
        f"(discrete events, Poisson failures, jobs of {doc['job_steps']:,} steps repeated to ~{doc['failures']:,} "
        "failures per policy, common random numbers). Protocol: the docstring of bench/studies/tuner.py; model: "
        "docs/reference/tuner-model.md. Expected waste in seconds per hour of wall time "
        "(95 % interval of the simulation).",
        "",
        "## Measured costs",
        "",
        "| | T | S_d | S_F | C_F | BW_w | l_w | t_rep | BW_r | alpha |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for disk, c in doc["costs"].items():
        lines.append(f"| {disk} | {c['iteration_s'] * 1e3:.0f} ms | {c['diff_bytes'] / 1e3:.0f} kB | "
                     f"{c['snapshot_bytes'] / 1e6:.1f} MB | {c['snapshot_block_s'] * 1e3:.1f} ms | "
                     f"{c['write_bytes_per_s'] / 1e6:.0f} MB/s | {c['write_latency_s'] * 1e3:.2f} ms | "
                     f"{c['replay_step_s'] * 1e3:.1f} ms | "
                     f"{(c['read_bytes_per_s'] or c['write_bytes_per_s']) / 1e6:.0f} MB/s | "
                     f"{c['write_interference']:.2f} |")
    lines += [
        "",
        f"Optimizer step alone during training (the \"apply time\" estimate of t_rep): "
        f"{doc['model']['apply_s'] * 1e3:.1f} ms.",
        "",
        "## Expected waste (s per hour)",
        "",
        "| scenario | tuner (F, B) | grid best (F, B) | tuner / grid best | CheckFreq (k) | "
        + " | ".join(f"F={f}" for f in FIXED_INTERVALS) + " |",
        "|---|---|---|---|---|" + "---|" * len(FIXED_INTERVALS),
    ]
    for r in doc["scenarios"]:
        t, g, cf = r["tuner"], r["grid_best"], r["checkfreq"]
        lines.append(
            f"| {r['scenario']} | {t['waste_s_per_hour']:.2f} ± {t['ci95_s_per_hour']:.2f} "
            f"({t['every']}, {t['batch']}) | "
            f"{g['waste_s_per_hour']:.2f} ({g['every']}, {g['batch']}) | {r['tuner_over_grid_best']:.3f} | "
            f"{cf['waste_s_per_hour']:.2f} ({cf['every']}) | "
            + " | ".join(f"{r['fixed'][str(f)]['waste_s_per_hour']:.2f}" for f in FIXED_INTERVALS) + " |")
    others = ["grid_best", "checkfreq", *(f"F={f}" for f in FIXED_INTERVALS)]
    lines += [
        "",
        "Paired differences, tuner minus each policy (s per hour; the same failure times for both policies, job by "
        "job; 95 % interval; better / tie / worse):",
        "",
        "| scenario | " + " | ".join(o.replace("_", " ") for o in others) + " |",
        "|---|" + "---|" * len(others),
    ]
    for r in doc["scenarios"]:
        cells = [f"{r['tuner_minus'][o]['diff_s_per_hour']:+.2f} ± {r['tuner_minus'][o]['ci95_s_per_hour']:.2f} "
                 f"{r['tuner_minus'][o]['verdict']}" for o in others]
        lines.append(f"| {r['scenario']} | " + " | ".join(cells) + " |")
    worst = doc["summary"]["worst_over_grid_best"]
    lines += [
        "",
        "Worst ratio to the grid's best over all scenarios (a fixed interval may suit one disk and failure rate, "
        "never all): " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()) + ".",
    ]
    lines += [
        "",
        "Model vs simulation at the tuner's choice (the tuner's closed-form prediction against the event "
        "simulation): " + "; ".join(f"{r['scenario']}: {r['tuner']['model_waste_s_per_hour']:.2f} vs "
                                    f"{r['tuner']['waste_s_per_hour']:.2f}" for r in doc["scenarios"]) + ".",
        "",
        "Baselines use lowdiff's best batch size for their interval; CheckFreq's k starts at "
        "max(ceil((t_persist - t_stall)/T), 1) and grows by 2 while its overhead exceeds 5 %.",
        "",
        "![waste vs interval](tuner.png)",
        "",
        "## A decision",
        "",
        "The tuner's rationale (what lowdiff logs at DEBUG and stores in RUN_DIR/tuner.json) for each scenario:",
        "",
    ]
    for r in doc["scenarios"]:
        lines += [f"<details><summary>{r['scenario']}</summary>", "", "```", r["tuner"]["rationale"], "```", "",
                  "</details>", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, tiny grid, few failures (seconds)")
    p.add_argument("--out-dir", default=None, help="write tuner.json/.md/.png here (default: bench/results, docs)")
    p.add_argument("--fast-dir", default="/dev/shm", help="directory on the fast disk")
    p.add_argument("--slow-dir", default=tempfile.gettempdir(), help="directory on the slow disk")
    p.add_argument("--throttle-mb-s", type=float, default=50.0,
                   help="third disk: the slow one with every committed byte limited to this rate (0: no third disk)")
    p.add_argument("--mtbf-hours", type=float, nargs="+", default=[1.0, 24.0])
    p.add_argument("--restart-s", type=float, default=0.0, help="fixed restart cost R (adds lambda*R to every policy)")
    p.add_argument("--job-steps", type=int, default=None,
                   help="steps per simulated job (default 1e5; smoke 2e5: its steps are short)")
    p.add_argument("--failures", type=int, default=None, help="failures to simulate per policy (default 4000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-json", default=None, help="only re-render the markdown and the plot from this JSON")
    args = p.parse_args(argv)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        _, mpath, ppath = output_paths(args.out_dir, "tuner")
        mpath.write_text(_markdown(doc))
        _plot(doc["scenarios"], ppath)
        print(f"wrote {mpath}, {ppath}")
        return 0
    args.job_steps = args.job_steps or (200_000 if args.smoke else 100_000)
    args.failures = args.failures or (150 if args.smoke else 4000)
    torch.set_num_threads(1)  # as the other benchmarks: steadier step times on a shared machine
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    t0 = time.perf_counter()
    m = measure_model(spec, steps=2 if args.smoke else 9)
    print(f"model: {m['params']:,} parameters, T={m['iteration_s'] * 1e3:.1f} ms, "
          f"C_F={m['snapshot_block_s'] * 1e3:.1f} ms, "
          f"optimizer step {m['apply_s'] * 1e3:.1f} ms", flush=True)
    disks = {"fast disk": Disk(Path(args.fast_dir)), "slow disk": Disk(Path(args.slow_dir))}
    if args.throttle_mb_s > 0:
        disks[f"{args.throttle_mb_s:g} MB/s disk"] = Disk(Path(args.slow_dir), args.throttle_mb_s * 1e6)
    measured = measure_disks(m, disks, args.smoke)
    costs = {}
    for name, base in disks.items():
        d = measured[name]
        costs[name] = costs_from(m, d, args.restart_s)
        print(f"{name} ({base.base}): S_d={d['diff_bytes'] / 1e3:.0f} kB, S_F={d['snapshot_bytes'] / 1e6:.1f} MB, "
              f"l_w={d['write_latency_s'] * 1e3:.2f} ms, BW_w={d['write_bytes_per_s'] / 1e6:.0f} MB/s "
              f"({d['fit_method']}), "
              f"t_rep={d['replay_step_s'] * 1e3:.1f} ms, alpha={d['alpha']:.2f} (raw {d['alpha_raw']:.2f})", flush=True)
    measure_s = time.perf_counter() - t0
    scenarios = [run_scenario(f"{disk}, MTBF {h:g} h", costs[disk], h, args)
                 for disk in disks for h in args.mtbf_hours]
    cmd = "python bench/studies/tuner.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    doc = {
        "command": cmd.strip(), "machine": machine_info(), "smoke": args.smoke, "model": {
            **spec.as_dict(), "params": m["params"], "iteration_s": m["iteration_s"], "apply_s": m["apply_s"],
            "snapshot_block_s": m["snapshot_block_s"]},
        "measured": {k: {kk: vv for kk, vv in v.items()} for k, v in measured.items()},
        "costs": {k: {kk: vv for kk, vv in asdict(v).items() if kk != "sources"} for k, v in costs.items()},
        "job_steps": args.job_steps, "failures": args.failures, "restart_s": args.restart_s,
        "measure_s": measure_s, "total_s": time.perf_counter() - t0, "scenarios": scenarios,
        "summary": {
            "max_tuner_over_grid_best": max(s["tuner_over_grid_best"] for s in scenarios),
            "tuner_beats_checkfreq_everywhere": all(s["tuner_beats_checkfreq"] for s in scenarios),
            "tuner_beats_fixed_everywhere": all(s["tuner_beats_fixed"] for s in scenarios),
            "tuner_not_worse_than_fixed_anywhere": all(s["tuner_not_worse_than_fixed"] for s in scenarios),
            # How far from the grid's best each policy gets in its worst scenario: one fixed interval can be
            # right for one disk and failure rate, not for all.
            "worst_over_grid_best": {
                "tuner": max(s["tuner_over_grid_best"] for s in scenarios),
                "checkfreq": max(s["checkfreq"]["waste_s_per_hour"] / s["grid_best"]["waste_s_per_hour"]
                                 for s in scenarios),
                **{f"F={f}": max(s["fixed"][str(f)]["waste_s_per_hour"] / s["grid_best"]["waste_s_per_hour"]
                                 for s in scenarios) for f in FIXED_INTERVALS},
            },
        },
    }
    jpath, mpath, ppath = output_paths(args.out_dir, "tuner")
    write_json(jpath, doc)
    mpath.write_text(_markdown(doc))
    _plot(scenarios, ppath)
    s = doc["summary"]
    print(f"tuner/grid-best worst {s['max_tuner_over_grid_best']:.3f}; beats CheckFreq everywhere: "
          f"{s['tuner_beats_checkfreq_everywhere']}; beats fixed everywhere: {s['tuner_beats_fixed_everywhere']} "
          f"(never worse: {s['tuner_not_worse_than_fixed_anywhere']}); worst ratio to the grid's best: "
          + ", ".join(f"{k} {v:.2f}" for k, v in s["worst_over_grid_best"].items()))
    print(f"wrote {jpath}, {mpath}, {ppath} in {doc['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
