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
