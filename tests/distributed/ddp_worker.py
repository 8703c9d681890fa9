"""One rank of a DDP training run under lowdiff, launched by torchrun from test_ddp.py.

argv: RUN_DIR COMPRESSOR STEPS REF_OUT [--die-at STEP] [--resume] [--resume-at latest|snapshot] [--auto] [--probe]
      [--remote URL] [--scaler] [--skip STEP ...] [--sync-watch STEP]
Rank 0 saves the reference state after every step to REF_OUT (a list of (model_sd, optim_sd)).
With --auto (snapshot.every_steps and log.batch_steps auto), every rank also saves the (every_steps, batch_steps,
last snapshot step) in force after each step to REF_OUT.rankR.sched. --probe (with --auto): a tiny MTBF, a
2 % overhead bound and 5 ms more per committed file, so the writer is busy at every step and the tuner probes its
interference (docs/reference/tuner-model.md, section 4); with it REF_OUT holds every step's reference state.
--scaler: a tracked ``torch.amp.GradScaler("cpu")`` scales the loss and steps the optimizer (the hook compresses the
scaled gradients); --skip: iterations whose loss is made infinite (the scaler skips their step). --sync-watch STEP:
from that iteration on, each rank watches its training thread (backward, step, update) for device syncs lowdiff's
code makes (tests/sync_watch.py) and saves what it found to REF_OUT.rankR.syncs.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

import lowdiff
from lowdiff.testing import intercept_writes


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("compressor")
    ap.add_argument("steps", type=int)
    ap.add_argument("ref_out")
    ap.add_argument("--die-at", type=int, default=0, help="rank 1 exits abruptly at this step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--resume-at", default="latest", help="opt.resume(at=...): latest or snapshot")
    ap.add_argument("--continuous-rng", action="store_true",
                    help="seed once before wrap and let resume() restore each rank's RNG (exact continuation)")
    ap.add_argument("--auto", action="store_true", help="snapshot.every_steps and log.batch_steps auto")
    ap.add_argument("--probe", action="store_true", help="with --auto: a busy writer, so the tuner probes")
    ap.add_argument("--persistence", default="thread", help="log.persistence: thread or process")
    ap.add_argument("--load-after-wrap", action="store_true",
                    help="after a resume at step 0, set every parameter to 0.1 (weights loaded after wrap())")
    ap.add_argument("--compiled", action="store_true", help="torch.compile(DDP(model)) (eager backend) to lowdiff")
    ap.add_argument("--remote", default=None, help="remote.url: mirror the run there (tests/remote)")
    ap.add_argument("--scaler", action="store_true", help="a tracked GradScaler('cpu') around backward and step")
    ap.add_argument("--skip", type=int, nargs="*", default=[], help="with --scaler: iterations with an inf loss")
    ap.add_argument("--sync-watch", type=int, default=0, help="watch for lowdiff's device syncs from this step on")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    rank = dist.get_rank()
    model = make_model()
    if args.continuous_rng:
        torch.manual_seed(99 + rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if args.compiled:
        ddp = torch.compile(ddp, backend="eager")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {
        "run_dir": args.run_dir,
        "compressor": {"name": args.compressor, "ratio": 0.1, "rank": 2},
        "snapshot": {"every_steps": 5}, "log": {"batch_steps": 3, "persistence": args.persistence},
    }
    if args.auto:  # a high failure rate and a loose bound: the tuner picks small, frequently re-tuned values
        cfg.update({"snapshot": {"every_steps": "auto"},
                    "log": {"batch_steps": "auto", "persistence": args.persistence},  # intercept_writes: the thread
                    "tuner": {"mtbf_hours": 0.01, "max_overhead": 0.5}})
    if args.probe:
        cfg["tuner"] = {"mtbf_hours": 0.001, "max_overhead": 0.02}
        # a disk with 5 ms more per committed file (left in force until the worker exits)
        # Kept referenced: a context manager collected at the end of the statement would restore the disk at once.
        slow_disk = intercept_writes(before_commit=lambda path: time.sleep(0.005))
        slow_disk.__enter__()
    if args.remote:
        cfg["remote"] = {"url": args.remote}
    opt = lowdiff.wrap(inner, ddp, cfg)
    scaler = opt.track(torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2), "scaler") \
        if args.scaler else None
    watch = None
    if args.sync_watch:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from sync_watch import SyncWatch
        watch = SyncWatch("cpu")
    start = opt.resume(at=args.resume_at) if args.resume else 0
    if args.load_after_wrap and start == 0:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.1)
    refs = []
    losses = []
    if rank == 0:
        print(f"START {start}", flush=True)
    sched = []
    if not args.continuous_rng:
        torch.manual_seed(99 + rank + 1000 * start)
    for step in range(start + 1, args.steps + 1):
        if rank == 1 and step == args.die_at:
            os._exit(17)
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        losses.append((step, loss.item()))
        with watch if watch is not None and step >= args.sync_watch else nullcontext():
            if scaler is not None:
                scaler.scale(loss * math.inf if step in args.skip else loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (not args.auto or args.probe or step > args.steps - 3):
            refs.append((step, copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict())))
        if args.auto:
            st = opt.stats
            sched.append((step, st.every_steps, st.batch_steps, st.last_snapshot_step))
    opt.close()
    if args.auto:
        torch.save(sched, f"{args.ref_out}.rank{rank}.sched")
    if rank == 0:
        torch.save(refs, args.ref_out)
    torch.save(losses, f"{args.ref_out}.rank{rank}.losses")
    if watch is not None:
        torch.save(dict(watch.found), f"{args.ref_out}.rank{rank}.syncs")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
