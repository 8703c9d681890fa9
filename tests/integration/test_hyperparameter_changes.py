"""Every change of a hyperparameter reaches the log at the step it happens, however it is made: a scheduler's new
float, a tensor ``lr`` changed in place, a list changed in place, a tuple replaced, a value set again to an equal
object. ``opt.step()`` encodes the groups again only when a value is not the object it encoded last time or may
have changed in place (lowdiff._training.iteration.GroupEncoder); a cached encoding that missed a change would log
stale hyperparameters and replay would diverge. Recovery at every step must equal the live run bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lowdiff


def _change(group: dict, it: int) -> None:
    """After opt.step() of iteration ``it``: what the next step's update uses (the iteration's end state)."""
    if it == 2:
        group["lr"].fill_(0.005)  # the same tensor object, a new value
    elif it == 3:
        group["schedule"].append(3)  # a list, changed in place
    elif it == 4:
        group["weight_decay"] = float(str(group["weight_decay"]))  # an equal value, a new object
    elif it == 5:
        group["betas"] = (0.8, 0.95)
    elif it == 6:
        group["lr"] = torch.tensor(0.02)  # a new tensor
    elif it == 7:
        group["lr"].mul_(0.5)


@pytest.mark.parametrize("persistence", ["thread", "process"])
@pytest.mark.parametrize("compressor", ["topk", "none"])
def test_each_change_of_a_hyperparameter_is_replayed_at_its_step(tmp_path: Path, persistence: str,
                                                                 compressor: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    inner.param_groups[0]["schedule"] = [1, 2]  # a program's own hyperparameter, a list
    run = tmp_path / "run"
    opt = lowdiff.wrap(inner, model, {"run_dir": str(run), "compressor": {"name": compressor, "ratio": 0.5},
                                      "snapshot": {"every_steps": 1000}, "log": {"batch_steps": 3,
                                                                                  "persistence": persistence}})
    opt.resume()
    live: dict[int, dict[str, torch.Tensor]] = {}
    ends: dict[int, tuple] = {}
    gen = torch.Generator().manual_seed(1)
    for it in range(1, 10):
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        live[it] = {k: v.clone() for k, v in model.state_dict().items()}
        _change(inner.param_groups[0], it)
        g = inner.param_groups[0]
        ends[it] = (float(g["lr"]), list(g["schedule"]), g["betas"], g["weight_decay"])
    opt.close()
    for it in range(1, 10):
        rec = lowdiff.recover(run, step=it, workers=1)
        assert all(torch.equal(rec.model[k], v) for k, v in live[it].items()), f"step {it}"
        end = rec.end_groups[0]
        assert (float(end["lr"]), end["schedule"], end["betas"], end["weight_decay"]) == ends[it], f"step {it}"


@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_groups_and_rng_that_repeat_from_step_to_step_are_logged_at_every_step(tmp_path: Path,
                                                                                persistence: str) -> None:
    """A record repeats what did not change since the record before (the persistence process is sent neither the
    same encoded groups nor the same RNG bytes again; a seal whose groups are its step's says so): float
    hyperparameters a scheduler changes every third iteration, random draws after some steps only. Every step
    recovers its own groups, its end-of-iteration groups and its RNG state, bit for bit."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=3, gamma=0.5)
    run = tmp_path / "run"
    opt = lowdiff.wrap(inner, model, {"run_dir": str(run), "compressor": {"name": "topk", "ratio": 0.5},
                                      "snapshot": {"every_steps": 1000},
                                      "log": {"batch_steps": 4, "persistence": persistence}})
    opt.track(sched, "sched")
    opt.resume()
    live, lrs, ends, rngs = {}, {}, {}, {}
    gen = torch.Generator().manual_seed(1)
    for it in range(1, 12):
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        lrs[it] = inner.param_groups[0]["lr"]
        opt.step()
        rngs[it] = lowdiff.rng.capture()  # what the record of this step logs: the state opt.step() left
        opt.zero_grad()
        live[it] = {k: v.clone() for k, v in model.state_dict().items()}
        sched.step()
        ends[it] = inner.param_groups[0]["lr"]
        if it % 4 == 1:  # between iterations, after some steps only: the next record's RNG state differs
            torch.rand(3)
            np.random.rand()
            random.random()
        elif it % 4 == 2:
            torch.rand(1)  # torch's source only
    opt.close()
    assert len(set(lrs.values())) > 1 and any(lrs[it] == ends[it] for it in lrs)  # both kinds of seal happened
    for it in range(1, 12):
        rec = lowdiff.recover(run, step=it, workers=1)
        assert all(torch.equal(rec.model[k], v) for k, v in live[it].items()), f"step {it}"
        assert rec.optimizer["param_groups"][0]["lr"] == lrs[it], f"step {it}"
        assert rec.end_groups is not None and rec.end_groups[0]["lr"] == ends[it], f"step {it}"
        assert set(rec.rng) == set(rngs[it]), f"step {it}"
        assert all(torch.equal(rec.rng[k], v) for k, v in rngs[it].items()), f"step {it}: RNG state"
