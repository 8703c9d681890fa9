"""lowdiff's own training-thread CPU in a steady-state step, compared across two checkouts of lowdiff.

The loop and the attribution are bench/faststep.py's (its ``Twin``, public API only): the 10.8M-parameter MLP (41
blocks of Linear 512 + LayerNorm + GELU), AdamW, 1 torch thread, Top-k (1 %) or PowerSGD (rank 4); each twin's
``opt.step()`` and ``opt.zero_grad()`` timed with ``time.thread_time()`` minus the compressor's, the inner
optimizer's ``step()`` and ``zero_grad()``, over the steps that take no snapshot. A worker process runs an ``off``
twin (``enabled: false``) and the lowdiff twins of each persistence mode in windows taken in turn, and reports the
median of each twin's steady-state own CPU minus the ``off`` twin's. With ``--trees OLD NEW`` the workers run
alternately against each checkout (``PYTHONPATH``), ``--rounds`` times, so both see the same machine: differences
of a few hundredths of a millisecond, which bench/faststep.py's separate runs cannot resolve (its own-CPU figure
moved by 0.06 ms between runs of the same code).

    python bench/studies/stepcpu.py --trees /work/old /work/new      # ~14 min on 2 cores
    python bench/studies/stepcpu.py --worker                         # this checkout only, one worker
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
            for _ in range(args.windows):
                for t in twins:
                    for _ in range(args.window):
                        t.step()
                    t.opt.flush()
            off = twins[0].own_steady_s()
            result[comp] = {t.persistence: 1e3 * (t.own_steady_s() - off) for t in twins[1:]}
            for t in twins:
                t.opt.close()
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE), "--worker", "--blocks", str(args.blocks), "--width", str(args.width),
           "--warmup", str(args.warmup), "--window", str(args.window), "--windows", str(args.windows),
           "--compressors", *args.compressors, "--persistence", *args.persistence]
    old, new, runs = alternate(args.trees, args.rounds, cmd, lambda res: "; ".join(
        f"{c} " + ", ".join(f"{p} {res[c][p]:+.3f}" for p in args.persistence) for c in args.compressors) + " ms",
        timeout=1800)
    rows = []
    for c in args.compressors:
        for p in args.persistence:
            o = [x[c][p] for x in runs["old"]]
            n = [x[c][p] for x in runs["new"]]
            rows.append({"compressor": c, "persistence": p, "old_ms": statistics.median(o),
                         "new_ms": statistics.median(n), "diff_ms": statistics.median(b - a for a, b in zip(o, n)),
                         "old_runs": o, "new_runs": n})
    return {"rows": rows, "old": old, "new": new, "rounds": args.rounds, "warmup": args.warmup,
            "window": args.window, "windows": args.windows, "blocks": args.blocks, "width": args.width,
            "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_after": os.getloadavg(), "command": " ".join(sys.argv)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts to compare, alternately")
    ap.add_argument("--worker", action="store_true", help="measure the lowdiff on the path; JSON out")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=40, help="steps per twin before it is timed")
    ap.add_argument("--window", type=int, default=25, help="steps a twin runs in its turn")
    ap.add_argument("--windows", type=int, default=4, help="turns per twin")
    ap.add_argument("--blocks", type=int, default=41)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--compressors", nargs="+", default=["topk", "powersgd"])
    ap.add_argument("--persistence", nargs="+", default=["thread", "process"])
    ap.add_argument("--smoke", action="store_true", help="a tiny model, a few steps")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the comparison")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.width, args.warmup, args.window, args.windows, args.rounds = 2, 64, 3, 4, 1, 2
    if args.worker or not args.trees:
        print(json.dumps(worker(args)))
        return
    res = compare(args)
    for r in res["rows"]:
        print(f"{r['compressor']} {r['persistence']}: lowdiff's own CPU a steady step {r['old_ms']:.3f} -> "
              f"{r['new_ms']:.3f} ms (median difference of rounds {r['diff_ms']:+.3f} ms)")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
