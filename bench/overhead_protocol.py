"""The measurement protocol of bench/overhead.py: warm-up, rounds of interleaved windows, ratios to the reference
measured next to each window, stratification by checkpoint events, the step-time tail.

Protocol (one process, one model, one AdamW shared by every mode, so every mode trains the same tensors; the one
exception, ``lowdiff-none-layerwise``, trains a replica: see overhead_lowdiff.py):
  * every mode is warmed up, then R rounds. A round runs windows of consecutive training steps: plain training
    (P) and every baseline X alternate, P X1 P X2 ... Xn P (the baselines' order rotates each round), and the
    lowdiff modes run as (C off, C on, C off) for each compressor C and each variant of C (none off,
    none-shadow, none off; ...), before or after that chain (alternating by round). Step times are wall-clock
    per step (forward, backward, clipping, optimizer step, checkpoint work on the training thread); process CPU
    time per window (all threads) is recorded too.
  * a window's ratio = its mean step time / the mean step time of its reference measured next to it in time:
    for a baseline, the mean of the two plain windows around it; for lowdiff with compressor C, the mean of the
    two windows of lowdiff with C and ``enabled: false`` around it (the lowdiff block of a round is
    off-on-off per compressor; the disabled twin compresses and decodes identically and writes nothing, so
    compression cost is excluded; both twins get the same warm-up). The shared machine's load drifts on a
    scale of seconds, so only neighbouring windows are compared. The reported overhead is the median over rounds.
  * checkpoint events are aligned with window starts (the k-step counter is 0 at a window start; the lowdiff
    warm-up is W-1 steps for a lowdiff window of W steps, plus one snapshot interval, so its snapshot steps,
    multiples of ``snapshot.every_steps``, start a window, and the run's first snapshot, which allocates the host
    buffers every later one reuses, is not timed: the timed ones are the steady state; ``--time-first-snapshot``
    times it). When the interval k exceeds the window W, only some rounds hold
    an event; the ratio is then stratified: (1 - W/k) * median(rounds without) + (W/k) * median(rounds with).
  * background work (lowdiff's writer, CheckFreq's persist thread, DCP's upload) still running when a window
    ends is waited for OUTSIDE the timed window (so it cannot slow the next window); that wait is reported, and
    ``ratio_incl_drain`` charges it to the window as if it had blocked training (an upper bound).
  * the step-time tail (issue #8: does a step wait for a snapshot?), per mode over all its timed steps:
    ``max_over_median`` = slowest / median step time, ``event_steps_over_others`` = median of the steps with a
    checkpoint event (lowdiff: snapshot steps) / median of the others (None unless both were timed; how many event
    steps in ``event_steps_timed``; which step of each window in the windows' ``event_steps``). Plain's own
    max / median is the noise floor of the shared machine.

On ``--device cuda`` the stream is synchronized at every window boundary (before the first step and after the
last), so a window's mean step time is real GPU time (the per-step times inside a window are host-side).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import median
from overhead_modes import Ctx, Mode, sync


def iqr(xs: list[float]) -> list[float] | None:
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def stratified(ratios: list[float], events: list[float], k: int | None, s: int) -> tuple[float, str]:
    """Median ratio, weighting rounds with and without an event by how often they occur in a long run."""
    if k is None or k <= s:
        return median(ratios), "median over all rounds"
    with_ev = [r for r, e in zip(ratios, events) if e]
    without = [r for r, e in zip(ratios, events) if not e]
    w = s / k
    if not with_ev or not without:
        return median(ratios), f"INCOMPLETE: {len(with_ev)} rounds with an event, {len(without)} without"
    return (1 - w) * median(without) + w * median(with_ev), (
        f"stratified: {1 - w:.2f} x median of {len(without)} rounds without + {w:.2f} x median of "
        f"{len(with_ev)} round(s) with a checkpoint event")


def step_tail(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The step-time tail of one mode over all its timed steps (issue #8: does a step wait for a snapshot?):
    max / median step time, and the median of the steps that took a checkpoint event (a lowdiff snapshot step, a
    baseline's save) over the median of the other steps (None unless both kinds were timed)."""
    times = [t for w in windows for t in w["step_s"]]
    at = [w["step_s"][i] for w in windows for i in w.get("event_steps", [])]
    other = [t for w in windows for i, t in enumerate(w["step_s"]) if i not in w.get("event_steps", [])]
    med = median(times)
    return {"step_median_s": med, "step_max_s": max(times) if times else None,
            "max_over_median": max(times) / med if times and med > 0 else None,
            "event_steps_timed": len(at),
            "event_steps_over_others": median(at) / median(other) if at and other else None}


class Batches:
    """The fixed batches, cycled by one counter across warm-ups, windows and the measurements after them."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.i = batches, 0

    def __call__(self) -> Any:
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]


def round_sequence(modes: list[Mode], r: int) -> list[Mode]:
    """The windows of round ``r`` in execution order: P X1 P X2 ... Xn P (baselines rotated by r), and the lowdiff
    block (C-off C C-off per enabled lowdiff mode) after it on even rounds, before it on odd ones."""
    plain = next(m for m in modes if m.name == "plain")
    baselines = [m for m in modes if m.family not in ("plain", "lowdiff")]
    by_name = {m.name: m for m in modes}
    ld_block: list[Mode] = []
    for m in modes:
        if m.family == "lowdiff" and m.ref != "plain":
            # every enabled window sits between two windows of its enabled:false twin
            ld_block += [by_name[m.ref], m, by_name[m.ref]]
    rot = baselines[r % max(len(baselines), 1):] + baselines[: r % max(len(baselines), 1)]
    seq: list[Mode] = [plain]
    for m in rot:
        seq += [m, plain]  # every baseline window sits between two plain windows
    return seq + ld_block if r % 2 == 0 else ld_block + seq


def run_window(m: Mode, next_batch: Batches, ctx: Ctx, tidy: bool, t_start: float) -> dict[str, Any]:
    """One timed window of ``m.window`` consecutive steps of mode ``m``."""
    device = ctx.settings.device
    n = m.window
    times, event_at = [], []
    m.begin_window()
    sync(device)  # on a GPU: nothing of the previous window runs into this one
    c0 = time.process_time()
    for i in range(n):
        b = next_batch()
        t0 = time.perf_counter()
        if m.step(b):
            event_at.append(i)
        if i == n - 1:
            sync(device)  # the last step's time absorbs the queued GPU work: the window's sum is real
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - c0
    wait = m.end_window()
    if tidy:
        m.tidy()
    return {"mode": m.name, "mean_step_s": sum(times) / n, "cpu_step_s": cpu / n, "step_s": times,
            "events": len(event_at), "event_steps": event_at, "drain_s": wait,
            "t_s": time.perf_counter() - t_start}


def ratios_by_mode(modes: list[Mode], windows: list[list[dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """Per mode and round: ratio to the reference measured closest in time."""
    ratios: dict[str, dict[str, list[float]]] = {m.name: {"wall": [], "cpu": [], "drain": [], "plain": [],
                                                           "events": []} for m in modes}
    by_name = {m.name: m for m in modes}
    for rw in windows:
        plain_wall = median([w["mean_step_s"] for w in rw if w["mode"] == "plain"])
        plain_cpu = median([w["cpu_step_s"] for w in rw if w["mode"] == "plain"])
        for i, w in enumerate(rw):
            m = by_name[w["mode"]]
            is_baseline = m.family not in ("plain", "lowdiff")
            is_enabled_lowdiff = m.family == "lowdiff" and m.ref != "plain"
            if is_baseline or is_enabled_lowdiff:
                # the reference windows right before and after (plain, or the enabled:false twin)
                refs = [x for x in (rw[i - 1] if i else None, rw[i + 1] if i + 1 < len(rw) else None)
                        if x and x["mode"] == m.ref]
            else:
                refs = []
            ref_wall = sum(x["mean_step_s"] for x in refs) / len(refs) if refs else plain_wall
            ref_cpu = sum(x["cpu_step_s"] for x in refs) / len(refs) if refs else plain_cpu
            n = len(w["step_s"])
            d = ratios[m.name]
            d["wall"].append(w["mean_step_s"] / ref_wall)
            d["cpu"].append(w["cpu_step_s"] / ref_cpu)
            d["drain"].append((w["mean_step_s"] * n + w["drain_s"]) / (ref_wall * n))
            d["plain"].append(w["mean_step_s"] / plain_wall)
            d["events"].append(w["events"])
    return ratios


def run(modes: list[Mode], ctx: Ctx, batches: list[Any], rounds: int, tidy: bool,
        t_start: float, sequence: Callable[[list[Mode], int], list[Mode]] = round_sequence
        ) -> dict[str, dict[str, Any]]:
    """Set up and warm up every mode, run the rounds, and return every mode's result (its JSON entry).
    ``sequence(modes, r)``: the windows of round ``r`` (default :func:`round_sequence`; every window of a
    baseline or an enabled lowdiff mode must sit next to a window of its reference)."""
    next_batch = Batches(batches)
    for m in modes:
        m.setup(ctx)
        m.warm(next_batch)
        m.start_timed()
    print(f"  setup + warm-up {time.perf_counter() - t_start:.0f} s", flush=True)
    gc.collect()
    gc.freeze()  # a full collection walks torch's huge module graph (~0.4 s); keep it out of the timed steps
    bytes0 = {m.name: m.bytes_written() for m in modes}
    comp0 = {m.name: m.compress_s for m in modes}
    windows: list[list[dict[str, Any]]] = []  # per round, in execution order
    for r in range(rounds):
        windows.append([run_window(m, next_batch, ctx, tidy, t_start) for m in sequence(modes, r)])
        pl = [w["mean_step_s"] for w in windows[-1] if w["mode"] == "plain"]
        print(f"  round {r + 1}/{rounds} done at {time.perf_counter() - t_start:.0f} s; plain "
              f"{median(pl):.3f} s/step (median of {len(pl)} windows)", flush=True)
    for m in modes:
        m.finish(next_batch)
    total_steps = {m.name: 0 for m in modes}
    for rw in windows:
        for w in rw:
            total_steps[w["mode"]] += len(w["step_s"])
    ratios = ratios_by_mode(modes, windows)
    results: dict[str, dict[str, Any]] = {}
    for m in modes:
        d = ratios[m.name]
        mine = [w for rw in windows for w in rw if w["mode"] == m.name]
        if m.name == "plain":
            d = {k: [1.0] * len(mine) if k != "events" else [0] * len(mine) for k in d}
        ev = d["events"]
        ratio, how = stratified(d["wall"], ev, m.k, m.window)
        results[m.name] = {
            "family": m.family, "k": m.k, "reference": m.ref, "window_steps": m.window,
            "ratio": ratio, "ratio_iqr": iqr(d["wall"]) if not m.k or m.k <= m.window else None,
            "ratio_incl_drain": stratified(d["drain"], ev, m.k, m.window)[0],
            "ratio_cpu": stratified(d["cpu"], ev, m.k, m.window)[0],
            "ratio_vs_plain": stratified(d["plain"], ev, m.k, m.window)[0], "statistic": how,
            "median_step_s": median([w["mean_step_s"] for w in mine]),
            "bytes_per_step": (m.bytes_written() - bytes0[m.name]) / total_steps[m.name],
            "compress_s_per_step": m.compress_s_per_step(comp0[m.name], total_steps[m.name]),
            "drain_s_per_window": median([w["drain_s"] for w in mine]),
            **step_tail(mine),
            "round_ratios": d["wall"], "round_ratios_cpu": d["cpu"], "round_events": ev,
            "windows": mine, **m.info(),
            **m.results(total_steps[m.name]),
        }
    return results
