"""On a GPU (skipped without one): exact recovery with ``log.persistence: process``, no returned step lost when the
trainer is killed (but the last one while its copy from the GPU runs), and an AMP loop (autocast fp16 + GradScaler +
LR scheduler) resumed after SIGKILL equal to the uninterrupted run. The staging paths these exercise (pinned host
buffers, copies on a side stream, CUDA RNG state) exist only on a GPU; CI has none, so these run where a GPU is lent
(``bash bench/gpu.sh``; docs/measurements/gpu.md says when they last ran)."""

from __future__ import annotations

import dataclasses
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

if __name__ == "__main__":  # run as the killed trainer: the imports below live in tests/ and tests/integration/
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from lowdiff_harness import Scenario, assert_state_equal, to_cpu, train_run  # noqa: E402
from test_persist_process import SCENARIO, STEPS, _run_and_signal  # noqa: E402

import lowdiff  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
HERE = Path(__file__).resolve()
AMP_STEPS = 14


def _recover(run_dir: Path, **kw: Any) -> Any:
    rec = lowdiff.recover(run_dir, device="cuda", workers=1, **kw)
    rec.model, rec.optimizer = to_cpu(rec.model), to_cpu(rec.optimizer)
    return rec


@pytest.mark.parametrize("persistence", ["thread", "process"])
@pytest.mark.parametrize("compressor", ["topk", "powersgd", "none"])
def test_persistence_on_the_gpu_is_exact(tmp_path: Path, compressor: str, persistence: str) -> None:
    """Records and snapshots packed on the GPU (snapshots at 5 and 10: Adam's step counts stay on the CPU beside
    the packed GPU state) recover exactly, from a snapshot and from the log after one."""
    s = Scenario(compressor=compressor, device="cuda", clip=True, batch_steps=3, every_steps=5, scheduler=True,
                 persistence=persistence)
    t = train_run(s, tmp_path / "run", 14)
    for k in (14, 12, 7, 5, 1):
        assert_state_equal(*t.refs[k], _recover(tmp_path / "run", step=k))


def test_recovery_on_the_cpu_after_cuda_was_used_replays_in_one_process(tmp_path: Path) -> None:
    """Forked replay workers cannot use CUDA once this process has (torch's Adam asks CUDA about graph capture
    even for CPU tensors): recovery must say so and replay in this process, not fail in every worker."""
    torch.zeros(1, device="cuda")
    s = Scenario(model="branch", optimizer="adamw", compressor="topk", batch_steps=3, every_steps=4)
    t = train_run(s, tmp_path / "run", 7)
    rec = lowdiff.recover(tmp_path / "run", step=6, workers=2)
    assert rec.report.workers == 1 and "CUDA is initialized" in rec.report.mode
    assert_state_equal(*t.refs[6], rec)


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return train_run(dataclasses.replace(SCENARIO, device="cuda"), tmp_path_factory.mktemp("ref") / "run", STEPS)


@pytest.mark.parametrize("sig,kill_after", [(signal.SIGKILL, 5), (signal.SIGKILL, 17), (signal.SIGTERM, 9)])
def test_killed_gpu_trainer_loses_at_most_the_step_still_copying(tmp_path: Path, gpu_reference: Any, sig: int,
                                                   kill_after: int) -> None:
    returned = _run_and_signal(tmp_path / "run", kill_after, sig, scenario=dataclasses.replace(SCENARIO, device="cuda"))
    rec = _recover(tmp_path / "run")
    # The step returned last is handed over once its copy from the GPU has completed, without waiting for it: a
    # kill while that copy runs loses that one step (docs/guide/durability.md).
    assert returned - 1 <= rec.step <= returned + 1, f"signal {sig} after step {returned}; recovered {rec.step}"
    assert_state_equal(*gpu_reference.refs[rec.step], rec)


def amp_loop(run_dir: Path, *, compressor: str, persistence: str, enabled: bool = True,
             kill_at: int | None = None) -> dict[str, Any]:
    """A user's mixed-precision loop: autocast fp16, GradScaler, OneCycleLR, dropout; iterations 4 and 9 overflow
    (the scaler skips their steps). ``kill_at``: SIGKILL this process after that iteration's ``opt.step()``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 8)).cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = lowdiff.wrap(inner, model, {"run_dir": str(run_dir), "enabled": enabled,
                                      "compressor": {"name": compressor, "ratio": 0.1, "rank": 2},
                                      "snapshot": {"every_steps": 5},
                                      "log": {"batch_steps": 2, "persistence": persistence}})
    sched = opt.track(torch.optim.lr_scheduler.OneCycleLR(inner, max_lr=0.01, total_steps=AMP_STEPS + 1),
                      "lr_scheduler")
    scaler = opt.track(torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3), "scaler")
    # Top-k's error-feedback residuals are exact only at snapshot steps: resume there (docs/guide/exact-resume.md).
    start = opt.resume(at="snapshot" if compressor == "topk" else "latest")
    losses = {}
    for it in range(start + 1, AMP_STEPS + 1):
        g = torch.Generator(device="cuda").manual_seed(it)
        x = torch.randn(64, 32, device="cuda", generator=g)
        y = torch.randint(0, 8, (64,), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        losses[it] = loss.item()
        if it in (4, 9):
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if it == kill_at:
            signal.raise_signal(signal.SIGKILL)
        sched.step()
    opt.close()
    return {"start": start, "losses": losses, "model": to_cpu(model.state_dict()),
            "optimizer": to_cpu(inner.state_dict()), "scheduler": sched.state_dict(), "scaler": scaler.state_dict()}


@pytest.mark.parametrize("persistence", ["thread", "process"])
@pytest.mark.parametrize("compressor", ["topk", "none"])
def test_amp_loop_resumed_after_sigkill_equals_the_uninterrupted_run(tmp_path: Path, compressor: str,
                                                                      persistence: str) -> None:
    ref = amp_loop(tmp_path / "ref", compressor=compressor, persistence=persistence, enabled=False)
    assert ref["scaler"]["scale"] != 2.0**10  # the skips moved the scale
    killed = subprocess.run([sys.executable, str(HERE), str(tmp_path / "run"), compressor, persistence, "11"],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    got = amp_loop(tmp_path / "run", compressor=compressor, persistence=persistence)
    # A thread loses what it had not committed; the persistence process keeps every returned step (10: iteration
    # 11 had not ended, and the scheduler is tracked at its end). Top-k resumes at a snapshot step (5 or 10).
    if compressor == "topk":
        assert got["start"] in ((5, 10) if persistence == "thread" else (10,)), got["start"]
    else:
        assert 0 < got["start"] <= 10 and (persistence == "thread" or got["start"] == 10), got["start"]
    for it, loss in got["losses"].items():
        assert loss == ref["losses"][it], it
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    for i, st in ref["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["optimizer"]["state"][i][k]), (i, k)
    assert ref["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]
    assert got["scheduler"] == ref["scheduler"] and got["scaler"] == ref["scaler"]


if __name__ == "__main__":  # the killed trainer of the AMP test
    amp_loop(Path(sys.argv[1]), compressor=sys.argv[2], persistence=sys.argv[3], kill_at=int(sys.argv[4]))
