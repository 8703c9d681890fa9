"""lowdiff's own training-thread CPU in a steady-state step, of one checkout or compared across two.

The loop and the attribution are bench/faststep.py's (its ``Twin``, public API only): the 10.8M-parameter MLP (41
blocks of Linear 512 + LayerNorm + GELU), AdamW, 1 torch thread, Top-k (1 %) or PowerSGD (rank 4); each twin's
``opt.step()`` and ``opt.zero_grad()`` timed with ``time.thread_time()`` minus the compressor's, the inner
optimizer's ``step()`` and ``zero_grad()``. A worker process runs an ``off`` twin (``enabled: false``) and the
lowdiff twins of each persistence mode one step each in turn (the order reversed every other turn), so each lowdiff
step has an ``off`` step beside it that saw the same machine; lowdiff's own CPU is the median over steps of that
pair's difference (steps that take a snapshot left out), reported with its quartiles. The median of each twin's
steps minus the ``off`` twin's (the figure before 2026-11-30's page) is reported beside it: on a shared VM whose
speed drifts over seconds, it moved by tenths of a millisecond between runs of the same code. With
``--trees OLD NEW`` the workers run alternately against each checkout (``PYTHONPATH``), ``--rounds`` times.

    python bench/studies/stepcpu.py --trees /work/old /work/new      # ~14 min on 2 cores
    python bench/studies/stepcpu.py --rounds 3                       # this checkout, 3 workers in turn
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _trees import alternate

HERE = Path(__file__).resolve()
sys.path.insert(1, str(HERE.parents[1]))  # bench/faststep.py; lowdiff itself comes from PYTHONPATH


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from faststep import Twin

    import lowdiff

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-stepcpu-"))
    ns = argparse.Namespace(blocks=args.blocks, width=args.width, batch=16, batch_steps=16, every_steps=50)
    try:
        result: dict[str, Any] = {"lowdiff": str(Path(lowdiff.__file__).parent)}
        for comp in args.compressors:
            twins = [Twin(comp, None, ns, work)] + [Twin(comp, p, ns, work) for p in args.persistence]
            for t in twins:
                for _ in range(args.warmup):
                    t.step()
                t.opt.flush()
                t.instrument()
            for w in range(args.windows):
                for i in range(args.window):  # a step of each in turn; every other turn the other way round
                    for t in twins if (w * args.window + i) % 2 == 0 else twins[::-1]:
                        t.step()
                for t in twins:
                    t.opt.flush()
            off = twins[0]
            result[comp] = {}
            for t in twins[1:]:
                diffs = sorted(a - b for (a, snap_a), (b, snap_b) in zip(t.own_steps, off.own_steps)
                               if not snap_a and not snap_b)
                q1, med, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else diffs * 3
                result[comp][t.persistence] = 1e3 * med
                result.setdefault("detail", {}).setdefault(comp, {})[t.persistence] = {
                    "paired_ms": 1e3 * med, "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3, "pairs": len(diffs),
                    "unpaired_ms": 1e3 * (t.own_steady_s() - off.own_steady_s())}
            for t in twins:
                t.opt.close()
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cmd(args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(HERE), "--worker", "--blocks", str(args.blocks), "--width", str(args.width),
           "--warmup", str(args.warmup), "--window", str(args.window), "--windows", str(args.windows),
           "--compressors", *args.compressors, "--persistence", *args.persistence]


def _describe(args: argparse.Namespace) -> Any:
    return lambda res: "; ".join(f"{c} " + ", ".join(
        f"{p} {res[c][p]:+.3f} (quartiles {res['detail'][c][p]['q1_ms']:+.3f} {res['detail'][c][p]['q3_ms']:+.3f}, "
        f"unpaired {res['detail'][c][p]['unpaired_ms']:+.3f})" for p in args.persistence)
        for c in args.compressors) + " ms"


def _machine(args: argparse.Namespace) -> dict[str, Any]:
    return {"rounds": args.rounds, "warmup": args.warmup, "window": args.window, "windows": args.windows,
            "blocks": args.blocks, "width": args.width, "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "load_after": os.getloadavg(),
            "command": " ".join(sys.argv)}


def single(args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` workers on this checkout, one after the other: each row's median over them."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[2])}
    runs = []
    for r in range(args.rounds):
        out = subprocess.run(_cmd(args), env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds}: {_describe(args)(runs[-1])}", flush=True)
    rows = [{"compressor": c, "persistence": p, "ms": statistics.median(x[c][p] for x in runs),
             "runs": [x["detail"][c][p] for x in runs]} for c in args.compressors for p in args.persistence]
    return {"rows": rows, "lowdiff": runs[0]["lowdiff"], **_machine(args)}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    old, new, runs = alternate(args.trees, args.rounds, _cmd(args), _describe(args), timeout=1800)
    rows = []
    for c in args.compressors:
        for p in args.persistence:
            o = [x[c][p] for x in runs["old"]]
            n = [x[c][p] for x in runs["new"]]
            rows.append({"compressor": c, "persistence": p, "old_ms": statistics.median(o),
                         "new_ms": statistics.median(n), "diff_ms": statistics.median(b - a for a, b in zip(o, n)),
                         "old_runs": o, "new_runs": n})
    return {"rows": rows, "old": old, "new": new, **_machine(args)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"),
                    help="two checkouts to compare, alternately (without: --rounds workers on this checkout)")
    ap.add_argument("--worker", action="store_true", help="measure the lowdiff on the path; JSON out")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=40, help="steps per twin before it is timed")
    ap.add_argument("--window", type=int, default=25, help="steps of each twin (one each in turn) between flushes")
    ap.add_argument("--windows", type=int, default=4, help="windows per worker")
    ap.add_argument("--blocks", type=int, default=41)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--compressors", nargs="+", default=["topk", "powersgd"])
    ap.add_argument("--persistence", nargs="+", default=["thread", "process"])
    ap.add_argument("--smoke", action="store_true", help="a tiny model, a few steps")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the comparison")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.width, args.warmup, args.window, args.windows, args.rounds = 2, 64, 3, 4, 1, 2
    if args.worker:
        print(json.dumps(worker(args)))
        return
    res = compare(args) if args.trees else single(args)
    for r in res["rows"]:
        what = (f"{r['old_ms']:.3f} -> {r['new_ms']:.3f} ms (median difference of rounds {r['diff_ms']:+.3f} ms)"
                if args.trees else f"{r['ms']:.3f} ms (median of {args.rounds} workers' paired medians)")
        print(f"{r['compressor']} {r['persistence']}: lowdiff's own CPU a steady step {what}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
