"""Resume: a fresh model + optimizer wrapped on an existing run directory continues exactly."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
from torch.optim.optimizer import register_optimizer_step_post_hook

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
    """Top-k between snapshots after a clean close: params/optimizer exact at the resumed step, and the residuals
    come back from the stop file (after a crash they restart: tests/integration/test_clean_stop.py)."""
    scenario = Scenario(compressor="topk", every_steps=5, batch_steps=3, scheduler=False)
    t = train_run(scenario, tmp_path / "run", 7)
    again = start(scenario, tmp_path / "run", resume=False)
    assert again.opt.resume() == 7
    assert_state_equal(*t.refs[7], _live(again))
    want, got = t.opt.compressor.state_dict(), again.opt.compressor.state_dict()
    assert want and set(got) == set(want)
    assert all(torch.equal(got[k]["residual"], want[k]["residual"]) for k in want)
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


def test_second_wrap_in_the_same_process_closes_the_first(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A notebook cell run again: the earlier wrapper of this process on the run directory is closed, its steps
    kept, and the new one resumes from them (another process's wrap is refused: RunLockedError,
    test_persist_process)."""
    first = start(Scenario(), run_dir)
    first.train(1, 2)
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        again = start(Scenario(), run_dir, resume=False)
    assert "closing that one first" in caplog.text
    assert issubclass(lowdiff.RunLockedError, RuntimeError)
    with pytest.raises(lowdiff.LowDiffError, match="after close"):
        first.train(3, 3)
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


class ClippedSGD(torch.optim.SGD):
    """Not one of torch.optim's: SGD whose step also clips the weights (a WGAN critic's), so replay repeats it."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.clamp_(-0.05, 0.05)
        return loss


OPTIMIZERS = {
    "clipped-sgd": lambda params: ClippedSGD(params, lr=0.05, momentum=0.9),
    # eps is a pair whose first element is None: the manifest check refused it, after training had written the run.
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.01),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_run_of_another_optimizer_resumes_exactly(tmp_path: Path, kind: str) -> None:
    """opt.resume() replays with the wrapped optimizer's own class where it is not one of torch.optim's. It used to
    look the class up among torch.optim's and refuse, telling the user to pass optimizer_class= to recover(), which
    resume() has no way to do. Adafactor (torch's) could not be read back at all."""

    def run(run_dir: Path, first: int, last: int) -> tuple[int, dict[int, tuple[dict, dict]]]:
        model = make_model("mlp_bn", 0)
        inner = OPTIMIZERS[kind](model.parameters())
        opt = lowdiff.wrap(inner, model, {"run_dir": str(run_dir), "snapshot": {"every_steps": 4},
                                          "log": {"batch_steps": 3}})
        start = opt.resume()
        assert start == first - 1
        refs = {}
        for k in range(first, last + 1):
            loss_for("mlp_bn", model, k, 0).backward()
            opt.step()
            opt.zero_grad()
            refs[k] = (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()))
        opt.close()
        return start, refs

    _, full = run(tmp_path / "full", 1, 10)
    run(tmp_path / "cut", 1, 6)
    _, resumed = run(tmp_path / "cut", 7, 10)
    for k in (7, 10):
        assert_state_equal(*full[k], SimpleNamespace(model=resumed[k][0], optimizer=resumed[k][1]))
    cls = ClippedSGD if kind == "clipped-sgd" else None
    assert_state_equal(*full[10], lowdiff.recover(tmp_path / "cut", optimizer_class=cls))


def test_an_optimizer_wrapping_another_is_refused_at_wrap(tmp_path: Path) -> None:
    """Replay rebuilds the optimizer from its class and defaults; a wrapper (accelerate's AcceleratedOptimizer)
    cannot be. Refused with what to do, instead of a run that cannot be resumed."""

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer
            self.param_groups, self.state, self.defaults = optimizer.param_groups, optimizer.state, optimizer.defaults

    model = make_model("mlp_bn", 0)
    with pytest.raises(lowdiff.UnsupportedError, match="wraps another optimizer"):
        lowdiff.wrap(Wrapper(torch.optim.SGD(model.parameters(), lr=0.1)), model, {"run_dir": str(tmp_path / "r")})


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


def test_resume_at_step_0_keeps_the_groups_a_scheduler_created_after_wrap_set(tmp_path: Path) -> None:
    """A crash inside iteration 1 resumes at step 0, whose snapshot wrap() took before the loop created its
    scheduler (OneCycleLR sets lr and adds initial_lr, max_lr, min_lr to the groups). Loading it dropped those
    keys (the scheduler's next step() raised KeyError; seen under Lightning with accumulate_grad_batches) and put
    back the lr wrap() saw. Resumed at step 0 the wrapper keeps the live state, and the run continues exactly like
    an uninterrupted one."""
    def make(run_dir: Path) -> tuple[torch.nn.Module, lowdiff.LowDiffOptimizer, torch.optim.lr_scheduler.LRScheduler]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model,
                           {"run_dir": str(run_dir), "snapshot": {"every_steps": 4}, "log": {"batch_steps": 2}})
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=20)
        opt.track(sched, "sched")
        return model, opt, sched

    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(k)) for k in range(6)]

    def train(model, opt, sched, first: int, last: int) -> None:
        for k in range(first, last + 1):
            model(batches[k - 1]).pow(2).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    ref = make(tmp_path / "ref")
    assert ref[1].resume() == 0
    train(*ref, 1, 6)
    ref[1].close()
    run = make(tmp_path / "run")
    assert run[1].resume() == 0
    train(*run, 1, 1)  # iteration 1 has not ended (no next step, no flush): a crash here loses it
    run[1].close(interrupted=True)
    got = make(tmp_path / "run")
    assert got[1].resume() == 0
    assert "initial_lr" in got[1].param_groups[0]
    train(*got, 1, 6)
    for k, v in ref[0].state_dict().items():
        assert torch.equal(v, got[0].state_dict()[k]), k
    assert got[2].state_dict() == ref[2].state_dict()
    ref_opt, got_opt = ref[1].inner.state_dict(), got[1].inner.state_dict()
    assert ref_opt["param_groups"] == got_opt["param_groups"]
    for i, st in ref_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got_opt["state"][i][k]), (i, k)
    got[1].close()


def _pretrained(model: torch.nn.Module) -> None:
    """Weights loaded after wrap(), as from a pretrained checkpoint."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.data.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + 1))  # through .data: no version


@pytest.mark.parametrize("shadow,persistence", [(False, "thread"), (True, "thread"), (True, "process")],
                         ids=["plain", "shadow", "shadow-process"])
def test_weights_loaded_after_wrap_are_what_recovery_replays_from(tmp_path: Path, shadow: bool,
                                                                 persistence: str) -> None:
    """Snapshot 0 is the state the first step starts from: weights loaded between wrap() and the first step are
    in it (recovery replayed every step from the weights wrap() saw: a silently wrong state at every step up to
    the first snapshot). With a shadow replica, the replica starts from them too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model,
                       {"run_dir": str(tmp_path / "run"), "snapshot": {"every_steps": 4, "shadow": shadow},
                        "log": {"batch_steps": 2, "persistence": persistence}})
    _pretrained(model)
    start_weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert opt.resume() == 0
    states = {}
    for k in range(1, 7):
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(k))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        states[k] = {n: v.clone() for n, v in model.state_dict().items()}
    opt.close()
    for k in (3, 4, 6):
        rec = lowdiff.recover(tmp_path / "run", step=k, workers=1)
        for n, v in states[k].items():
            assert torch.equal(rec.model[n], v), (k, n)
    rec0 = lowdiff.recover(tmp_path / "run", step=0, workers=1)
    for n, _ in model.named_parameters():
        assert torch.equal(rec0.model[n], start_weights[n]), n


def test_a_trainer_that_died_before_its_first_step_resumes_from_the_weights_loaded_again(tmp_path: Path) -> None:
    """Died between wrap() and the first step (an out-of-memory first forward): the restarted script wraps, loads
    its pretrained weights again and resumes at step 0, which keeps them (loading snapshot 0 put back the random
    initialization wrap() saw), then trains exactly like an uninterrupted run."""
    def make(run_dir: Path, seed: int) -> tuple[torch.nn.Module, lowdiff.LowDiffOptimizer]:
        torch.manual_seed(seed)  # a different random init each time: only the loaded weights are the same
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                           {"run_dir": str(run_dir), "snapshot": {"every_steps": 3}, "log": {"batch_steps": 2}})
        _pretrained(model)
        return model, opt

    def train(model: torch.nn.Module, opt: lowdiff.LowDiffOptimizer) -> None:
        for k in range(1, 6):
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(k))).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.close()

    ref_model, ref_opt = make(tmp_path / "ref", seed=1)
    assert ref_opt.resume() == 0
    train(ref_model, ref_opt)
    _, dead = make(tmp_path / "run", seed=2)
    dead.close(interrupted=True)  # wrapped, never stepped
    model, opt = make(tmp_path / "run", seed=3)
    assert opt.resume() == 0
    train(model, opt)
    for n, v in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[n], v), n
    rec = lowdiff.recover(tmp_path / "run", workers=1)
    assert rec.step == 5
    for n, v in ref_model.state_dict().items():
        assert torch.equal(rec.model[n], v), n


def test_snapshot_0_is_not_written_again_when_nothing_changed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = lowdiff.wrap(torch.optim.Adam(model.parameters()), model, {"run_dir": str(tmp_path / "run")})
    snap0 = next((tmp_path / "run" / "snapshots").iterdir())
    before = snap0.stat().st_ino
    assert opt.resume() == 0
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.close()
    assert snap0.stat().st_ino == before  # an atomic rewrite would be a new file


def _reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "outside the optimizer step" in r.getMessage()]


def test_weights_clipped_between_steps_are_reported_at_the_next_step(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Recovery replays optimizer steps only: a clamp of every weight after opt.step() (a WGAN critic's) is not in
    the log. lowdiff cannot log it, but says so at the next step, once per run."""
    t = start(Scenario(compressor="none", scheduler=False), tmp_path / "run")
    names = [n for n, _ in t.model.named_parameters()]
    with caplog.at_level("WARNING", logger="lowdiff"):
        t.train(1, 20)
        assert _reports(caplog) == []  # an ordinary loop, full checks included (one step in 16)

        def clip(_: int) -> None:
            with torch.no_grad():
                for p in t.model.parameters():
                    p.clamp_(-0.5, 0.5)

        t.train(21, 40, on_step=clip)
        t.opt.close()
    (report,) = _reports(caplog)
    assert "between opt.step() 21 and 22" in report and repr(names[0]) in report


def test_a_write_to_one_layer_every_step_is_reported_within_a_full_check(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Every step checks the first and the last parameter; one step in 16 checks them all."""
    t = start(Scenario(compressor="none", scheduler=False), tmp_path / "run")
    names = [n for n, _ in t.model.named_parameters()]
    middle = names[len(names) // 2]
    assert middle not in (names[0], names[-1])
    with caplog.at_level("WARNING", logger="lowdiff"):
        t.train(1, 20, on_step=lambda k: dict(t.model.named_parameters())[middle].detach().mul_(1.0))
        t.opt.close()
    (report,) = _reports(caplog)
    assert "between opt.step() 15 and 16" in report and repr(middle) in report


def _hook_runs(tmp_path: Path, register: Any, steps: int = 6) -> tuple[Trainer, lowdiff.Recovered]:
    t = start(Scenario(compressor="none", scheduler=False), tmp_path / "run")
    register(t)
    t.train(1, steps)
    t.opt.close()
    return t, lowdiff.recover(tmp_path / "run", workers=1)


def _halve_grads(model: torch.nn.Module) -> Any:
    def pre(*_: Any) -> None:
        for p in model.parameters():
            p.grad.mul_(0.5)
    return pre


def _clamp(model: torch.nn.Module) -> Any:
    def post(*_: Any) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)
    return post


def test_a_pre_hook_on_lowdiffs_optimizer_changes_the_gradient_the_log_holds(tmp_path: Path) -> None:
    """It runs before the gradient is taken, as torch runs pre-hooks before the step: the replay is exact (the
    hook ran after the gradient was staged, so the log held the gradient before it)."""
    t, rec = _hook_runs(tmp_path, lambda t: t.opt.register_step_pre_hook(_halve_grads(t.model)))
    assert_state_equal(*t.refs[6], rec)


def test_a_post_hook_on_lowdiffs_optimizer_that_writes_weights_is_reported(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="lowdiff"):
        _hook_runs(tmp_path, lambda t: t.opt.register_step_post_hook(_clamp(t.model)))
    (report,) = _reports(caplog)
    assert "between opt.step() 1 and 2" in report


@pytest.mark.parametrize("kind", ["pre", "post", "global"])
def test_step_hooks_inside_the_inner_optimizers_step_are_reported(tmp_path: Path, kind: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """They run where lowdiff sees nothing (the gradient already taken, the parameters not yet watched), and no
    replay runs them: the recovered state differs, so lowdiff must say so. torch.profiler's own global post-hook,
    registered when it is imported, is not reported."""
    import torch.profiler  # noqa: F401  (its observer hook is installed)

    def register(t: Trainer) -> None:
        if kind == "pre":
            t.inner.register_step_pre_hook(_halve_grads(t.model))
        elif kind == "post":
            t.inner.register_step_post_hook(_clamp(t.model))
        else:
            handles.append(register_optimizer_step_post_hook(_clamp(t.model)))

    handles: list[Any] = []
    try:
        with caplog.at_level("WARNING", logger="lowdiff"):
            t, rec = _hook_runs(tmp_path, register)
    finally:
        for h in handles:
            h.remove()
    reports = [r.getMessage() for r in caplog.records if "optimizer step hook(s)" in r.getMessage()]
    assert len(reports) == 1 and ("_clamp" in reports[0] or "_halve_grads" in reports[0]), reports
    assert "profiler" not in reports[0]
    with pytest.raises(AssertionError):  # what the warning is for
        assert_state_equal(*t.refs[6], rec)


def test_no_hook_report_in_an_ordinary_loop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch.profiler  # noqa: F401

    with caplog.at_level("WARNING", logger="lowdiff"):
        _hook_runs(tmp_path, lambda t: None)
    assert not [r for r in caplog.records if "optimizer step hook(s)" in r.getMessage()]


@pytest.mark.parametrize("how", ["clear", "zero", "load_state_dict"])
def test_optimizer_state_changed_between_steps_is_reported(tmp_path: Path, how: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Adam's moments reset (state.clear(), a moment zeroed) or rolled back through the inner optimizer's
    load_state_dict() (which replaces the state mapping) between two steps: no replay repeats it."""
    t = start(Scenario(compressor="none", scheduler=False), tmp_path / "run")
    t.train(1, 3)
    old = copy.deepcopy(t.inner.state_dict())
    t.train(4, 6)
    if how == "clear":
        t.inner.state.clear()
    elif how == "zero":
        for st in t.inner.state.values():
            st["exp_avg"].zero_()
    else:
        t.inner.load_state_dict(old)
    with caplog.at_level("WARNING", logger="lowdiff"):
        t.train(7, 8)
        t.opt.close()
    (report,) = _reports(caplog)
    assert "the optimizer state of parameter(s)" in report and "between opt.step() 6 and 7" in report


def test_a_model_cast_after_wrap_is_refused_at_the_next_step(tmp_path: Path) -> None:
    """model.to(bfloat16) after wrap() replaces each parameter's .data: trained on, every snapshot and segment would
    hold tensors the manifest does not describe, and recovery refused them all as damaged files."""
    t = start(Scenario(compressor="none", scheduler=False), tmp_path / "run")
    t.train(1, 3)
    t.model.to(torch.bfloat16)
    with pytest.raises(lowdiff.ModelMismatchError, match="bfloat16.*recorded it as float32.*after wrap"):
        t.opt.step()
    t.opt.close()
    assert lowdiff.recover(tmp_path / "run").step == 3


def test_a_second_open_optimizer_at_resume_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two wrapped optimizers in one process (a GAN's): each resume() restores the process's RNG state from its own
    run, so the order matters; lowdiff says so."""
    scenario = Scenario(compressor="none", scheduler=False)
    for name in ("d", "g"):
        train_run(scenario, tmp_path / name, 3)
    first = start(scenario, tmp_path / "d", resume=False)
    second = start(scenario, tmp_path / "g", resume=False)
    try:
        with caplog.at_level("WARNING", logger="lowdiff"):
            assert first.opt.resume() == 3 and second.opt.resume() == 3
    finally:
        first.opt.close()
        second.opt.close()
    said = [r.getMessage() for r in caplog.records if "lowdiff optimizers are open in this process" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith("lowdiff: 2 lowdiff optimizers"), said


def test_one_optimizer_resumes_without_the_several_optimizers_note(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    scenario = Scenario(compressor="none", scheduler=False)
    train_run(scenario, tmp_path / "run", 3)
    with caplog.at_level("WARNING", logger="lowdiff"):
        t = start(scenario, tmp_path / "run")
        t.opt.close()
    assert not [r for r in caplog.records if "optimizers are open" in r.getMessage()]
