"""The quickstart's loop and configuration (docs/guide/quickstart.md), no persistence key: the default.

    python quickstart_child.py RUN_DIR STEPS [DATA_WAIT_S]

A small model, AdamW, CosineAnnealingLR tracked, gradient clipping, Top-k 1 %, a snapshot every 100 steps, 16 steps
per segment. Prints ``START`` once resumed and then ``STEP k`` after each iteration has ended (after
``sched.step()``), flushed, so a test that kills it knows which steps returned. ``DATA_WAIT_S``: each iteration first
waits that long for its batch (a data loader), so most of an iteration lies between one ``sched.step()`` and the
next ``opt.step()``.
"""

from __future__ import annotations

import sys
import time

import torch

import lowdiff


def make(run_dir: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, lowdiff.LowDiffOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=1000)
    opt = lowdiff.wrap(inner, model, {"run_dir": run_dir, "compressor": {"name": "topk", "ratio": 0.01},
                                      "snapshot": {"every_steps": 100}, "log": {"batch_steps": 16}})
    opt.track(sched, "lr_scheduler")
    return model, inner, sched, opt


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(step))


def train(run_dir: str, steps: int, report: bool = True, data_wait_s: float = 0.0
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.set_num_threads(1)
    model, inner, sched, opt = make(run_dir)
    start = opt.resume()
    if report:
        print("START", start, flush=True)
    for step in range(start + 1, steps + 1):
        time.sleep(data_wait_s)
        loss = model(batch(step)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if report:
            print("STEP", step, flush=True)
    opt.close()
    return model, inner


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]), data_wait_s=float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
