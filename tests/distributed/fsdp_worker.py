"""One rank of a fully_shard (FSDP2) training run under lowdiff, launched by torchrun from test_fsdp.py.

argv: RUN_DIR COMPRESSOR STEPS REF_OUT [--die-at STEP] [--resume] [--resume-at latest|snapshot] [--mp]
      [--ddp | --plain | --gpt] [--refuse WHAT,...] [--persistence thread|process] [--remote URL]

The model has an uneven shard (a Linear with 145 output rows, and a 5-row one: 3 + 2 rows on two ranks, a 1-row
bias: one rank's shard is empty), a frozen parameter, a BatchNorm and two optimizer groups; the loop clips the
gradient norm over the DTensors. Every rank saves the full (gathered) state after every step to REF_OUT (a list of
(step, model_sd, optim_sd)) for the test to compare with recovery: gathered here, in the test's reference only.
--die-at STEP: every rank exits abruptly at the start of STEP (no close(), no flush). --mp: MixedPrecisionPolicy
(bfloat16 parameters in forward and backward, float32 reduction). --ddp: the same loop under
DistributedDataParallel (nothing in the loop differs); --plain: the plain model; --gpt: examples/tinygpt.py with
its tied embedding and head instead of the model above. --refuse WHAT,...: for each, build an unsupported setup
(hsdp, placement, plain, optimizer), call lowdiff.wrap and print what it raised.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import lowdiff


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 145), torch.nn.BatchNorm1d(145), torch.nn.ReLU(),
        torch.nn.Linear(145, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(16, 12, generator=g), torch.randn(16, 1, generator=g)


def full(t: object) -> object:
    return t.full_tensor() if isinstance(t, DTensor) else t  # a collective: every rank calls it


def gathered(model: torch.nn.Module, inner: torch.optim.Optimizer) -> tuple[dict, dict]:
    msd = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    osd = inner.state_dict()
    state = {i: {k: full(v).clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
             for i, st in osd["state"].items()}
    return msd, {"state": state, "param_groups": osd["param_groups"]}


def refuse(what: str, cfg: dict) -> None:
    """Build one unsupported setup, wrap it, print what lowdiff said."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    model = make_model()
    if what == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    elif what == "placement":  # tensor-parallel-like: weights sharded along dimension 1
        fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % 2 == 0 else None)
    elif what == "plain":  # the root is not fully_shard-ed: its other parameters stay plain tensors
        fully_shard(model[0])
    else:
        fully_shard(model)
    inner = (torch.optim.Adafactor(model.parameters()) if what == "optimizer"
             else torch.optim.AdamW(model.parameters()))
    try:
        lowdiff.wrap(inner, model, cfg)
    except lowdiff.LowDiffError as e:
        print(f"REFUSED {what} {type(e).__name__}: {e}", flush=True)
    else:
        print(f"ACCEPTED {what}", flush=True)


def gpt_run(args: argparse.Namespace, cfg: dict, rank: int) -> None:
    """A small tinygpt (embedding and head tied inside the root unit), each block sharded on its own."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from examples.tinygpt import GPT

    torch.manual_seed(1234)
    model = GPT(vocab_size=67, n_layer=2, n_head=2, d_model=32, block_size=16, dropout=0.0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = lowdiff.wrap(inner, model, cfg)
    refs = []
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x, y = torch.randint(0, 67, (4, 16), generator=g), torch.randint(0, 67, (4, 16), generator=g)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        refs.append((step, *gathered(model, inner)))
    opt.close()
    if rank == 0:
        torch.save(refs, args.ref_out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("compressor")
    ap.add_argument("steps", type=int)
    ap.add_argument("ref_out")
    ap.add_argument("--die-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--resume-at", default="latest")
    ap.add_argument("--mp", action="store_true")
    ap.add_argument("--refuse", default="")
    ap.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of fully_shard, same loop")
    ap.add_argument("--plain", action="store_true", help="neither: the plain model (one rank)")
    ap.add_argument("--gpt", action="store_true", help="examples/tinygpt.py (tied embedding and head), sharded")
    ap.add_argument("--persistence", default="thread", help="log.persistence (thread or process)")
    ap.add_argument("--remote", default=None, help="remote.url: mirror the run there (tests/remote)")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    model = make_model()
    cfg = {
        "run_dir": args.run_dir,
        "compressor": {"name": args.compressor, "ratio": 0.1, "rank": 2},
        "snapshot": {"every_steps": 5}, "log": {"batch_steps": 3, "persistence": args.persistence},
    }
    if args.remote:
        cfg["remote"] = {"url": args.remote}
    if args.refuse:
        for i, what in enumerate(args.refuse.split(",")):
            refuse(what, cfg | {"run_dir": f"{args.run_dir}-{i}"})
        dist.destroy_process_group()
        return
    if args.gpt:
        gpt_run(args, cfg, rank)
        return
    model[3].bias.requires_grad_(False)  # a frozen parameter: in no optimizer group
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp else None
    kw = {"mp_policy": mp} if mp is not None else {}
    net: torch.nn.Module = model
    if args.ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif not args.plain:
        if mp is not None:
            fully_shard(model[1])  # BatchNorm in float32 (its running statistics are float32 buffers)
        fully_shard(model[0], **kw)
        fully_shard(model, **kw)
    inner = torch.optim.AdamW([
        {"params": [model[0].weight, model[0].bias, model[1].weight, model[1].bias], "lr": 1e-2},
        {"params": [model[3].weight, model[5].weight, model[5].bias], "lr": 5e-3, "weight_decay": 0.0},
    ])
    torch.manual_seed(99 + rank)
    opt = lowdiff.wrap(inner, net, cfg)
    start = opt.resume(at=args.resume_at) if args.resume else 0
    print(f"START {start}", flush=True)
    refs, losses = [], []
    for step in range(start + 1, args.steps + 1):
        if step == args.die_at:
            os._exit(17)
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        losses.append((step, loss.item()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        msd, osd = gathered(model, inner)
        refs.append((step, msd, osd))
    opt.close()
    if rank == 0:
        torch.save(refs, args.ref_out)
    torch.save(losses, f"{args.ref_out}.rank{rank}.losses")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
