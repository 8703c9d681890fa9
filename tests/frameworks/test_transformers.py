"""transformers' Trainer (with accelerate) with lowdiff (lowdiff.integrations.transformers.LowDiffTrainer): a run that
crashes mid-epoch and is resumed by a fresh Trainer from the lowdiff run directory ends bit for bit where the
uninterrupted run ends (torch.equal on parameters, optimizer state and learning rate, == on the scheduler's state),
with the Trainer's own scheduler or one passed in."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'lowdiff[integrations]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'lowdiff[integrations]')")

import lowdiff  # noqa: E402
from lowdiff.integrations.transformers import LowDiffTrainer  # noqa: E402

HERE = Path(__file__).resolve()
MAX_STEPS = 13  # 40 samples, batches of 8: 5 steps per epoch


class Crash(RuntimeError):
    pass


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class CrashAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise Crash(f"crash before step {self.step + 1}")


class KillAt(transformers.TrainerCallback):
    """SIGKILL of the trainer as step ``step + 1`` begins: during the next forward pass, as a preemption lands."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def train(tmp_path: Path, run: str, *, own_scheduler: bool, compressor: str = "none", crash_at: int | None = None,
          at: str = "latest", eval_every: int | None = None, kill_at: int | None = None) -> LowDiffTrainer:
    model = Net()
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=2e-2), model,
                       {"run_dir": str(tmp_path / run), "compressor": {"name": compressor, "ratio": 0.3},
                        "snapshot": {"every_steps": 4}, "log": {"batch_steps": 3}})
    sched = None if own_scheduler else torch.optim.lr_scheduler.MultiStepLR(opt, [3, 9], 0.5)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"{run}-out"), max_steps=MAX_STEPS, per_device_train_batch_size=8,
        learning_rate=2e-2, lr_scheduler_type="cosine", warmup_steps=3, save_strategy="no", report_to=[],
        logging_steps=1000, disable_tqdm=True, use_cpu=True, seed=11, dataloader_num_workers=0,
        **({} if eval_every is None else {"eval_strategy": "steps", "eval_steps": eval_every}))
    trainer = LowDiffTrainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, sched),
                             eval_dataset=None if eval_every is None else torch.utils.data.Subset(Data(), range(12)),
                             callbacks=([CrashAt(crash_at)] if crash_at is not None else [])
                             + ([KillAt(kill_at)] if kill_at is not None else []),
                             lowdiff_resume_at=at)
    try:
        trainer.train()
    finally:
        if crash_at is None:
            trainer.lowdiff_optimizer.close()
    return trainer


def assert_same_end(ref: LowDiffTrainer, got: LowDiffTrainer) -> None:
    assert got.state.global_step == ref.state.global_step == MAX_STEPS
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, got.model.state_dict()[k]), k
    o1, o2 = ref.lowdiff_optimizer.inner.state_dict(), got.lowdiff_optimizer.inner.state_dict()
    assert o1["param_groups"] == o2["param_groups"]
    for i, st in o1["state"].items():
        for k, v in st.items():
            assert torch.equal(v, o2["state"][i][k]), (i, k)
    assert ref.lr_scheduler.state_dict() == got.lr_scheduler.state_dict()


@pytest.mark.parametrize("own_scheduler", [True, False], ids=["trainer-scheduler", "scheduler-passed-in"])
def test_trainer_crash_resume_is_exact(tmp_path: Path, own_scheduler: bool) -> None:
    ref = train(tmp_path, "ref", own_scheduler=own_scheduler)
    assert ref.lowdiff_start == 0 and lowdiff.recover(tmp_path / "ref").step == MAX_STEPS
    with pytest.raises(Crash):
        train(tmp_path, "run", own_scheduler=own_scheduler, crash_at=7)
    got = train(tmp_path, "run", own_scheduler=own_scheduler)
    # The crash came before step 8's optimizer step: an exception drops the iteration in progress (step 7's), and
    # the resume redoes it.
    assert got.lowdiff_start == 6
    assert_same_end(ref, got)


_KILLED_CHILD = """
import sys
from pathlib import Path
import test_transformers as t
t.train(Path(sys.argv[1]), "run", own_scheduler=True, kill_at=7)
"""


def test_a_trainer_killed_after_a_steps_end_keeps_that_step(tmp_path: Path) -> None:
    """SIGKILL as step 8 begins: step 7's iteration had ended (its scheduler step, logging, evaluation and saving
    are done once the next step begins), the persistence process was told so then, and keeps it; the resume
    continues from step 7, exactly."""
    ref = train(tmp_path, "ref", own_scheduler=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parents[2])])}
    proc = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    got = train(tmp_path, "run", own_scheduler=True)  # waits for the dead trainer's persistence process
    assert got.lowdiff_start == 7
    assert_same_end(ref, got)


def test_topk_resume_at_snapshot_is_exact(tmp_path: Path) -> None:
    ref = train(tmp_path, "ref", own_scheduler=True, compressor="topk")
    with pytest.raises(Crash):
        train(tmp_path, "run", own_scheduler=True, compressor="topk", crash_at=11)
    got = train(tmp_path, "run", own_scheduler=True, compressor="topk", at="snapshot")
    assert got.lowdiff_start == 8
    assert_same_end(ref, got)


@pytest.mark.parametrize("crash_at", [5, 7])
def test_evaluation_every_few_steps_resumes_exactly(tmp_path: Path, crash_at: int) -> None:
    """An evaluation every 2 steps draws from torch's generator (its DataLoader iterator takes a seed) between two
    training steps, and the resumed Trainer does not evaluate again: the RNG state is taken after it."""
    ref = train(tmp_path, "ref", own_scheduler=True, eval_every=2)
    with pytest.raises(Crash):
        train(tmp_path, "run", own_scheduler=True, crash_at=crash_at, eval_every=2)
    got = train(tmp_path, "run", own_scheduler=True, eval_every=2)
    assert got.lowdiff_start == crash_at - 1
    assert_same_end(ref, got)


def test_a_finished_run_trained_again_takes_no_step(tmp_path: Path) -> None:
    """The script run again after its train() had reached max_steps (a crash while saving the model afterwards):
    the Trainer, resumed at max_steps through its checkpoint path, trained one step past it (the stock Trainer does
    the same with its own checkpoint), so the optimizer state and the log went on to step 14."""
    ref = train(tmp_path, "run", own_scheduler=True)
    state = copy.deepcopy(ref.lowdiff_optimizer.inner.state_dict())
    again = train(tmp_path, "run", own_scheduler=True)
    assert again.lowdiff_start == MAX_STEPS and again.state.global_step == MAX_STEPS
    assert lowdiff.recover(tmp_path / "run").step == MAX_STEPS
    for i, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(v, again.lowdiff_optimizer.inner.state_dict()["state"][i][k]), (i, k)
