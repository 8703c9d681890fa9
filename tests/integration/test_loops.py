"""Exact resume in training loops as users write them (issue 19): LR schedulers and a GradScaler tracked with
``opt.track`` come back as they were at the END of the resumed iteration, iterations a GradScaler skipped count,
Top-k and PowerSGD continue bit for bit from a snapshot step (``resume(at="snapshot")``), and an iteration
interrupted by an exception is redone.

Every case is the README's loop, killed with SIGKILL in the middle of an iteration (after ``opt.step()``, before
``sched.step()``) in a forked child, resumed here with fresh objects and finished; the result equals the
uninterrupted run (``torch.equal`` on parameters and optimizer state, ``==`` on lr, scheduler and scaler state and
on every later step's loss).

The file is also the child of the interrupted-by-an-exception case: ``python test_loops.py RESULT RUN_DIR KWARGS``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lowdiff_harness import wait_for_persistence_exit
from torch import nn
from torch.optim import lr_scheduler as L

import lowdiff

STEPS = 16
HERE = Path(__file__).resolve()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 24)
        self.bn = nn.BatchNorm1d(24)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def make_scheduler(kind: str, opt: torch.optim.Optimizer) -> Any:
    if kind == "linear":  # a warm-up
        return L.LinearLR(opt, start_factor=0.1, total_iters=5)
    if kind == "multistep":  # milestones: a Counter with int keys
        return L.MultiStepLR(opt, [4, 9], 0.1)
    if kind == "sequential":
        return L.SequentialLR(opt, [L.LinearLR(opt, 0.2, total_iters=4), L.CosineAnnealingLR(opt, 10)], [4])
    if kind == "onecycle":  # cycles AdamW's beta1 too
        return L.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1)
    if kind == "cosine":
        return L.CosineAnnealingLR(opt, T_max=STEPS)
    if kind == "warm_restarts":
        return L.CosineAnnealingWarmRestarts(opt, T_0=5, T_mult=2)
    if kind == "cyclic":  # cycles SGD's momentum
        return L.CyclicLR(opt, 0.001, 0.05, step_size_up=3)
    if kind == "chained":
        return L.ChainedScheduler([L.ConstantLR(opt, 0.5, total_iters=3), L.ExponentialLR(opt, 0.9)])
    if kind == "lambda":
        return L.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.3 * e))
    if kind == "plateau":
        return L.ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=0.5)
    raise ValueError(kind)


def loop(run_dir: Path, *, sched: str = "cosine", compressor: str = "none", enabled: bool = True,
         attach: str = "inner", scaler: bool = False, skips: tuple[int, ...] = (), every_steps: int = 5,
         batch_steps: int = 2, flush_at: int | None = None, kill_at: int | None = None, raise_at: int | None = None,
         at: str = "latest", evaluate_every: int | None = None, persistence: str = "thread",
         compiled: bool = False, tensor_lr: bool = False) -> dict[str, Any]:
    """The README's loop (a fresh process's objects). ``kill_at``: SIGKILL this process in the middle of that
    iteration, after ``opt.step()`` and before ``sched.step()``; ``raise_at``: raise there instead;
    ``evaluate_every``: an evaluation that draws from the RNG at the end of every such iteration, followed by
    ``opt.capture_rng()``; ``compiled``: the loop trains ``torch.compile(model)`` (the eager backend: the same
    kernels, no compiler needed) and hands lowdiff that; ``tensor_lr``: the learning rate is a tensor, which the
    scheduler changes in place (``fill_``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Net()
        net = torch.compile(model, backend="eager") if compiled else model
        if sched == "cyclic":
            inner: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        else:
            lr: Any = torch.tensor(0.02) if tensor_lr else 0.02
            inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        opt = lowdiff.wrap(inner, net, {
            "run_dir": str(run_dir), "enabled": enabled, "compressor": {"name": compressor, "ratio": 0.3, "rank": 2},
            "snapshot": {"every_steps": every_steps}, "log": {"batch_steps": batch_steps, "persistence": persistence}})
        scheduler = make_scheduler(sched, opt if attach == "wrapper" else inner)
        opt.track(scheduler, "lr_scheduler")
        grad_scaler = None
        if scaler:
            grad_scaler = opt.track(torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2), "scaler")
        start = opt.resume(at=at)
        losses: dict[int, float] = {}
        for it in range(start + 1, STEPS + 1):
            g = torch.Generator().manual_seed(1000 + it)
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            loss = F.cross_entropy(net(x), y)
            losses[it] = loss.item()
            if it in skips:
                loss = loss * math.inf  # inf gradients: the scaler skips the step
            if grad_scaler is not None:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
            if it == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if it == raise_at:
                raise RuntimeError(f"interrupted in iteration {it}")
            if sched == "plateau":
                scheduler.step(losses[it])
            else:
                scheduler.step()
            if evaluate_every and it % evaluate_every == 0:
                model.eval()
                with torch.no_grad():
                    for _ in torch.utils.data.DataLoader(range(8), batch_size=4):  # its iterator draws a seed
                        model(torch.randn(4, 6))  # and the evaluation draws inputs
                model.train()
                opt.capture_rng()
            if it == flush_at:
                opt.flush()
        opt.close()
        return {"start": start, "losses": losses, "model": model.state_dict(), "optimizer": inner.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": grad_scaler.state_dict() if grad_scaler else None,
                "iteration": opt.iteration}
    finally:
        torch.set_num_threads(threads)


def crash(run_dir: Path, **kwargs: Any) -> None:
    """``loop`` in a forked child killed with SIGKILL (no close, nothing flushed after ``flush_at``); returns once
    its persistence process, if any, has committed what it held and exited (it holds RUN_DIR/persist-*.lock)."""
    pid = os.fork()
    if pid == 0:
        try:
            loop(run_dir, **kwargs)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child ended with status {status}"
    wait_for_persistence_exit(run_dir)


def assert_same_end(ref: dict[str, Any], got: dict[str, Any]) -> None:
    for it in range(got["start"] + 1, STEPS + 1):
        assert got["losses"][it] == ref["losses"][it], f"iteration {it}: {got['losses'][it]} != {ref['losses'][it]}"
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    assert ref["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]  # lr, betas/momentum, initial_lr
    for i, st in ref["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["optimizer"]["state"][i][k]), (i, k)
    assert got["scheduler"] == ref["scheduler"]
    assert got["scaler"] == ref["scaler"]
    assert got["iteration"] == ref["iteration"] == STEPS


SCHEDULERS = ["linear", "multistep", "sequential", "onecycle", "cosine", "warm_restarts", "cyclic", "chained",
              "lambda", "plateau"]


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_scheduler_comes_back_at_the_end_of_the_iteration(tmp_path: Path, sched: str) -> None:
    ref = loop(tmp_path / "ref", sched=sched, enabled=False)
    crash(tmp_path / "run", sched=sched, flush_at=6, kill_at=7)
    got = loop(tmp_path / "run", sched=sched)
    assert got["start"] == 6
    assert_same_end(ref, got)


def test_scheduler_attached_to_the_wrapper(tmp_path: Path) -> None:
    """The wrapper is a torch.optim.Optimizer: a scheduler accepts it (Lightning needs that)."""
    ref = loop(tmp_path / "ref", sched="sequential", attach="wrapper", enabled=False)
    crash(tmp_path / "run", sched="sequential", attach="wrapper", flush_at=5, kill_at=6)
    got = loop(tmp_path / "run", sched="sequential", attach="wrapper")
    assert got["start"] == 5
    assert_same_end(ref, got)


@pytest.mark.parametrize("before,after", [(True, False), (False, True), (True, True)])
def test_a_compiled_model_resumes_compiled_or_not(tmp_path: Path, before: bool, after: bool) -> None:
    """``torch.compile(model)`` names its parameters ``_orig_mod.*``: lowdiff records the model's own names, so a run
    trained compiled resumes into the plain model and the other way round, and recovery gives the plain names."""
    ref = loop(tmp_path / "ref", sched="onecycle", compressor="topk", enabled=False)
    crash(tmp_path / "run", sched="onecycle", compressor="topk", every_steps=3, flush_at=6, kill_at=7, compiled=before)
    assert set(lowdiff.recover(tmp_path / "run").model) == set(ref["model"])
    got = loop(tmp_path / "run", sched="onecycle", compressor="topk", every_steps=3, at="snapshot", compiled=after)
    assert got["start"] == 6
    assert_same_end(ref, got)


def test_iteration_ends_at_the_next_step_not_inside_this_one(tmp_path: Path) -> None:
    """No flush: each step's record is complete when the next opt.step() begins (batch_steps 1 writes it then)."""
    ref = loop(tmp_path / "ref", sched="multistep", enabled=False)
    crash(tmp_path / "run", sched="multistep", batch_steps=1, kill_at=9)
    rec = lowdiff.recover(tmp_path / "run")
    assert rec.step <= 8 and rec.end_groups is not None
    got = loop(tmp_path / "run", sched="multistep", batch_steps=1)
    assert got["start"] == rec.step
    assert_same_end(ref, got)


@pytest.mark.parametrize("kill_at,flush_at", [(5, 4), (8, 7), (10, 9)],
                         ids=["in-a-skip", "after-skips", "after-a-skip"])
def test_grad_scaler_skips_are_iterations(tmp_path: Path, kill_at: int, flush_at: int) -> None:
    """Iterations 3, 4 and 9 overflow: the scaler skips their optimizer steps and halves its scale. The log counts
    them as iterations (steps without gradients), so resume() returns the iteration to continue after."""
    kw: dict[str, Any] = {"sched": "multistep", "scaler": True, "skips": (3, 4, 9)}
    ref = loop(tmp_path / "ref", enabled=False, **kw)
    assert ref["scaler"]["scale"] != 2.0**8  # the scale moved (halved at the skips, doubled every 2 good steps)
    crash(tmp_path / "run", flush_at=flush_at, kill_at=kill_at, **kw)
    rec = lowdiff.recover(tmp_path / "run")
    assert rec.step == flush_at
    stepped = len([it for it in range(1, flush_at + 1) if it not in kw["skips"]])
    assert all(int(st["step"]) == stepped for st in rec.optimizer["state"].values())  # optimizer steps only
    got = loop(tmp_path / "run", **kw)
    assert got["start"] == flush_at
    assert_same_end(ref, got)


@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_a_tensor_learning_rate_and_a_grad_scaler_come_back_exactly(tmp_path: Path, persistence: str) -> None:
    """Both are logged as copies read later (lowdiff._transfer.scalars): what the log holds is their value at the
    end of each iteration, and a trainer killed before its scheduler's step loses only the iteration it was in."""
    kw: dict[str, Any] = {"sched": "lambda", "scaler": True, "skips": (3, 9), "tensor_lr": True,
                          "persistence": persistence, "batch_steps": 1}
    ref = loop(tmp_path / "ref", enabled=False, **kw)
    crash(tmp_path / "run", kill_at=8, **kw)
    rec = lowdiff.recover(tmp_path / "run")
    if persistence == "process":
        assert rec.step == 7  # its end was known when the process died: committed
    got = loop(tmp_path / "run", **kw)
    assert got["start"] == rec.step
    assert_same_end(ref, got)
    assert isinstance(got["optimizer"]["param_groups"][0]["lr"], torch.Tensor)


@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_resume_at_snapshot_is_exact_for_compressors(tmp_path: Path, compressor: str) -> None:
    """Between snapshots the error-feedback residuals restart at zero; resume(at="snapshot") goes back to the
    newest snapshot step (10), where they are exact, and the loop redoes 11-16 bit for bit."""
    ref = loop(tmp_path / "ref", sched="onecycle", compressor=compressor, enabled=False)
    crash(tmp_path / "run", sched="onecycle", compressor=compressor, flush_at=12, kill_at=13)
    assert lowdiff.recover(tmp_path / "run").step == 12
    got = loop(tmp_path / "run", sched="onecycle", compressor=compressor, at="snapshot")
    assert got["start"] == 10
    assert_same_end(ref, got)
    quarantined = sorted(p.name for p in (tmp_path / "run" / "quarantine").iterdir())
    assert quarantined and all(n.startswith("log-steps-") for n in quarantined)  # steps 11-12 set aside, not lost


def test_a_resume_between_snapshots_with_a_compressor_warns_that_it_is_not_bit_for_bit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The quickstart's plain resume() after a crash between snapshots: Top-k's residuals restart at zero, and the
    user must hear it at the default logging level (it was an INFO line)."""
    crash(tmp_path / "run", compressor="topk", flush_at=12, kill_at=13)
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        got = loop(tmp_path / "run", compressor="topk")
    assert got["start"] == 12
    assert any(r.levelno == logging.WARNING and "not bit for bit" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_evaluation_between_steps_is_not_repeated_by_the_resume(tmp_path: Path, persistence: str) -> None:
    """An evaluation after iteration 6 draws from torch's generator; the resumed run starts at 6 and does not
    evaluate again, so the RNG state logged for step 6 is the one after the evaluation (``opt.capture_rng()``):
    the dropout masks of iterations 7.. are the uninterrupted run's. In a persistence process the state taken
    again travels with the end of the iteration."""
    ref = loop(tmp_path / "ref", evaluate_every=3, persistence=persistence)
    # thread: step 6 is durable by the flush; process: the persistence process commits it when the trainer dies
    crash(tmp_path / "run", evaluate_every=3, persistence=persistence, kill_at=7,
          flush_at=6 if persistence == "thread" else None)
    got = loop(tmp_path / "run", evaluate_every=3, persistence=persistence)
    assert got["start"] == 6
    assert_same_end(ref, got)


def test_iteration_interrupted_by_an_exception_is_redone(tmp_path: Path) -> None:
    """An uncaught exception between opt.step() and sched.step() ends the script: at exit the iteration in progress
    is not logged (its scheduler state is unknown), so the resumed run redoes it."""
    ref = loop(tmp_path / "ref", sched="multistep", enabled=False)
    out = tmp_path / "child.json"
    cmd = [sys.executable, str(HERE), str(out), str(tmp_path / "run"),
           json.dumps({"sched": "multistep", "batch_steps": 1, "raise_at": 7})]
    path = os.pathsep.join([str(HERE.parents[2]), str(HERE.parents[1])])  # lowdiff, and lowdiff_harness
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 1 and "interrupted in iteration 7" in proc.stderr, proc.stderr[-3000:]
    assert "iteration 7 was interrupted" in proc.stderr
    assert lowdiff.recover(tmp_path / "run").step == 6
    got = loop(tmp_path / "run", sched="multistep")
    assert got["start"] == 6
    assert_same_end(ref, got)


def test_with_block_exception_drops_the_iteration(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = L.StepLR(inner, 1, 0.5)
    with pytest.raises(KeyError):
        with lowdiff.wrap(inner, model, {"run_dir": str(tmp_path / "run")}) as opt:
            opt.track(sched, "sched")
            opt.resume()
            for it in range(1, 4):
                model(torch.ones(1, 3)).sum().backward()
                opt.step()
                if it == 3:
                    raise KeyError("between opt.step() and sched.step()")
                sched.step()
    rec = lowdiff.recover(tmp_path / "run")
    assert rec.step == 2 and rec.data["sched"]["last_epoch"] == 2 and rec.end_groups[0]["lr"] == 0.025


@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_an_exception_after_the_iterations_end_calls_drops_it_too(tmp_path: Path, persistence: str) -> None:
    """The exception comes after ``sched.step()``: it may come from an evaluation whose random draws a resumed run
    would not repeat, so the iteration is dropped all the same and the resume redoes it, exactly."""
    model = nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = L.StepLR(inner, 1, 0.5)
    with pytest.raises(KeyError):
        with lowdiff.wrap(inner, model, {"run_dir": str(tmp_path / "run"),
                                         "log": {"persistence": persistence}}) as opt:
            opt.track(sched, "sched")
            opt.resume()
            for it in range(1, 4):
                model(torch.ones(1, 3)).sum().backward()
                opt.step()
                sched.step()
                if it == 3:
                    opt.end_iteration()  # says the end is known: a kill now would keep it, an exception does not
                    raise KeyError("after sched.step()")
    rec = lowdiff.recover(tmp_path / "run")
    assert rec.step == 2 and rec.data["sched"]["last_epoch"] == 2 and rec.end_groups[0]["lr"] == 0.025


class Unloggable:
    def __init__(self) -> None:
        self.seen: set[int] | int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def test_state_that_cannot_be_logged_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, {"run_dir": str(tmp_path / "run")})
    bad = Unloggable()
    bad.seen = {1, 2}
    with pytest.raises(lowdiff.UnsupportedError, match="Counter.*state_dict\\(\\) returns only those"):
        opt.track(bad, "bad")
    later = opt.track(Unloggable(), "later")
    opt.resume()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    later.seen = {3}  # becomes unloggable after opt.step(): refused when the iteration ends, the step still logged
    with pytest.raises(lowdiff.UnsupportedError, match="'later'"):
        opt.flush()
    opt.close()
    assert lowdiff.recover(tmp_path / "run").step == 1


def test_resume_with_other_settings_says_what_it_does(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another compressor is allowed (each segment records its own); other optimizer defaults are not followed (the
    run's logged hyperparameters come back). Both are said, not silently accepted."""
    loop(tmp_path / "run", sched="cosine", compressor="topk", kill_at=None)
    model = Net()
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.01), model,
                       {"run_dir": str(tmp_path / "run"), "compressor": {"name": "powersgd", "rank": 2}})
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert opt.resume() == STEPS
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "the compressor is {'name': 'powersgd'" in text and "'name': 'topk'" in text
    assert "lr 0.02 -> 0.5" in text and "restores the hyperparameters the run logged" in text
    assert opt.param_groups[0]["lr"] != 0.5
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    opt.close()
    # lowdiff inspect shows both: the run's first compressor (manifest) and the one its newest segment records.
    summary = lowdiff.inspect(tmp_path / "run").summary()
    assert "compressor: topk" in summary and "compressor of the newest segment: powersgd (ratio" in summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    result_path, run_dir, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    res = loop(run_dir, **kwargs)
    Path(result_path).write_text(json.dumps({"start": res["start"]}))
