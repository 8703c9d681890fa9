"""Resume: a fresh model + optimizer wrapped on an existing run directory continues exactly."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lowdiff_harness import (
    Scenario,
    Trainer,
    assert_state_equal,
    loss_for,
    make_model,
    make_optimizer,
    start,
    train_run,
)

import lowdiff


def _live(t: Trainer) -> SimpleNamespace:
    return SimpleNamespace(model=t.model.state_dict(), optimizer=t.inner.state_dict())


RESUMES = [
    # compressor none resumes exactly anywhere: 7 is between snapshots (every 5) and mid-segment (batch 3).
    pytest.param(Scenario(model="mlp_bn", optimizer="sgd_nesterov", compressor="none", every_steps=5,
                          batch_steps=3, scheduler=False), id="none-sgd-between-snapshots"),
    pytest.param(Scenario(model="tied", optimizer="adamw", groups=2, compressor="none", every_steps=4,
                          batch_steps=2, codec="zstd", scheduler=False, clip=True), id="none-adamw-tied"),
    pytest.param(Scenario(model="branch", optimizer="adam", compressor="none", every_steps=100, batch_steps=4,
                          codec="lz4", scheduler=False), id="none-adam-no-snapshot-since-0"),
    # Compressors with memory resume exactly at a snapshot step (their residuals are in the snapshot).
    pytest.param(Scenario(model="mlp_bn", optimizer="adamw", compressor="topk", ratio=0.25, every_steps=7,
                          batch_steps=3, scheduler=False), id="topk-at-snapshot"),
    pytest.param(Scenario(model="frozen", optimizer="sgd", compressor="powersgd", rank=2, every_steps=7,
                          batch_steps=4, scheduler=False), id="powersgd-at-snapshot"),
]


@pytest.mark.parametrize("scenario", RESUMES)
def test_resume_after_close_continues_like_an_uninterrupted_run(tmp_path: Path, scenario: Scenario) -> None:
    ref = train_run(scenario, tmp_path / "ref", 12)

    first = start(scenario, tmp_path / "run")
    first.train(1, 7)
    first.opt.close()
    assert first.opt.durable_step == 7

    second = start(scenario, tmp_path / "run", resume=False)  # fresh model, optimizer, compressor
    assert second.opt.resume() == 7
    assert second.opt.step_count == 7
    assert_state_equal(*ref.refs[7], _live(second))
    for k in range(8, 13):
        second.step(k)
        assert_state_equal(*ref.refs[k], _live(second))
    second.opt.close()

    # The run directory now holds one log across the restart: every step recovers exactly.
    for k in (0, 5, 7, 8, 10, 12):
        assert_state_equal(*ref.refs[k], lowdiff.recover(tmp_path / "run", step=k, workers=1))
    assert lowdiff.recover(tmp_path / "run").step == 12


def test_resume_between_snapshots_is_exact_at_the_resumed_step_for_topk(tmp_path: Path) -> None:
    """Top-k between snapshots: params/optimizer exact at the resumed step; residuals restart (documented)."""
    scenario = Scenario(compressor="topk", every_steps=5, batch_steps=3, scheduler=False)
    t = train_run(scenario, tmp_path / "run", 7)
    again = start(scenario, tmp_path / "run", resume=False)
    assert again.opt.resume() == 7
    assert_state_equal(*t.refs[7], _live(again))
    assert again.opt.compressor.state_dict() == {}
    again.opt.close()


def test_resume_on_a_new_run_dir_returns_zero(run_dir: Path) -> None:
    t = start(Scenario(), run_dir, resume=False)
    assert t.opt.resume() == 0
    assert t.opt.resume() == 0  # idempotent before the first step
    t.train(1, 2)
    t.opt.close()
    assert lowdiff.recover(run_dir).step == 2


def test_flush_makes_every_step_durable(run_dir: Path) -> None:
    t = start(Scenario(batch_steps=4, every_steps=100), run_dir)
    t.train(1, 6)
    assert t.opt.flush() == 6
    assert t.opt.durable_step == 6
    # Readable while the trainer is still open.
    assert_state_equal(*t.refs[6], lowdiff.recover(run_dir, workers=1))
    t.opt.close()
    t.opt.close()  # idempotent


def test_step_without_resume_raises(run_dir: Path) -> None:
    train_run(Scenario(), run_dir, 3)
    t = start(Scenario(), run_dir, resume=False)
    loss_for("mlp_bn", t.model, 4, 0).backward()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(lowdiff.LowDiffError, match="resume"):
        t.opt.step()
    # Nothing was applied, nothing was logged.
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    assert t.inner.state_dict()["state"] == {}
    t.opt.close()
    assert lowdiff.recover(run_dir).step == 3


def test_step_after_close_raises(run_dir: Path, train, assert_state_equal) -> None:
    """(Also exercises the conftest fixtures.)"""
    t = train(Scenario(), run_dir, 2)
    with pytest.raises(lowdiff.LowDiffError, match="close"):
        t.opt.step()
    assert_state_equal(*t.refs[2], lowdiff.recover(run_dir))


def test_second_wrap_on_an_open_run_dir_is_refused(run_dir: Path) -> None:
    first = start(Scenario(), run_dir)
    first.train(1, 2)
    with pytest.raises(lowdiff.RunLockedError):
        start(Scenario(), run_dir, resume=False)
    assert issubclass(lowdiff.RunLockedError, RuntimeError)
    first.opt.close()
    # Released on close: the run can be reopened (and must be resumed).
    again = start(Scenario(), run_dir, resume=False)
    assert again.opt.resume() == 2
    again.opt.close()


def test_wrap_with_a_different_model_is_refused(run_dir: Path) -> None:
    train_run(Scenario(model="mlp_bn"), run_dir, 2)
    with pytest.raises(lowdiff.ModelMismatchError, match="new run_dir"):
        start(Scenario(model="branch"), run_dir, resume=False)


def test_failed_wrap_releases_the_run_dir(run_dir: Path) -> None:
    train_run(Scenario(model="mlp_bn"), run_dir, 2)
    with pytest.raises(lowdiff.ModelMismatchError):
        start(Scenario(model="branch"), run_dir, resume=False)
    t = start(Scenario(model="mlp_bn"), run_dir, resume=False)  # the right model now: must be accepted
    assert t.opt.resume() == 2
    t.opt.close()


def test_recover_errors(tmp_path: Path) -> None:
    with pytest.raises(lowdiff.RunDirNotFoundError):
        lowdiff.recover(tmp_path / "absent")
    with pytest.raises(FileNotFoundError):  # also the builtin
        lowdiff.recover(tmp_path)
    train_run(Scenario(), tmp_path / "run", 3)
    with pytest.raises(lowdiff.StepNotAvailableError, match="step 4"):
        lowdiff.recover(tmp_path / "run", step=4)
    with pytest.raises(lowdiff.StepNotAvailableError):
        lowdiff.recover(tmp_path / "run", step=-1)


def test_retention_keeps_the_newest_snapshots_and_their_log(run_dir: Path) -> None:
    scenario = Scenario(every_steps=3, batch_steps=2, scheduler=False)
    cfg = scenario.config(run_dir)
    cfg["snapshot"]["keep"] = 2
    model = make_model("mlp_bn", 0)
    inner = make_optimizer("adamw", model, "mlp_bn", 1)
    t = Trainer(scenario, model, inner, lowdiff.wrap(inner, model, cfg), None)
    t.opt.resume()
    t.record(0)
    t.train(1, 10)
    t.opt.close()
    snaps = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    assert snaps == ["step-0000000006.h5", "step-0000000009.h5"]
    for k in range(6, 11):
        assert_state_equal(*t.refs[k], lowdiff.recover(run_dir, step=k, workers=1))
    with pytest.raises(lowdiff.StepNotAvailableError):
        lowdiff.recover(run_dir, step=5)


def test_custom_optimizer_class_needs_explicit_permission(run_dir: Path) -> None:
    """Only torch.optim classes are imported from a run directory; others must be passed in."""

    class MySGD(torch.optim.SGD):
        pass

    model = make_model("mlp_bn", 0)
    inner = MySGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = lowdiff.wrap(inner, model, {"run_dir": str(run_dir), "log": {"batch_steps": 2}})
    opt.resume()
    for k in range(1, 4):
        loss_for("mlp_bn", model, k, 0).backward()
        opt.step()
        opt.zero_grad()
    ref = (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()))
    opt.close()
    with pytest.raises(lowdiff.UnsupportedError, match="optimizer_class"):
        lowdiff.recover(run_dir)
    assert_state_equal(*ref, lowdiff.recover(run_dir, optimizer_class=MySGD))


def test_disabled_writes_nothing_and_trains_the_same(tmp_path: Path) -> None:
    scenario = Scenario(compressor="topk", scheduler=False)
    ref = train_run(scenario, tmp_path / "ref", 4)
    model = make_model("mlp_bn", 0)
    inner = make_optimizer("adamw", model, "mlp_bn", 1)
    cfg = scenario.config(tmp_path / "off") | {"enabled": False}
    t = Trainer(scenario, model, inner, lowdiff.wrap(inner, model, cfg), None)
    assert t.opt.resume() == 0
    t.train(1, 4)
    assert t.opt.durable_step == 0
    t.opt.close()
    assert not (tmp_path / "off").exists()
    for k in range(1, 5):
        assert_state_equal(*ref.refs[k], SimpleNamespace(model=t.refs[k][0], optimizer=t.refs[k][1]))


def test_unsupported_optimizer_surface(run_dir: Path) -> None:
    t = start(Scenario(), run_dir)
    other = copy.deepcopy(t.inner.state_dict())
    other["param_groups"][0]["lr"] = 0.5
    with pytest.raises(lowdiff.UnsupportedError):
        t.opt.load_state_dict(other)
    t.opt.load_state_dict(t.inner.state_dict())  # the state it has (accelerate reloads it for device placement)
    with pytest.raises(lowdiff.UnsupportedError):
        t.opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(lowdiff.UnsupportedError, match="requires a closure"):
        lowdiff.wrap(torch.optim.LBFGS(t.model.parameters()), t.model, {"run_dir": str(run_dir.parent / "lbfgs")})
    assert isinstance(t.opt, torch.optim.Optimizer)
    with pytest.raises(lowdiff.LowDiffError, match="already wrapped"):
        lowdiff.wrap(t.opt, t.model, {"run_dir": str(run_dir.parent / "other")})  # type: ignore[arg-type]
    assert t.opt.param_groups is t.inner.param_groups and t.opt.state is t.inner.state
    t.opt.close()


def test_sparse_gradients_are_refused(run_dir: Path) -> None:
    model = torch.nn.Embedding(10, 4, sparse=True)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, {"run_dir": str(run_dir)})
    opt.resume()
    model(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(lowdiff.UnsupportedError, match="sparse"):
        opt.step()
    opt.close()
