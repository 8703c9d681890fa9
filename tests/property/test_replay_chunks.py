"""The fast replay path (lowdiff/_recovery/replayer.py): tensors cut into chunks stepped by one optimizer entry
each, spread over worker threads, Adam's sqrt without torch's slow path on zeros. All of it must stay bit-exact:
tiny chunks here split every tensor of the test models, as 64 K chunks split a real model's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lowdiff_harness import Scenario, assert_state_equal, loss_for, make_model, train_run

import lowdiff
from lowdiff._recovery import ReplayOptions
from lowdiff._recovery.exact_sqrt import FastSqrtState, exact_sqrt

TINY = ReplayOptions(chunk_elems=64, sqrt_min_elems=1)
"""Chunks that split every tensor of the test models, as 64 K chunks split a real model's."""


@pytest.fixture
def tiny_chunks() -> ReplayOptions:
    return TINY


@pytest.mark.parametrize("compressor", ["topk", "powersgd", "none"])
@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd_nesterov"])
def test_chunked_replay_is_exact_with_one_and_three_workers(tmp_path: Path, tiny_chunks: ReplayOptions, compressor: str,
                                                             optimizer: str) -> None:
    scenario = Scenario(model="frozen", optimizer=optimizer, groups=2, scheduler=True, clip=True,
                        compressor=compressor, ratio=0.25, batch_steps=3, every_steps=5)
    t = train_run(scenario, tmp_path / "run", 9)
    for target in (3, 9):  # from the step-0 snapshot (lazily created state), and from the step-5 one
        for workers in (1, 3):
            rec = lowdiff.recover(tmp_path / "run", step=target, workers=workers, options=tiny_chunks)
            assert rec.report.workers == workers
            assert_state_equal(*t.refs[target], rec)


OPTIMIZERS = {
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=1e-3, weight_decay=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "rmsprop_plain": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, dampening=0.1, maximize=True),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_every_elementwise_optimizer_replays_exactly_in_chunks(tmp_path: Path, tiny_chunks: ReplayOptions,
                                                               kind: str) -> None:
    model = make_model("mlp_bn", 0)
    inner = OPTIMIZERS[kind](model.parameters())
    opt = lowdiff.wrap(inner, model, {"run_dir": str(tmp_path / "run"), "log": {"batch_steps": 2},
                                      "compressor": {"name": "topk", "ratio": 0.3},
                                      "snapshot": {"every_steps": 4}})
    assert opt.resume() == 0
    refs = {}
    for k in range(1, 8):
        loss_for("mlp_bn", model, k, 0).backward()
        opt.step()
        opt.zero_grad()
        refs[k] = (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()))
    opt.close()
    for k in (3, 7):
        for workers in (1, 2):
            rec = lowdiff.recover(tmp_path / "run", step=k, workers=workers, options=tiny_chunks)
            assert rec.report.mode == ("parallel" if workers > 1 else "sequential")
            assert_state_equal(*refs[k], rec)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_exact_sqrt_matches_torch_sqrt_bit_for_bit() -> None:
    """Zeros (both signs), subnormals, negatives, NaN, inf and every binade, at every offset and length."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    normal = torch.ldexp(torch.rand(n, generator=g) + 0.5, torch.randint(-126, 128, (n,), generator=g))
    specials = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -1.0, torch.finfo(torch.float32).tiny,
                             torch.finfo(torch.float32).max, 1e-45, 1e-40])
    cases = [normal, torch.zeros(n), -torch.zeros(n)]
    for zero_frac in (0.01, 0.5, 0.99):
        x = normal.clone()
        x[torch.rand(n, generator=g) < zero_frac] = 0.0
        cases.append(x)
        y = x.clone()
        y[torch.randint(0, n, (3,), generator=g)] = -0.0
        cases.append(y)
        for s in specials[4:]:  # one bad value in a tensor of zeros and normals
            z = x.clone()
            z[int(torch.randint(0, n, (1,), generator=g))] = s
            cases.append(z)
    for x in cases:
        for off, length in ((0, n), (1, n - 1), (13, 4099), (4096, 300)):
            v = x[off:off + length]
            assert torch.equal(_bits(exact_sqrt(v)), _bits(v.sqrt()))
    # Tensors of the optimizer state come wrapped; their .sqrt() is exact_sqrt, everything else plain torch.
    w = cases[3].clone().as_subclass(FastSqrtState)
    assert torch.equal(_bits(w.sqrt()), _bits(cases[3].sqrt()))
    assert type(w.mul_(2.0)) is FastSqrtState and type(w * 2) is torch.Tensor


def test_elements_do_not_influence_each_others_sqrt() -> None:
    """What exact_sqrt and the chunking rely on: torch's CPU sqrt of an element depends on nothing else in the
    tensor (not its neighbours' values, offset, or the tensor's length)."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1 << 20, generator=g) * 1e-3
    ref = x.sqrt()
    for stride in (2, 3, 16, 17):
        y = x.clone()
        y[::stride] = 0.0
        keep = y != 0
        assert torch.equal(y.sqrt()[keep], ref[keep])
    for off in (1, 7, 4096, 65537):
        assert torch.equal(x[off:].sqrt(), ref[off:])
        assert torch.equal(x[: off + 100].sqrt(), ref[: off + 100])
