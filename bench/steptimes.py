"""Does any training step wait for a full snapshot? Per-step time distribution with frequent snapshots.

For each mode the same GPT trains for ``--steps`` steps with a full snapshot every ``--every`` steps; every step
is timed on its own (on a GPU, until the training stream has finished it). Reported per mode: median, 95th
percentile and max step time, max / median, and the median of the snapshot steps alone over the median of the
others. Issue #8's bar: with ``snapshot.shadow: true`` no step waits for a snapshot (max within 1.2x the
median). Modes run in rounds of ``--round`` steps, round-robin, so machine drift hits them alike.

    python bench/steptimes.py --out-name steptimes-2core   # CPU, 10.8M GPT: docs/measurements/steptimes-2core.md
    python bench/steptimes.py --device cuda --model 50m    # docs/measurements/steptimes-cuda.md
    python bench/steptimes.py --smoke                      # seconds; run by tests/bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import lowdiff  # noqa: E402
from bench._common import FULL_MODEL, SMOKE_MODEL, ModelSpec, machine_info, output_paths, pyplot  # noqa: E402

MODEL_50M = ModelSpec(n_layer=8, d_model=704, n_head=8, batch=16, block=256)
MODES = {
    # name: (compressor, enabled, shadow)
    "off": ("none", False, False),
    "none": ("none", True, False),
    "none-shadow": ("none", True, True),
    "topk": ("topk", True, False),
}


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="small", choices=["small", "50m"])
    ap.add_argument("--steps", type=int, help="timed steps per mode (default 60)")
    ap.add_argument("--round", type=int, default=10, help="steps per mode per round")
    ap.add_argument("--every", type=int, help="snapshot.every_steps (default 10)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir")
    ap.add_argument("--out-name", help="output base name (default steptimes, or steptimes-cuda on --device cuda; the "
                                       "current CPU page is steptimes-2core)")
    ap.add_argument("--work-dir", help="where run directories are written (default: system tmp); removed after")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SMOKE_MODEL if args.smoke else (MODEL_50M if args.model == "50m" else FULL_MODEL)
    steps = args.steps or (6 if args.smoke else 60)
    every = args.every or (3 if args.smoke else 10)
    rnd = min(args.round, steps)
    modes = [m for m in args.modes.split(",") if m]
    if args.device == "cuda":
        modes = [m for m in modes if not MODES[m][2]]  # the shadow replica is CPU-only
    dev = torch.device(args.device)
    batches = [(x.to(dev), y.to(dev)) for x, y in spec.batches(4)]
    work = Path(tempfile.mkdtemp(prefix="lowdiff-steptimes-", dir=args.work_dir))
    runs: dict[str, Any] = {}
    for m in modes:
        comp, enabled, shadow = MODES[m]
        model = spec.build().to(dev)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        cfg = {"run_dir": str(work / m), "enabled": enabled, "compressor": {"name": comp},
               "snapshot": {"every_steps": every, "shadow": shadow}, "log": {"batch_steps": 1 if comp == "none" else 5}}
        runs[m] = (model, lowdiff.wrap(inner, model, cfg), [], [])
    # The training stream only: a step is over when its kernels are; lowdiff's side-stream copies to host memory
    # run on, as they do in training (torch.cuda.synchronize() would wait for them too).
    sync = (lambda: torch.cuda.current_stream().synchronize()) if dev.type == "cuda" else (lambda: None)

    def one(m: str, i: int) -> None:
        model, opt, times, snap = runs[m]
        x, y = batches[i % len(batches)]
        sync()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        snap.append(opt.step_count % every == 0)

    for m in modes:  # warm-up, not timed: allocator, first snapshot buffers
        for i in range(2):
            one(m, i)
        runs[m][2].clear()
        runs[m][3].clear()
    done = 0
    while done < steps:
        n = min(rnd, steps - done)
        for m in modes:
            for i in range(n):
                one(m, done + i)
        done += n
    results = {}
    for m in modes:
        model, opt, times, snap = runs[m]
        opt.close()
    shutil.rmtree(work, ignore_errors=True)
    for m in modes:
        model, opt, times, snap = runs[m]
        med = statistics.median(times)
        at_snap = [t for t, s in zip(times, snap) if s]
        other = [t for t, s in zip(times, snap) if not s]
        results[m] = {
            "median_ms": med * 1e3, "p95_ms": _percentile(times, 0.95) * 1e3, "max_ms": max(times) * 1e3,
            "max_over_median": max(times) / med,
            "snapshot_steps_over_others": (statistics.median(at_snap) / statistics.median(other)
                                           if at_snap and other else None),
            "snapshots": len(at_snap), "times_ms": [t * 1e3 for t in times],
        }
    info = machine_info() | {"loadavg_end": list(__import__("os").getloadavg()), "device": args.device,
                             "model": spec.as_dict(), "steps": steps, "every": every}
    name = args.out_name or "steptimes" + ("-cuda" if args.device == "cuda" else "")
    jpath, mpath, ppath = output_paths(args.out_dir, name)
    jpath.write_text(json.dumps({"info": info, "results": results}, indent=1))
    lines = [f"# Step-time distribution with a snapshot every {every} steps ({args.device})", "",
             f"Generated by `python bench/steptimes.py{' --device cuda' if args.device == 'cuda' else ''}"
             f"{' --model 50m' if args.model == '50m' else ''}{f' --out-name {name}' if args.out_name else ''}` on "
             f"{info['date']} (git {info['git_commit'][:10]}); "
             f"{info['cpu_count']} CPUs, torch {info['torch']}, {args.threads} torch thread(s); load average at "
             f"start {info['loadavg_start'][0]:.1f}, at end {info['loadavg_end'][0]:.1f}. Model: GPT "
             f"{spec.n_layer} layers, d_model {spec.d_model}, batch {spec.batch} x {spec.block} tokens, AdamW. "
             f"{steps} timed steps per mode in rounds of {rnd}, round-robin.", "",
             "| mode | median | p95 | max | max / median | snapshot steps / others | snapshots |",
             "|---|---|---|---|---|---|---|"]
    for m, r in results.items():
        ratio = r["snapshot_steps_over_others"]
        lines.append(f"| {m} | {r['median_ms']:.1f} ms | {r['p95_ms']:.1f} ms | {r['max_ms']:.1f} ms | "
                     f"{r['max_over_median']:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} | {r['snapshots']} |")
    lines += ["", "Modes: `off` = `enabled: false`; `none` = compressor none, snapshots copied off the live state "
              "(on a GPU by a side stream; on the CPU on the training thread, or beside the next forward and backward "
              "passes with snapshot.background_copy, the default from git 5045b57 to afd9c76) and persisted in the "
              "background; `none-shadow` = `snapshot.shadow: true` (the "
              "writer's CPU replica provides them); `topk` = Top-k 1 %."]
    lines += ["", f"![per-step times]({ppath.name})"]
    mpath.write_text("\n".join(lines) + "\n")
    _plot(results, ppath, every)
    print("\n".join(lines))


def _plot(results: dict[str, Any], path: Path, every: int) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(8, 4))
    for m, r in results.items():
        ax.plot(r["times_ms"], label=m, linewidth=1)
    ax.set_xlabel(f"timed step (a snapshot every {every} steps)")
    ax.set_ylabel("step time (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
