"""lowdiff against what users would pick instead -- DCP async_save (thread and process mode), CheckFreq-style
snapshot-then-persist, torch.save + fsync -- side by side in one run, in goodput.

    python bench/alternatives.py            # the real run (~25-30 min on the shared 2-core box); bench/results, docs/
    python bench/alternatives.py --smoke --out-dir /tmp/x   # < 60 s; what tests/bench runs
    python bench/alternatives.py --device cuda   # on a GPU: model, optimizer state and batches there;
                                                 # bench/results/alternatives-cuda.json, docs/.../alternatives-cuda.md

Phase 1, overhead (one process, one model, one AdamW; bench/overhead_protocol.py's rounds): windows of plain
training and of every interval method (k in --ks) alternate, P X1 P X2 ... P; per compressor C, lowdiff runs
C-off C-thread C-off C-process C-off (C-off = ``enabled: false``, the same compressor: the reference of both).
Ratio = window mean step time / its neighbouring reference windows, median over rounds, stratified by rounds with
and without a checkpoint event. Intervals in --derive-ks (100) are not timed: their ratio is derived from the
event and no-event rounds of the largest timed k of the same method, (1 - W/k) x median(without) + (W/k) x
median(with), the same statistic the protocol uses for a timed k larger than the window.
Phase 2, kills (alternatives_kill.py): per method, a trainer in a fresh process killed with SIGKILL at random
moments; the steps lost, the time from restart to the first resumed step, the peak RSS.
Phase 3, goodput (alternatives_report.py): the page and the plot.
One torch thread everywhere. Public lowdiff API only (lowdiff.wrap, opt.stats, opt.flush, opt.resume).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    FULL_MODEL,
    SMOKE_MODEL,
    device_info,
    machine_info,
    median,
    output_paths,
    to_device,
    write_json,
)
from alternatives_kill import DEVICE_ENV  # noqa: E402

HEADLINE = ("lowdiff-topk-process", "lowdiff-none-process", "dcp-process-k10")
SMOKE_KILLS = ("lowdiff-topk-process", "torchsave-k4")


def overhead_phase(args: argparse.Namespace, ks: list[int], every: int, work: Path) -> dict[str, Any]:
    import torch
    from alternatives_methods import AltLowDiffMode, build_modes, ensure_process_group, sequence
    from overhead_modes import Ctx, IntervalMode, Settings, train_step
    from overhead_protocol import run

    ensure_process_group()
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    device = torch.device(args.device)
    model = spec.build().to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = to_device(spec.batches(8), device)
    settings = Settings(device=device, quick=args.smoke)
    ctx = Ctx(model, inner, work, settings)
    modes = build_modes(ks, every, args.window, args.lowdiff_window)
    for m in modes:
        if isinstance(m, AltLowDiffMode):
            m.warmup = args.lowdiff_warmup
    train_step(settings, model, inner, batches[0])
    t0 = time.perf_counter()
    results = run(modes, ctx, batches, args.rounds, False, t0, sequence=sequence)
    for m in modes:
        r = results[m.name]
        r.pop("windows", None)
        if isinstance(m, AltLowDiffMode) and m.enabled:
            r["bytes_per_step"] = m.per_step_bytes()
        elif isinstance(m, IntervalMode):
            r["bytes_per_step"] = r["bytes_per_save"] / m.interval
        m.close()
    nparams = sum(p.numel() for p in model.parameters())
    return {"modes": results, "params": nparams, "runtime_s": time.perf_counter() - t0}


def derive(results: dict[str, Any], ks: list[int], derive_ks: list[int], window: int) -> None:
    """Ratios for the untimed intervals, from the rounds of the largest timed k of the same method."""
    from alternatives_methods import FAMILIES

    src_k = max(k for k in ks if k > window) if any(k > window for k in ks) else None
    for k in derive_ks:
        for fam in FAMILIES:
            src = results.get(f"{fam}-k{src_k}") if src_k else None
            if src is None:
                continue
            w = window / k
            out: dict[str, Any] = {"family": fam, "k": k, "reference": "plain", "derived_from": f"{fam}-k{src_k}",
                                   "statistic": f"derived: {1 - w:.2f} x median of {fam}-k{src_k}'s rounds without "
                                                f"+ {w:.2f} x median of its rounds with a save"}
            for key, rk in (("ratio", "round_ratios"), ("ratio_cpu", "round_ratios_cpu")):
                rr = src[rk]
                ev = src["round_events"]
                with_ev = [r for r, e in zip(rr, ev) if e]
                without = [r for r, e in zip(rr, ev) if not e]
                out[key] = (1 - w) * median(without) + w * median(with_ev) if with_ev and without else None
            out["ratio_vs_plain"] = out["ratio"]
            out["bytes_per_step"] = src["bytes_per_save"] / k
            out["bytes_per_save"] = src["bytes_per_save"]
            results[f"{fam}-k{k}"] = out


def kill_phase(args: argparse.Namespace, methods: list[str], every: int, work: Path) -> list[dict[str, Any]]:
    from alternatives_kill import one_trial

    rng = random.Random(args.seed)
    size = "smoke" if args.smoke else "small"
    rows: list[dict[str, Any]] = []
    plan = [(name, i) for i in range(max(args.kills, args.headline_kills)) for name in methods
            if i < args.kills or name in HEADLINE]
    for name, i in plan:
        period = every if name.startswith("lowdiff-") else int(name.rsplit("-k", 1)[1])
        r = one_trial(Path(__file__), name, work / f"{name}-{i}", size, every, min(period, args.kill_span), rng)
        r["period"] = period
        rows.append(r)
        shutil.rmtree(work / f"{name}-{i}", ignore_errors=True)
        print(f"  kill {name} #{i}: returned {r['returned']}, recovered {r['recovered']}, restart "
              f"{r['restart_to_first_step_s']:.1f} s", flush=True)
    return rows


def recovery_figures(path: Path) -> dict[str, Any]:
    """What the page reports of a bench/recovery.py run: its command, machine, rows and every repetition."""
    d = json.loads(path.read_text())
    keep = ("steps", "replay_w1_s", "replay_w1_cpu_s", "replay_w2_s", "replay_w2_cpu_s", "recompute_s",
            "recompute_measured", "mode_w2", "workers_used_w2")
    reps = {k: [(r["wall_s"], r["cpu_s"], r["loadavg"]) for r in v] for k, v in d["raw"]["replay"].items()}
    return {"command": d["command"], "date": d["machine"]["date"], "git": d["machine"]["git_commit"],
            "load": [d["machine"]["loadavg_start"][0], d["loadavg_end"][0]], "exact": d["exact"],
            "rows": [{k: r.get(k) for k in keep} for r in d["rows"]], "reps": reps,
            "median_train_step_s": d["training"]["median_step_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model, optimizer state and batches live (cuda: write alternatives-cuda.*)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds, 2 kills: ~40 s on a quiet machine")
    ap.add_argument("--out-dir", help="write alternatives.json/.md/.png here instead of bench/results and docs/")
    ap.add_argument("--work-dir", default=None, help="where checkpoints are written (default: system tmp)")
    ap.add_argument("--rounds", type=int, help="overhead rounds (default 4)")
    ap.add_argument("--window", type=int, default=5, help="steps per window of plain and the interval methods")
    ap.add_argument("--lowdiff-window", type=int, default=10, help="steps per lowdiff window")
    ap.add_argument("--lowdiff-warmup", type=int, help="untimed steps per lowdiff mode (default 19: the step-50 "
                                                       "snapshot falls in the 4th round)")
    ap.add_argument("--snapshot-every", type=int, help="lowdiff snapshot.every_steps (default 50)")
    ap.add_argument("--ks", default="1,10", help="timed checkpoint intervals of the other methods")
    ap.add_argument("--derive-ks", default="100", help="intervals derived from the largest timed one")
    ap.add_argument("--kills", type=int, help="kills per method (default 1)")
    ap.add_argument("--headline-kills", type=int, default=2, help=f"kills for {', '.join(HEADLINE)}")
    ap.add_argument("--kill-span", type=int, default=25,
                    help="the kill falls in the first min(P, this) steps after a save (P: its interval)")
    ap.add_argument("--restart-cost", type=float, default=60.0,
                    help="seconds from a failure to the relaunched process (scheduler, allocation), for goodput")
    ap.add_argument("--seed", type=int, default=36)
    ap.add_argument("--kill-methods", help="comma-separated methods to kill (default: all; --smoke: "
                                           f"{','.join(SMOKE_KILLS)})")
    ap.add_argument("--kill-ks", default="1,10",
                    help="intervals whose methods are killed; the others take the lag, restart time and peak RSS "
                         "measured at the interval their overhead is derived from")
    ap.add_argument("--skip-kills", action="store_true")
    ap.add_argument("--render-only", action="store_true", help="re-render .md and .png from alternatives.json")
    ap.add_argument("--recovery-json", help="a bench/recovery.py result (e.g. --lengths 40,200 --workers 1,2) whose "
                                            "replay figures the page reports against the issue's restart targets")
    ap.add_argument("--trainer", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--resume", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer or args.resume:
        from alternatives_kill import resume_probe, trainer

        name, w, size, every_s = args.trainer or args.resume
        (trainer if args.trainer else resume_probe)(name, w, size, int(every_s))
        return
    from alternatives_report import plot, write_markdown

    json_path, md_path, png_path = output_paths(args.out_dir, "alternatives" if args.device == "cpu"
                                                else f"alternatives-{args.device}")
    if args.render_only:
        doc = json.loads(json_path.read_text())
        if args.recovery_json:
            doc["recovery"] = recovery_figures(Path(args.recovery_json))
            write_json(json_path, doc)
        write_markdown(md_path, doc)
        plot(png_path, doc)
        return
    import torch

    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    os.environ[DEVICE_ENV] = args.device  # the kill trials' trainers and resumes train there
    if args.smoke:
        args.rounds = args.rounds or 2
        args.window, args.lowdiff_window = 2, 2
        args.kills = args.kills if args.kills is not None else 1
        args.headline_kills = 0
        args.kill_span = 4
    ks = [int(k) for k in args.ks.split(",")] if not args.smoke else [4]
    derive_ks = [int(k) for k in args.derive_ks.split(",") if k] if not args.smoke else [8]
    every = args.snapshot_every or (4 if args.smoke else 50)
    args.rounds = args.rounds or 4
    args.kills = 1 if args.kills is None else args.kills
    if args.lowdiff_warmup is None:
        args.lowdiff_warmup = 1 if args.smoke else 19
    t_start = time.perf_counter()
    info = machine_info() | {"device": device_info(args.device)}
    work = Path(tempfile.mkdtemp(prefix="lowdiff-alternatives-", dir=args.work_dir))
    print(f"alternatives: {args.rounds} rounds, ks {ks} (+ derived {derive_ks}), snapshot every {every}, work dir "
          f"{work}", flush=True)
    try:
        ov = overhead_phase(args, ks, every, work / "overhead")
        derive(ov["modes"], ks, derive_ks, args.window)
        from alternatives_methods import method_names

        methods = method_names(ks + derive_ks)
        print(f"  overhead done at {time.perf_counter() - t_start:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
        kill_ks = [int(k) for k in args.kill_ks.split(",")] if not args.smoke else ks
        chosen = args.kill_methods.split(",") if args.kill_methods else (
            list(SMOKE_KILLS) if args.smoke else
            [m for m in methods if m.startswith("lowdiff-") or int(m.rsplit("-k", 1)[1]) in kill_ks])
        kills = [] if args.skip_kills else kill_phase(args, [m for m in methods if m in chosen], every,
                                                      work / "kills")
        doc = {"benchmark": "alternatives", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
               "machine": info, "model": {**(SMOKE_MODEL if args.smoke else FULL_MODEL).as_dict(),
                                          "params": ov["params"], "size": "smoke" if args.smoke else "small"},
               "protocol": {"rounds": args.rounds, "window": args.window, "lowdiff_window": args.lowdiff_window,
                            "lowdiff_warmup": args.lowdiff_warmup, "ks": ks, "derived_ks": derive_ks,
                            "snapshot_every_steps": every, "kills": args.kills,
                            "headline_kills": max(args.kills, args.headline_kills), "headline": list(HEADLINE),
                            "kill_span": args.kill_span, "kill_methods": chosen,
                            "restart_cost_s": args.restart_cost, "seed": args.seed, "torch_threads": 1,
                            "device": args.device},
               "methods": methods, "modes": ov["modes"], "kills": kills, "overhead_runtime_s": ov["runtime_s"],
               "runtime_s": time.perf_counter() - t_start, "loadavg_end": os.getloadavg()}
        if args.recovery_json:
            doc["recovery"] = recovery_figures(Path(args.recovery_json))
        write_json(json_path, doc)
        write_markdown(md_path, doc)
        plot(png_path, doc)
        print(f"alternatives: done in {doc['runtime_s']:.0f} s -> {json_path}, {md_path}, {png_path}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
