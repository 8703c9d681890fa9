"""The writer's CPU to write one log segment built from packed steps, compared across two checkouts of lowdiff.

The steps are what the trainer hands a writer in its steady state: bench/faststep.py's MLP (41 blocks of Linear 512
+ LayerNorm + GELU, 10.8M parameters), one real gradient compressed with Top-k (1 %) or PowerSGD (rank 4), each
step's payloads packed into one buffer as the stager packs them (lowdiff._transfer.packing). A worker process
writes ``--reps`` segments of ``--steps`` steps with ``write_segment`` (codec none, direct I/O where the file system
takes it) and reports the median CPU time of the writing thread (``time.thread_time()``: user and system, the page
faults of fresh buffers included) and wall time per segment. With ``--trees OLD NEW`` the workers run alternately
against each checkout (``PYTHONPATH``), ``--rounds`` times, so both see the same machine.

    python bench/studies/segwrite.py --trees /work/old /work/new      # ~2 min on 2 cores
    python bench/studies/segwrite.py --worker                         # this checkout only, one worker
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
from _trees import alternate

HERE = Path(__file__).resolve()


def packed_steps(compressor: str, steps: int, blocks: int, width: int) -> list[Any]:
    from lowdiff._compressors import make_compressor
    from lowdiff._storage.segment import StepRecord
    from lowdiff._transfer.packing import PackedStep, StepPacker, pack_host

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    model(torch.randn(16, width)).pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    comp = make_compressor(compressor, ratio=0.01, rank=4, error_feedback=False)
    packer = StepPacker()
    out = []
    for s in range(1, steps + 1):
        payload = {n: {f: t.detach().clone() for f, t in comp.compress(n, g * (1 + s / 100)).items()}
                   for n, g in grads.items()}
        keys = [(n, f) for n, p in payload.items() for f in p]
        tensors = [t for p in payload.values() for t in p.values()]
        layout, _ = packer.plan(keys, tensors)
        assert layout is not None
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack_host(layout, tensors, buf)
        out.append(StepRecord(step=s, groups=[{"lr": 3e-4}], grads={}, rng={}, packed=PackedStep(buf, layout)))
    return out


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import lowdiff
    from lowdiff._storage.segment import write_segment

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-segwrite-", dir=args.work))
    try:
        (work / "log").mkdir()
        result: dict[str, Any] = {"lowdiff": str(Path(lowdiff.__file__).parent)}
        for comp in args.compressors:
            recs = packed_steps(comp, args.steps, args.blocks, args.width)
            cpu, wall, size = [], [], 0
            for i in range(args.reps + 1):
                t0, c0 = time.perf_counter(), time.thread_time()
                write_segment(work, recs, "none", comp)
                c, w = time.thread_time() - c0, time.perf_counter() - t0
                (seg,) = (work / "log").iterdir()
                size = seg.stat().st_size
                seg.unlink()
                if i:  # the first: imports, the bounce buffer, first touches
                    cpu.append(c)
                    wall.append(w)
            result[comp] = {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall),
                            "segment_bytes": size}
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE), "--worker", "--reps", str(args.reps), "--steps", str(args.steps),
           "--blocks", str(args.blocks), "--width", str(args.width), "--compressors", *args.compressors]
    if args.work:
        cmd += ["--work", args.work]
    old, new, runs = alternate(args.trees, args.rounds, cmd, lambda res: ", ".join(
        f"{c} {res[c]['cpu_ms']:.1f} ms CPU" for c in args.compressors))
    rows = []
    for c in args.compressors:
        o = [x[c]["cpu_ms"] for x in runs["old"]]
        n = [x[c]["cpu_ms"] for x in runs["new"]]
        rows.append({"compressor": c, "segment_bytes": runs["new"][0][c]["segment_bytes"],
                     "old_segment_bytes": runs["old"][0][c]["segment_bytes"],
                     "old_cpu_ms": statistics.median(o), "new_cpu_ms": statistics.median(n),
                     "ratio": statistics.median(b / a for a, b in zip(o, n)),
                     "old_wall_ms": statistics.median(x[c]["wall_ms"] for x in runs["old"]),
                     "new_wall_ms": statistics.median(x[c]["wall_ms"] for x in runs["new"]),
                     "old_runs": o, "new_runs": n})
    return {"rows": rows, "old": old, "new": new, "rounds": args.rounds, "reps": args.reps, "steps": args.steps,
            "blocks": args.blocks, "width": args.width, "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "load_after": os.getloadavg(),
            "command": " ".join(sys.argv)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts to compare, alternately")
    ap.add_argument("--worker", action="store_true", help="write segments with the lowdiff on the path; JSON out")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=15, help="segments a worker writes per compressor")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=41)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--compressors", nargs="+", default=["topk", "powersgd"])
    ap.add_argument("--work", default=None, help="where the segments are written (default: the temp directory)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 segments")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the comparison")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.width, args.reps, args.steps, args.rounds = 2, 64, 2, 4, 2
    if args.worker or not args.trees:
        print(json.dumps(worker(args)))
        return
    res = compare(args)
    for r in res["rows"]:
        print(f"{r['compressor']}: {r['old_segment_bytes'] / 1e6:.1f} MB segments; writer CPU a segment "
              f"{r['old_cpu_ms']:.1f} -> {r['new_cpu_ms']:.1f} ms (median ratio of rounds {r['ratio']:.2f}); "
              f"wall {r['old_wall_ms']:.1f} -> {r['new_wall_ms']:.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
