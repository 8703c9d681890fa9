"""How long a Python-bound training thread waits for the GIL because of lowdiff's writer thread (issue 35).

The training thread of a fast step releases the GIL inside every torch call and takes it back after; a writer
thread in the same process that holds the GIL meanwhile makes it wait. The kernel tells the wait apart from work:
``/proc/thread-self/schedstat`` gives the thread's time on a CPU and its time runnable but waiting for one; the
rest of the wall time it slept, and a training thread that does no I/O sleeps only waiting for a lock, the GIL
above all. Three twins of bench/faststep.py's MLP (41 blocks of width 512, 10.8M parameters, batch 16, AdamW, one
torch thread) train side by side: ``off`` (``enabled: false``), ``thread`` and ``process`` (``log.persistence``),
for each compressor; each round runs a window of every twin in turn (order rotating), a window ends with
``opt.flush()`` (outside the timing), and the medians over rounds are reported per step.

    python bench/studies/gilwait.py                 # ~6 min on 2 cores; JSON in --out
    python bench/studies/gilwait.py --smoke --out /tmp/g.json

Linux only (schedstat).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import lowdiff

REPO = Path(__file__).resolve().parents[2]
TWINS = ("off", "thread", "process")


def schedstat() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable and waiting for one)."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


class Twin:
    def __init__(self, comp: str, mode: str, args: argparse.Namespace, work: Path) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.blocks):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.LayerNorm(args.width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers)
        self.opt = lowdiff.wrap(torch.optim.AdamW(self.model.parameters(), lr=1e-3), self.model, {
            "run_dir": str(work / f"{comp}-{mode}"), "enabled": mode != "off",
            "compressor": {"name": comp, "ratio": 0.01, "rank": 4},
            "snapshot": {"every_steps": args.every_steps},
            "log": {"batch_steps": args.batch_steps, "persistence": "process" if mode == "process" else "thread"}})
        gen = torch.Generator().manual_seed(1)
        self.batches = [torch.randn(args.batch, args.width, generator=gen) for _ in range(16)]
        self.k = 0

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.model(self.batches[self.k % 16]).pow(2).mean().backward()
            self.k += 1
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def window(self, n: int) -> dict[str, float]:
        st = self.opt.stats
        w0 = st.writer_cpu_s if st is not None else 0.0
        t0, (c0, q0) = time.perf_counter(), schedstat()
        self.steps(n)
        wall, (c1, q1) = time.perf_counter() - t0, schedstat()
        self.opt.flush()
        st = self.opt.stats
        return {"step_ms": wall / n * 1e3, "on_cpu_ms": (c1 - c0) / n * 1e3, "runqueue_ms": (q1 - q0) / n * 1e3,
                "sleep_ms": (wall - (c1 - c0) - (q1 - q0)) / n * 1e3,
                "writer_cpu_ms": ((st.writer_cpu_s if st is not None else 0.0) - w0) / n * 1e3}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lowdiff-gilwait-") as tmp:
        for comp in args.compressors:
            twins = {m: Twin(comp, m, args, Path(tmp)) for m in TWINS}
            for t in twins.values():
                t.steps(args.warmup)
                t.opt.flush()
            windows: dict[str, list[dict[str, float]]] = {m: [] for m in TWINS}
            for r in range(args.rounds):
                order = TWINS[r % 3:] + TWINS[:r % 3]
                for m in order:
                    windows[m].append(twins[m].window(args.window))
                print(f"{comp} round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{m} sleep {windows[m][-1]['sleep_ms']:.2f} ms" for m in TWINS), flush=True)
            for t in twins.values():
                t.opt.close()
            results[comp] = {m: {k: statistics.median(w[k] for w in ws) for k in ws[0]} | {"windows": ws}
                             for m, ws in windows.items()}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=41)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batch-steps", type=int, default=16)
    ap.add_argument("--every-steps", type=int, default=50)
    ap.add_argument("--compressors", nargs="+", default=["topk", "powersgd"], choices=["topk", "powersgd", "none"])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gilwait.json")
    args = ap.parse_args()
    if not os.path.exists("/proc/thread-self/schedstat"):
        sys.exit("gilwait: needs /proc/thread-self/schedstat (Linux)")
    if args.smoke:
        args.rounds, args.window, args.warmup, args.blocks, args.width = 2, 6, 4, 3, 32
        args.batch_steps, args.every_steps = 3, 5
    t0 = time.time()
    res = run(args)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    out = {"command": " ".join(["python", "bench/studies/gilwait.py", *sys.argv[1:]]), "git": git.strip(),
           "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)), "seconds": round(time.time() - t0),
           "load": os.getloadavg(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "results": res}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print("| compressor | twin | step | on a CPU | waiting for a CPU | asleep (GIL) | writer CPU |")
    print("|---|---|---|---|---|---|---|")
    for comp, twins in res.items():
        for m, r in twins.items():
            print(f"| {comp} | {m} | {r['step_ms']:.1f} ms | {r['on_cpu_ms']:.1f} ms | {r['runqueue_ms']:.2f} ms | "
                  f"{r['sleep_ms']:.2f} ms | {r['writer_cpu_ms']:.2f} ms |")


if __name__ == "__main__":
    main()
