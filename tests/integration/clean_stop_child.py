"""One run of the clean-stop loop (test_clean_stop.py), in a fresh interpreter as a restarted job would be:

    python clean_stop_child.py RUN_DIR COMPRESSOR PERSISTENCE STOP_AT TOTAL OUT [ENDING]
    torchrun --nproc_per_node 2 clean_stop_child.py ...   # the same loop under DDP (gloo), each rank its batches

Seeds every generator, wraps, resumes, and trains to TOTAL, or stops after iteration STOP_AT (0: never) by ENDING:
``close`` (``opt.close()``), ``exit`` (the script ends with the optimizer open) or ``sigterm`` (the process is
sent SIGTERM by itself between two iterations, as a scheduler does). The loop is written as a user writes it:
an LR scheduler, a GradScaler that skips the iterations whose loss is not finite, dropout. Writes the model's and
the optimizer's state and the first iteration it ran to OUT (rank 0's under DDP).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import lowdiff

SKIPPED = (4, 9, 13)
"""Iterations whose loss is made infinite: the scaler skips their optimizer step."""


def main() -> None:
    run_dir, compressor, persistence, stop_at, total, out = sys.argv[1:7]
    ending = sys.argv[7] if len(sys.argv) > 7 else "close"
    stop_at, total = int(stop_at), int(total)
    torch.set_num_threads(1)
    rank, ddp = int(os.environ.get("RANK", "0")), "LOCAL_RANK" in os.environ
    if ddp:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(48, 4))
    model = torch.nn.parallel.DistributedDataParallel(net) if ddp else net
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=3, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    cfg = {"run_dir": run_dir, "compressor": {"name": compressor, "ratio": 0.1, "rank": 2},
           "snapshot": {"every_steps": 5}, "log": {"batch_steps": 4}}
    if persistence != "default":
        cfg["log"]["persistence"] = persistence
    opt = lowdiff.wrap(inner, model, cfg)
    opt.track(sched, "lr_scheduler")
    opt.track(scaler, "grad_scaler")
    start = opt.resume()
    if rank == 0:
        torch.save({"start": start}, out)
    for step in range(start + 1, total + 1):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))
        loss = model(x).pow(2).mean()
        if step in SKIPPED:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step == stop_at:
            if ending == "close":
                opt.close()
                break
            if ending == "exit":
                break  # the interpreter's exit closes it
            # A scheduler's SIGTERM between two iterations: the loop goes on into the next one, whose opt.step()
            # ends the process (exit status 143).
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
    else:
        opt.close()
    if rank == 0:
        torch.save({"start": start, "model": net.state_dict(), "optimizer": inner.state_dict()}, out)


if __name__ == "__main__":
    main()
