"""DDP benchmark: per-rank bytes written per step at world sizes 1, 2, 4 for each compressor, and the
2-rank overhead of per-iteration checkpointing over the same DDP training with `enabled: false`.

Each configuration is one torchrun job (gloo, CPU, one thread per rank). Inside the overhead job the two
modes alternate round by round (a fresh model, DDP wrapper and run directory per round), so machine drift
hits both alike; the ratio is of medians of per-round median step times.

    python bench/ddp.py             # bench/results/ddp.json + docs/measurements/ddp.md
    python bench/ddp.py --smoke     # seconds

bench/fsdp.py runs this same benchmark with the model under FSDP2's ``fully_shard`` instead of DDP
(:data:`VARIANTS`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMPRESSORS = ("topk", "powersgd", "none")


@dataclass(frozen=True)
class Variant:
    """How the model is parallelized, and what the page says about it."""

    script: str
    title: str
    bytes_note: str
    worlds: tuple[int, ...]


VARIANTS = {
    "ddp": Variant(
        "ddp", "DDP benchmark (gloo on CPU)",
        "`max/fair`: the busiest rank's bytes over 1/N of what one writer would write for the same job. "
        "`total/N=1`: all ranks' bytes over the 1-rank run's (PowerSGD's payload does not grow with N; "
        "Top-k's coalesced union grows with N when ranks pick different indices; RNG state is per rank).",
        (1, 2, 4)),
    "fsdp": Variant(
        "fsdp", "FSDP2 (fully_shard) benchmark (gloo on CPU)",
        "Each rank logs the payload of its own shards. `max/fair`: the busiest rank's bytes over 1/N of all "
        "ranks' bytes. `total/N=1`: all ranks' bytes over the 1-rank run's (Top-k keeps ratio x rows of each "
        "shard, so about the same total; PowerSGD's factors are per shard, so the total grows with N; RNG state "
        "is per rank).",
        (1, 2)),
}


def parallelize(model, parallel: str):  # type: ignore[no-untyped-def]
    """The module the loop calls: DDP around the model, or the model with each block and the root fully_shard-ed."""
    import torch

    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    return torch.nn.parallel.DistributedDataParallel(model)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import lowdiff
    from examples.tinygpt import GPT, StdlibText

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data = StdlibText(max_bytes=300_000)
    gen = torch.Generator().manual_seed(rank)
    batches = [data.get_batch(args.batch, 64, gen) for _ in range(8)]
    out: dict = {"rank": rank, "world": world, "rounds": []}
    modes = ["off", "on"] if args.overhead else ["on"]
    for rnd in range(args.rounds):
        for mode in modes:
            torch.manual_seed(0)
            model = GPT(vocab_size=256, n_layer=args.layers, n_head=4, d_model=args.d_model, block_size=64,
                        dropout=0.0)
            net = parallelize(model, args.parallel)
            run_dir = Path(args.work) / f"{mode}-{rnd}"
            opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=3e-4), net, {
                "run_dir": str(run_dir), "enabled": mode == "on",
                "compressor": {"name": args.compressor, "ratio": 0.01, "rank": 4},
                "snapshot": {"every_steps": 1000}, "log": {"batch_steps": 8, "codec": "none"},
            })
            times = []
            for step in range(args.steps):
                x, y = batches[step % len(batches)]
                dist.barrier()
                t0 = time.perf_counter()
                _, loss = net(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
            opt.close()
            stats = opt.stats
            out["rounds"].append({"mode": mode, "step_s": statistics.median(times[args.warmup:]),
                                  "log_bytes": stats.log_bytes if stats else 0,
                                  "steps": args.steps, "params": model.num_params()})
            dist.barrier()
    Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def launch(nproc: int, out: Path, work: Path, compressor: str, a: argparse.Namespace, overhead: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), __file__, "--worker", "--out", str(out), "--work", str(work),
           "--compressor", compressor, "--steps", str(a.steps), "--warmup", str(a.warmup), "--rounds",
           str(a.rounds if overhead else 1), "--layers", str(a.layers), "--d-model", str(a.d_model),
           "--batch", str(a.batch), "--parallel", a.parallel] + (["--overhead"] if overhead else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, timeout=1800, env=env, capture_output=True)
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(nproc)]


def main(parallel: str = "ddp", doc: str | None = __doc__) -> None:
    variant = VARIANTS[parallel]
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parallel", default=parallel, choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    ap.add_argument("--work", default="")
    ap.add_argument("--compressor", default="topk")
    ap.add_argument("--overhead", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--bytes-only", action="store_true", help="skip the overhead runs")
    ap.add_argument("--overhead-only", action="store_true", help="skip the bytes-per-step runs")
    ap.add_argument("--compressors", default=",".join(COMPRESSORS), help="comma-separated subset")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    if a.smoke:
        a.steps, a.warmup, a.rounds, a.layers, a.d_model, a.batch = 4, 1, 1, 1, 64, 2
    tmp = Path(tempfile.mkdtemp(prefix=f"lowdiff-{variant.script}-bench-"))
    results: dict = {"setup": vars(a) | {"cpus": os.cpu_count()}, "loadavg_start": os.getloadavg(), "bytes": [],
                     "overhead": []}
    try:
        comps = [c for c in a.compressors.split(",") if c]
        for comp in () if a.overhead_only else comps:
            per_world = {}
            for world in (variant.worlds[:2] if a.smoke else variant.worlds):
                ranks = launch(world, tmp / f"b-{comp}-{world}", tmp / f"w-{comp}-{world}", comp, a, False)
                per_rank = [r["rounds"][0]["log_bytes"] / a.steps for r in ranks]
                per_world[world] = per_rank
                results["bytes"].append({"compressor": comp, "world": world, "per_rank_bytes_per_step": per_rank,
                                         "total_bytes_per_step": sum(per_rank),
                                         "params": ranks[0]["rounds"][0]["params"]})
            for row in results["bytes"]:
                if row["compressor"] == comp:
                    # A single writer would write every rank's share: max rank / (total / N) is the balance.
                    n = row["world"]
                    fair = row["total_bytes_per_step"] / n
                    row["max_rank_vs_fair_share"] = max(row["per_rank_bytes_per_step"]) / fair
                    row["total_vs_world1"] = row["total_bytes_per_step"] / sum(per_world[1])
        for comp in () if a.bytes_only else comps:
            ranks = launch(2, tmp / f"o-{comp}", tmp / f"wo-{comp}", comp, a, True)
            rows = ranks[0]["rounds"]
            off = [max(r["rounds"][i]["step_s"] for r in ranks) for i, x in enumerate(rows) if x["mode"] == "off"]
            on = [max(r["rounds"][i]["step_s"] for r in ranks) for i, x in enumerate(rows) if x["mode"] == "on"]
            ratios = [b / o for o, b in zip(off, on)]
            results["overhead"].append({"compressor": comp, "off_step_s": statistics.median(off),
                                        "on_step_s": statistics.median(on), "ratio_median": statistics.median(ratios),
                                        "per_round_ratios": ratios})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    lines = [f"# {variant.title}", "",
             f"`python bench/{variant.script}.py{' --smoke' if a.smoke else ''}`: tinygpt n_layer={a.layers} "
             f"d_model={a.d_model}, {a.steps} steps ({a.warmup} warm-up), Top-k 1 %, PowerSGD rank 4, codec none.", "",
             "## Bytes written per step, per rank", "", variant.bytes_note, "",
             "| compressor | world size | per-rank bytes/step | total bytes/step | max/fair | total/N=1 |",
             "|---|---|---|---|---|---|"]
    for r in results["bytes"]:
        per_rank = ", ".join(f"{b:,.0f}" for b in r["per_rank_bytes_per_step"])
        lines.append(f"| {r['compressor']} | {r['world']} | {per_rank}"
                     f" | {r['total_bytes_per_step']:,.0f} | {r['max_rank_vs_fair_share']:.3f} |"
                     f" {r['total_vs_world1']:.3f} |")
    lines += ["", "## 2-rank overhead of per-iteration checkpointing vs `enabled: false`", "",
              f"Median over {a.rounds} alternating rounds of the slower rank's median step time.", "",
              "| compressor | off (s/step) | on (s/step) | ratio (median of per-round ratios) |", "|---|---|---|---|"]
    for r in results["overhead"]:
        lines.append(f"| {r['compressor']} | {r['off_step_s']:.4f} | {r['on_step_s']:.4f} | {r['ratio_median']:.4f} |")
    name = variant.script
    out_json = Path(a.out_dir) / f"{name}.json" if a.out_dir else ROOT / f"bench/results/{name}.json"
    out_md = Path(a.out_dir) / f"{name}.md" if a.out_dir else ROOT / f"docs/measurements/{name}.md"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1))
    out_md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
