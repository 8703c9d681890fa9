"""Goodput from bench/alternatives.py's measurements, its page and its plot.

Goodput, the fraction of wall-clock time that is useful training, is the tuner's waste model
(lowdiff/_persist/tuner/model.py, ``evaluate``: waste = overhead + lambda x failure_cost x (1 - overhead)) fed with
what this benchmark measured for each method:

    goodput = (1 - o) x (1 - C / MTBF),   o = 1 - 1 / ratio,
    C = R + restart + (lost + 1/2) x T

ratio: the method's step time over its reference's; R: the restart cost stated on the command line (a failure to
the relaunched process: scheduler, allocation); restart: the measured wall time from starting a fresh process to
the end of its first resumed step (imports, model build, load or replay); lost: the expected steps lost per
failure (measured, below); 1/2: the step in progress when the failure comes; T = plain step time x the method's
ratio over plain. The tuner's model computes the same quantities from profiled costs (lag, load, replay) for
lowdiff alone; here each is measured, for every method.

Expected steps lost: lowdiff's is the mean measured over its kills (it does not depend on where the kill falls
within a snapshot interval). An interval method's loss is the phase of the kill within its interval plus the lag
of the save in flight; the kills fall within the first min(k, kill_span) steps after a save, so the expectation
over a whole interval is (k - 1) / 2 (the phase, uniform) + the mean measured lag (steps lost - phase).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from _common import mb, pyplot
from alternatives_kill import S0

MTBF_H = (1, 6, 24)


def goodput(ratio: float, cost_s: float, mtbf_s: float) -> float:
    """A ratio below 1 is the machine's noise (checkpointing adds work): counted as no overhead."""
    o = max(0.0, 1.0 - 1.0 / ratio)
    return (1.0 - o) * max(0.0, 1.0 - cost_s / mtbf_s)


def summarize(doc: dict[str, Any]) -> list[dict[str, Any]]:
    modes, kills = doc["modes"], doc["kills"]
    plain_s = modes["plain"]["median_step_s"]
    r_cost = doc["protocol"]["restart_cost_s"]
    out = []
    for name in doc["methods"]:
        ov = modes.get(name)
        if ov is None:
            continue
        kill_src = name if name in doc["protocol"].get("kill_methods", [name]) else ov.get("derived_from", name)
        rows = [r for r in kills if r["method"] == kill_src]
        lowdiff = name.startswith("lowdiff-")
        k = None if lowdiff else int(name.rsplit("-k", 1)[1])
        lost = [r["lost_steps"] for r in rows] if kill_src == name else []
        if lowdiff:
            exp_lost = statistics.mean(lost) if lost else None
        else:
            lags = [r["lost_steps"] - (r["kill_after"] - S0) % r["period"] for r in rows]
            exp_lost = (k - 1) / 2 + statistics.mean(lags) if lags else None  # type: ignore[operator]
        restart = statistics.mean(r["restart_to_first_step_s"] for r in rows) if rows else None
        vs_plain = ov.get("ratio_vs_plain") or ov["ratio"]
        step_s = plain_s * vs_plain
        s: dict[str, Any] = {
            "method": name, "k": k, "ratio": ov["ratio"], "reference": ov.get("reference", "plain"),
            "ratio_vs_plain": vs_plain, "ratio_cpu": ov.get("ratio_cpu"), "statistic": ov.get("statistic"),
            "round_range": [min(ov["round_ratios"]), max(ov["round_ratios"])] if ov.get("round_ratios") else None,
            "derived": "derived_from" in ov, "bytes_per_step": ov.get("bytes_per_step"),
            "kills": len(rows) if kill_src == name else 0, "kills_from": None if kill_src == name else kill_src,
            "lost_measured": lost, "expected_lost": exp_lost, "restart_s": restart,
            "replayed": [r["recovered"] % doc["protocol"]["snapshot_every_steps"] for r in rows] if lowdiff else None,
            "peak_rss_bytes": max((r["peak_rss_trainer_bytes"] + r["peak_rss_helpers_bytes"] for r in rows),
                                  default=None),
            "helpers_killed": sum(r["helpers_killed"] for r in rows), "step_s": step_s}
        if exp_lost is not None and restart is not None:
            cost = r_cost + restart + (exp_lost + 0.5) * step_s
            s["failure_cost_s"] = cost
            s["goodput"] = {h: goodput(ov["ratio"], cost, h * 3600.0) for h in MTBF_H}
            s["goodput_vs_plain"] = {h: goodput(vs_plain, cost, h * 3600.0) for h in MTBF_H}
        out.append(s)
    return out


def _pct(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.1f} %" if signed else f"{100 * x:.1f} %"


def _best(rows: list[dict[str, Any]], key: str, h: int) -> str:
    """The highest, and the others within 0.5 points of it (a tie at this machine's noise)."""
    have = sorted((r for r in rows if r.get(key)), key=lambda r: -r[key][h])
    if not have:
        return "-"
    top = have[0][key][h]
    ties = [f"{r['method']} {100 * r[key][h]:.1f} %" for r in have[1:] if top - r[key][h] < 0.005]
    return f"{have[0]['method']} {100 * top:.1f} %" + (f" (within 0.5 points: {', '.join(ties)})" if ties else "")


def write_markdown(path: Path, doc: dict[str, Any]) -> None:
    m, p = doc["machine"], doc["protocol"]
    rows = summarize(doc)
    plain = doc["modes"]["plain"]["median_step_s"]
    off = {c: doc["modes"].get(f"lowdiff-{c}-off", {}).get("ratio") for c in ("topk", "powersgd", "none")}
    lines = [
        "# lowdiff against DCP async_save, CheckFreq-style and torch.save, in goodput",
        "",
        f"Generated by `{doc['command']}` on {m['date']}, git {m['git_commit'][:10]}"
        f"{' (lowdiff modified)' if m['lowdiff_dirty'] else ''}; {m['cpu_count']} CPUs shared with other jobs, load "
        f"average {m['loadavg_start'][0]:.1f} at start and {doc['loadavg_end'][0]:.1f} at the end; torch "
        f"{m['torch']}, 1 torch thread; runtime {doc['runtime_s']:.0f} s. Model: GPT "
        f"{doc['model']['params'] / 1e6:.1f}M parameters, batch {doc['model']['batch']} x {doc['model']['block']} "
        f"tokens, AdamW(lr=3e-4), clip_grad_norm 1.0, {_where(doc)}. Plain training: {plain:.3f} s per step (median).",
        "",
        "Methods: DCP `async_save` in thread mode (`dcp-thread`) and in process mode with `DefaultStager` "
        "(`dcp-process`, a one-rank gloo group, staging into shared memory while the next forward/backward runs), a "
        "new directory per save, one save in flight; CheckFreq-style snapshot into reused host buffers then "
        "torch.save + fsync in a thread (`checkfreq`); `torch.save` + fsync on the training thread (`torchsave`); "
        f"every k steps. lowdiff logs every step (`log.persistence` thread or process), a full snapshot every "
        f"{p['snapshot_every_steps']} steps (fixed: the tuner, `snapshot.every_steps: auto`, needs ~130 steps of "
        "profiling before its first decision and ~270 before its interval is in force, longer than this benchmark "
        "affords per mode; on this machine it chose 47-133 steps at MTBF 1 h, [overhead-auto](overhead-auto.md)), "
        "Top-k 1 % and PowerSGD rank 4 with 2 steps per segment, none with 1.",
        "",
        f"Overhead: {p['rounds']} rounds of interleaved windows ({p['window']} steps for plain and the interval "
        f"methods, {p['lowdiff_window']} for lowdiff; bench/alternatives.py's docstring). Reference: plain, and for "
        "lowdiff the same compressor with `enabled: false` (it compresses and decodes identically and writes "
        "nothing); that reference's own cost over plain: "
        + ", ".join(f"{c} {_pct(r - 1 if r else None)}" for c, r in off.items())
        + (f". k = {', '.join(map(str, p['derived_ks']))} is not timed but derived from the rounds of the largest "
           "timed k (with and without a save), weighted by how often a save comes" if p["derived_ks"] else
           ". Every k is timed (with a window shorter than k, the rounds that hold a save are weighted by how often "
           "a save comes)")
        + f". Steps lost and restart: {_kill_counts(doc)} at random moments, each followed by a fresh process "
        "that resumes and trains one step (bench/alternatives_kill.py)"
        + ("; the methods at a derived k are not killed: they take the lag (steps lost beyond the kill's phase), "
           "restart time and peak RSS measured at the k they are derived from" if p["derived_ks"] else "")
        + ". An interval method killed at k = 100 is killed within its first 25 steps after a save (the lag beyond "
        "the kill's phase is what is measured; the phase, uniform over the interval, is added as (k - 1) / 2). So "
        "few kills make the per-method figures indicative, not distributions (the time budget of a shared 2-core "
        "machine: every kill costs two fresh interpreters importing torch). Peak "
        "RSS: VmHWM of the trainer plus its helper processes (lowdiff's persistence process, DCP's upload process) "
        "read just before the kill, the largest over the kills (pages shared between them count twice).",
        "",
        f"Goodput (alternatives_report.py's docstring): goodput = (1 - o) x (1 - C / MTBF), o = 1 - 1 / ratio, "
        f"C = R + restart + (lost + 1/2) x T, R = {p['restart_cost_s']:.0f} s (stated), restart and lost measured, "
        "T the method's step time; the tuner's waste model (overhead + lambda x failure cost x (1 - overhead)). "
        "'vs own ref' takes the ratio over the method's reference; 'vs plain' charges lowdiff's compressor too "
        "(it only matters where the compressor would not be used anyway). A ratio below 1 (marked *) is the "
        "machine's noise, since checkpointing only adds work: goodput counts it as no overhead. 'rounds (min-max)' "
        "is the spread of the per-round ratios: at this load, differences within it are noise.",
        "",
        "| method | k | step time vs ref | rounds (min-max) | ref | vs plain | bytes/step | peak RSS | kills "
        "| steps lost (each kill) "
        "| expected lost | restart to 1st step | goodput 1 h | 6 h | 24 h | vs plain 1 h | 6 h | 24 h |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g, gp = r.get("goodput", {}), r.get("goodput_vs_plain", {})
        k = f"{r['k']}" + (" (derived)" if r["derived"] else "") if r["k"] else f"1 (F={p['snapshot_every_steps']})"
        rr = r["round_range"]
        lines.append(
            f"| {r['method']} | {k} | {r['ratio']:.3f}{'*' if r['ratio'] < 1 else ''} | "
            + (f"{rr[0]:.2f}-{rr[1]:.2f}" if rr else "-") + f" | {r['reference']} | "
            f"{r['ratio_vs_plain']:.3f}{'*' if r['ratio_vs_plain'] < 1 else ''} | "
            f"{mb(r['bytes_per_step'] or 0):.2f} MB | "
            + (f"{mb(r['peak_rss_bytes']):.0f} MB | " if r["peak_rss_bytes"] else "- | "))
        lines[-1] += (
            (f"{r['kills']} | " if not r["kills_from"] else f"lag, restart, RSS of {r['kills_from']} | ")
            + f"{', '.join(map(str, r['lost_measured'])) or '-'} | "
            + (f"{r['expected_lost']:.1f}" if r["expected_lost"] is not None else "-") + " | "
            + (f"{r['restart_s']:.1f} s" if r["restart_s"] is not None else "-") + " | "
            + " | ".join(_pct(g.get(h), False) for h in MTBF_H) + " | "
            + " | ".join(_pct(gp.get(h), False) for h in MTBF_H) + " |")
    lines += ["", "Highest goodput:", ""] + [
        f"- MTBF {h} h, vs own ref: {_best(rows, 'goodput', h)}; vs plain: {_best(rows, 'goodput_vs_plain', h)}"
        for h in MTBF_H] + [""]
    ld = [r for r in rows if r["method"].startswith("lowdiff-") and r["replayed"]]
    if ld:
        lines += ["lowdiff's restart replays the steps since the newest snapshot: "
                  + "; ".join(f"{r['method']} {', '.join(map(str, r['replayed']))}" for r in ld)
                  + " steps at its kills (a uniform moment of a whole interval replays "
                  f"{p['snapshot_every_steps'] / 2:.0f} on average).", ""]
    hk = [r for r in rows if r["helpers_killed"]]
    if hk:
        lines += ["Helpers still alive 30 s after the kill and then killed: "
                  + ", ".join(f"{r['method']} ({r['helpers_killed']})" for r in hk) + ".", ""]
    lines += targets_section(rows, doc.get("recovery"))
    lines += recovery_section(doc.get("recovery"))
    lines += ["Statistics per timed method: " + "; ".join(
        f"{n}: {doc['modes'][n].get('statistic')}" for n in doc["methods"] if n in doc["modes"]) + ".", ""]
    path.write_text("\n".join(lines))


def targets_section(rows: list[dict[str, Any]], rec: dict[str, Any] | None) -> list[str]:
    """Issue 36's numbers to reach, each against its measured figure."""
    by = {r["method"]: r for r in rows}
    out = ["## Issue 36's targets", ""]
    t, n, d = by.get("lowdiff-topk-process"), by.get("lowdiff-none-process"), by.get("dcp-process-k10")
    if t:
        out.append(f"- lowdiff Top-k, process persistence, <= 1.03 over its reference: {t['ratio']:.3f} "
                   f"({'met' if t['ratio'] <= 1.03 else 'not met'}; per-round spread {t['round_range'][0]:.2f}-"
                   f"{t['round_range'][1]:.2f}).")
    if n and d:
        out.append(f"- lowdiff none, process persistence, no more than DCP async_save process mode every 10 steps: "
                   f"{n['ratio']:.3f} over `enabled: false` ({n['ratio_vs_plain']:.3f} over plain) against "
                   f"{d['ratio']:.3f} over plain ({'met' if n['ratio'] <= d['ratio'] else 'not met'} over the "
                   f"references; {'met' if n['ratio_vs_plain'] <= d['ratio'] else 'not met'} over plain; spreads "
                   f"{n['round_range'][0]:.2f}-{n['round_range'][1]:.2f} and {d['round_range'][0]:.2f}-"
                   f"{d['round_range'][1]:.2f}: within noise either way).")
    for h in (1, 6):
        for key, what in (("goodput", "own ref"), ("goodput_vs_plain", "plain")):
            have = sorted((r for r in rows if r.get(key)), key=lambda r: -r[key][h])
            if not have:
                continue
            best = have[0]
            ld = max((r for r in have if r["method"].startswith("lowdiff-")), key=lambda r: r[key][h])
            gap = 100 * (best[key][h] - ld[key][h])
            ties = [f"{r['method']} {100 * r[key][h]:.2f} %" for r in have
                    if not r["method"].startswith("lowdiff-") and ld[key][h] - r[key][h] < 0.005]
            verdict = (f"met by {ld['method']} {100 * ld[key][h]:.2f} %" if best is ld else
                       f"not met: {best['method']} {100 * best[key][h]:.1f} % against {ld['method']} "
                       f"{100 * ld[key][h]:.1f} % ({gap:.1f} points)")
            if best is ld and ties:
                verdict += f", but within 0.5 points (a tie at this noise) of {', '.join(ties)}"
            out.append(f"- lowdiff's goodput the highest at MTBF {h} h (overhead over {what}): {verdict}.")
    if rec:
        r40 = next((r for r in rec["rows"] if r["steps"] == 40), None)
        if r40:
            x = r40["recompute_s"] / r40["replay_w1_s"]
            out.append(f"- Replay of 40 steps >= 5x faster than recomputing: {x:.1f}x "
                       f"({'met' if x >= 5 else 'not met'}).")
        for r in rec["rows"]:
            x = r["replay_w1_s"] / r["replay_w2_s"]
            out.append(f"- 2 workers >= 1.6x one at {r['steps']} steps: {x:.2f}x "
                       + ("(met)." if x >= 1.6 else f"(not met, {1.6 / x:.2f}x short: {_why_short(r)})."))
    return out + [""]


def _where(doc: dict[str, Any]) -> str:
    """The device the run trained on, by name ("CPU" before --device existed)."""
    dev = doc["machine"].get("device") or {}
    if doc["protocol"].get("device", "cpu") == "cpu":
        return "CPU"
    return f"{dev.get('name', 'GPU')} (cuda)"


def _why_short(r: dict[str, Any]) -> str:
    """Why two replay workers gained less than hoped, from the run's own figures."""
    w1, w2, contention = r["replay_w1_s"], r["replay_w2_s"], r["replay_w1_s"] / r["replay_w1_cpu_s"]
    if contention >= 1.5:
        return (f"the replay's wall time was {contention:.1f}x its CPU time with 1 worker, so other jobs held the "
                "cores and a second worker had none free to run on")
    return (f"the replay had its core (wall {contention:.1f}x its CPU time with 1 worker); {w2:.2f} - {w1:.2f} / 2 "
            f"= {w2 - w1 / 2:.2f} s of the 2-worker replay did not shrink with the second worker (forking it, moving "
            "the state into shared memory, the snapshot's load), a share that falls as the log grows")


def _kill_counts(doc: dict[str, Any]) -> str:
    """How many SIGKILLs each method had, from the kill rows themselves."""
    from collections import Counter

    per = Counter(r["method"] for r in doc["kills"])
    if not per:
        return "no SIGKILL"
    common = Counter(per.values()).most_common(1)[0][0]
    others = sorted(f"{n} for {m}" for m, n in per.items() if n != common)
    return f"{common} SIGKILL(s) per method" + (f" ({', '.join(others)})" if others else "")


def recovery_section(rec: dict[str, Any] | None) -> list[str]:
    """The issue's restart targets (replay of 40 steps >= 5x faster than recomputing; 2 workers >= 1.6x one at 40
    and 200 steps) from a bench/recovery.py run."""
    if not rec:
        return []
    lines = [
        "## Restart targets (bench/recovery.py)", "",
        f"`{rec['command']}` on {rec['date']}, git {rec['git'][:10]}, load {rec['load'][0]:.1f} at start and "
        f"{rec['load'][1]:.1f} at the end; Top-k 1 %, one snapshot at step 0, segments of 10 steps; medians of the "
        f"repetitions; bit-exact checks: {sum(rec['exact'].values())}/{len(rec['exact'])} pass. Targets (issue 36): "
        "replay of 40 steps >= 5x faster than recomputing them; 2 workers >= 1.6x faster than 1 at 40 and 200 "
        "steps.", "",
        "| log steps | replay, 1 worker | 2 workers | recompute | recompute / replay | 2 vs 1 worker (wall) "
        "| CPU s, 1 / 2 workers | wall / CPU, 1 worker |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        w1, w2 = r["replay_w1_s"], r["replay_w2_s"]
        lines.append(f"| {r['steps']} | {w1:.2f} s | {w2:.2f} s | {r['recompute_s']:.1f} s"
                     f"{'' if r['recompute_measured'] else ' (extrapolated)'} | {r['recompute_s'] / w1:.1f}x | "
                     f"{w1 / w2:.2f}x | {r['replay_w1_cpu_s']:.2f} / {r['replay_w2_cpu_s']:.2f} | "
                     f"{w1 / r['replay_w1_cpu_s']:.1f} |")
    lines += ["", "Every repetition (wall s, CPU s, load average): " + "; ".join(
        f"{k}: " + ", ".join(f"{w:.1f}/{c:.1f}/{la:.1f}" for w, c, la in v) for k, v in rec["reps"].items())
        + ".", ""]
    return lines


def plot(path: Path, doc: dict[str, Any]) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    rows = [r for r in summarize(doc) if "failure_cost_s" in r]
    hours = [0.5 * 1.15 ** i for i in range(40)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for ax, key, title in ((axes[0], "ratio", "ratio over own reference"), (axes[1], "ratio_vs_plain",
                                                                            "ratio over plain training")):
        cmap = plt.get_cmap("tab20")
        for i, r in enumerate(rows):
            ys = [100 * goodput(r[key], r["failure_cost_s"], h * 3600) for h in hours]
            style = "-" if r["method"].startswith("lowdiff-") else ("--" if "dcp" in r["method"] else ":")
            ax.plot(hours, ys, style, label=r["method"], lw=1.6, color=cmap(i % 20))
        for h in MTBF_H:
            ax.axvline(h, color="grey", lw=0.5)
        ax.set_xscale("log")
        ax.set_xlabel("MTBF (hours)")
        ax.set_title(f"goodput, {title}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput (% of wall time)")
    lo = min((100 * goodput(r[key], r["failure_cost_s"], hours[0] * 3600) for r in rows
              for key in ("ratio", "ratio_vs_plain")), default=80.0)
    axes[0].set_ylim(max(0.0, lo - 2), 100.5)
    axes[1].legend(fontsize=7, loc="lower right", ncol=2)
    fig.suptitle(f"Goodput by MTBF, restart cost {doc['protocol']['restart_cost_s']:.0f} s + measured restart and "
                 f"lost steps ({_where(doc)} GPT 10.8M, {doc['machine']['cpu_count']} CPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
