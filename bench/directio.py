"""Writes past the page cache (``log.direct_io``): the writer's CPU and the training step, on against off.

Twins of bench/faststep.py's model (10.8M parameters by default: 41 blocks of Linear 512 + LayerNorm + GELU, AdamW,
Top-k 1 %, one torch thread), identical but for ``log.direct_io``, for each persistence mode, train in interleaved
windows of ``--every-steps`` steps (each holds one snapshot step, ~130 MB written), each window ending with
``opt.flush()``. Per window: step time, training-thread CPU (``time.thread_time()``) and the writer's CPU per step
(``opt.stats.writer_cpu_s``: the persistence process's CPU, or the writer thread's). The direct twin's figures are
divided by the page-cache twin's of the same round; medians over rounds with their quartiles, and the bootstrap
quartiles of the median (how far the median itself may be off).

    python bench/directio.py                       # ~8 min on 2 cores; bench/results/directio.json, docs page
    python bench/directio.py --smoke --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import median_quartiles, quartiles
from faststep import make_model

import lowdiff
import lowdiff.testing

REPO = Path(__file__).resolve().parents[1]


class Twin:
    def __init__(self, direct: bool, persistence: str, args: argparse.Namespace, work: Path) -> None:
        self.direct, self.persistence = direct, persistence
        self.name = f"{persistence}-{'direct' if direct else 'cached'}"
        self.model = make_model(args.blocks, args.width, seed=0)
        self.opt = lowdiff.wrap(torch.optim.AdamW(self.model.parameters(), lr=1e-3), self.model, {
            "run_dir": str(work / self.name), "compressor": {"name": args.compressor, "ratio": 0.01, "rank": 4},
            "snapshot": {"every_steps": args.every_steps},
            "log": {"batch_steps": args.batch_steps, "persistence": persistence, "direct_io": direct}})
        gen = torch.Generator().manual_seed(1)
        self.batches = [torch.randn(args.batch, args.width, generator=gen) for _ in range(16)]
        self.k = 0
        self.windows: list[dict[str, float]] = []

    def step(self) -> None:
        x = self.batches[self.k % len(self.batches)]
        self.k += 1
        self.model(x).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def writer_cpu_s(self) -> float:
        st = self.opt.stats
        return st.writer_cpu_s if st is not None else 0.0

    def window(self, steps: int) -> None:
        w0 = self.writer_cpu_s()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            self.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        f0 = time.perf_counter()
        self.opt.flush()
        self.windows.append({"step_s": wall / steps, "cpu_s": cpu / steps, "flush_s": time.perf_counter() - f0,
                             "writer_cpu_s": (self.writer_cpu_s() - w0) / steps})


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-directio-", dir=args.work_dir))
    try:
        direct_ok = lowdiff.testing.takes_direct_io(work)
        load0 = os.getloadavg()
        twins = [Twin(d, p, args, work) for p in args.persistence for d in (True, False)]
        for t in twins:
            for _ in range(args.warmup):
                t.step()
            t.opt.flush()
        for r in range(args.rounds):
            for t in twins if r % 2 == 0 else twins[::-1]:
                t.window(args.every_steps)
        rows = []
        for p in args.persistence:
            on = next(t for t in twins if t.persistence == p and t.direct)
            off = next(t for t in twins if t.persistence == p and not t.direct)
            ratio = [a["step_s"] / b["step_s"] for a, b in zip(on.windows, off.windows)]
            added = [a["cpu_s"] - b["cpu_s"] for a, b in zip(on.windows, off.windows)]
            row: dict[str, Any] = {"persistence": p, "step_ratio": statistics.median(ratio),
                                   "step_ratio_q": quartiles(ratio), "step_ratio_median_q": median_quartiles(ratio),
                                   "train_cpu_added_ms": 1e3 * statistics.median(added)}
            for side, t in (("direct", on), ("cached", off)):
                for key in ("step_s", "cpu_s", "flush_s", "writer_cpu_s"):
                    row[f"{side}_{key[:-2]}_ms"] = 1e3 * statistics.median(w[key] for w in t.windows)
                row[f"{side}_windows"] = t.windows
            rows.append(row)
        for t in twins:
            t.opt.close()
        return {"rows": rows, "direct_taken": direct_ok, "work_dir": str(work.parent), "rounds": args.rounds,
                "every_steps": args.every_steps, "batch_steps": args.batch_steps, "compressor": args.compressor,
                "blocks": args.blocks, "width": args.width, "batch": args.batch, "warmup": args.warmup,
                "params": sum(p.numel() for p in twins[0].model.parameters()), "torch_threads": 1,
                "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "machine": platform.machine(), "load_before": load0, "load_after": os.getloadavg(),
                "command": " ".join(sys.argv)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(res: dict[str, Any]) -> str:
    pct = lambda r: f"{100 * (r - 1):+.1f} %"  # noqa: E731
    lines = [
        "# Writes past the page cache (`log.direct_io`): `bench/directio.py`", "",
        f"`{res['command']}`", "",
        f"{res['params'] / 1e6:.1f}M-parameter MLP ({res['blocks']} blocks of width {res['width']}, batch "
        f"{res['batch']}), AdamW, compressor {res['compressor']}, a snapshot every {res['every_steps']} steps, "
        f"segments of {res['batch_steps']} steps, {res['torch_threads']} torch thread, {res['cpus']} CPUs, torch "
        f"{res['torch']}; {res['rounds']} rounds of one {res['every_steps']}-step window per twin, interleaved; "
        f"load {res['load_before'][0]:.1f} before, {res['load_after'][0]:.1f} after. Run directories under "
        f"`{res['work_dir']}`, whose file system "
        + ("takes `O_DIRECT`." if res["direct_taken"] else "**refuses `O_DIRECT`: both twins wrote through the page "
                                                           "cache, and this page measures nothing.**"), "",
        "| persistence | writer CPU per step, direct / page cache | step time, direct / page cache | quartiles "
        "over rounds | bootstrap quartiles of the median | training-thread CPU added per step | flush at a "
        "window's end, direct / page cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        q, mq = r["step_ratio_q"], r["step_ratio_median_q"]
        lines.append(
            f"| {r['persistence']} | {r['direct_writer_cpu_ms']:.2f} / {r['cached_writer_cpu_ms']:.2f} ms | "
            f"{r['direct_step_ms']:.1f} / {r['cached_step_ms']:.1f} ms: {pct(r['step_ratio'])} | "
            f"{pct(q[0])} .. {pct(q[1])} | {pct(mq[0])} .. {pct(mq[1])} | {r['train_cpu_added_ms']:+.2f} ms | "
            f"{r['direct_flush_ms']:.0f} / {r['cached_flush_ms']:.0f} ms |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds: checks the script runs")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--blocks", type=int, default=41)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batch-steps", type=int, default=16)
    ap.add_argument("--every-steps", type=int, default=50)
    ap.add_argument("--compressor", default="topk", choices=("topk", "powersgd", "none"))
    ap.add_argument("--persistence", nargs="+", default=["process", "thread"], choices=("process", "thread"))
    ap.add_argument("--work-dir", type=Path, help="where the run directories go (default: the system's temp dir)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "measurements" / "directio.md")
    ap.add_argument("--render", type=Path, help="only rewrite the page from this results JSON")
    args = ap.parse_args()
    if args.render:
        args.docs.write_text(markdown(json.loads(args.render.read_text())))
        return
    if args.smoke:
        args.rounds, args.warmup, args.blocks, args.every_steps, args.batch_steps = 2, 4, 4, 5, 3
        args.docs = args.out_dir / "directio.md"
    res = run(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "directio.json").write_text(json.dumps(res, indent=1))
    args.docs.write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
