"""Lightning 2.x with lowdiff (lowdiff.integrations.lightning): automatic and manual optimization, a scheduler
returned from configure_optimizers, global_step; a fit that crashes mid-run and is resumed by a fresh Trainer ends
bit for bit where the uninterrupted fit ends (torch.equal on parameters, optimizer state, lr and scheduler)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'lowdiff[integrations]')")

import lowdiff  # noqa: E402
from lowdiff.data import ResumableLoader, ResumableSampler  # noqa: E402
from lowdiff.integrations.lightning import LowDiffCallback  # noqa: E402

MAX_STEPS = 13  # 5 batches per epoch: the run crosses two epoch boundaries


class Crash(RuntimeError):
    pass


class Net(pl.LightningModule):
    def __init__(self, run_dir: Path, *, manual: bool, compressor: str, crash_at: int | None = None,
                 sched_frequency: int = 1) -> None:
        super().__init__()
        self.sched_frequency = sched_frequency
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 3))
        self.automatic_optimization = not manual
        self.cfg = {"run_dir": str(run_dir), "compressor": {"name": compressor, "ratio": 0.3},
                    "snapshot": {"every_steps": 4}, "log": {"batch_steps": 3}}
        self.crash_at = crash_at
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.crash_at is not None and self.trainer.global_step == self.crash_at:
            raise Crash(f"crash in step {self.crash_at + 1}")
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses[self.trainer.global_step + 1] = loss.item()
        if self.automatic_optimization:
            return loss
        assert isinstance(self.optimizers(use_pl_optimizer=False), lowdiff.LowDiffOptimizer)  # not a list
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return None

    def configure_optimizers(self) -> Any:
        opt = lowdiff.wrap(torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01), self, self.cfg)
        # attached to the wrapper, which Lightning was given; cycles AdamW's beta1 as well as lr
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=MAX_STEPS + 2)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": self.sched_frequency}}


class ValidatedNet(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))


def loader() -> ResumableLoader:
    g = torch.Generator().manual_seed(7)
    ds = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    return ResumableLoader(DataLoader(ds, batch_size=8, sampler=ResumableSampler(len(ds), seed=3)))


def fit(run_dir: Path, *, manual: bool, compressor: str, crash_at: int | None = None,
        at: str = "latest", accumulate: int = 1, val_every: int | None = None, sched_frequency: int = 1
        ) -> tuple[Net, pl.Trainer, LowDiffCallback]:
    pl.seed_everything(123, verbose=False)
    model = (Net if val_every is None else ValidatedNet)(run_dir, manual=manual, compressor=compressor,
                                                        crash_at=crash_at, sched_frequency=sched_frequency)
    callback = LowDiffCallback(at=at)
    val = {} if val_every is None else {"val_check_interval": val_every, "limit_val_batches": 2}
    trainer = pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, accumulate_grad_batches=accumulate, **val)
    if val_every is None:
        trainer.fit(model, train_dataloaders=loader())
    else:
        # Validation draws from the global RNG (a DataLoader iterator takes its seed from it): the training
        # batches after it start from a state opt.step() did not leave.
        trainer.fit(model, train_dataloaders=loader(), val_dataloaders=DataLoader(
            TensorDataset(torch.randn(12, 6), torch.randint(0, 3, (12,))), batch_size=6))
    return model, trainer, callback


def assert_same_end(ref: tuple[Net, pl.Trainer, LowDiffCallback], got: tuple[Net, pl.Trainer, LowDiffCallback]
                    ) -> None:
    (m1, t1, _), (m2, t2, cb) = ref, got
    assert t2.global_step == t1.global_step == MAX_STEPS
    assert t2.current_epoch == t1.current_epoch
    for k, v in m1.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    o1, o2 = t1.optimizers[0].state_dict(), t2.optimizers[0].state_dict()
    assert o1["param_groups"] == o2["param_groups"]  # lr and betas the scheduler set for the next step
    for i, st in o1["state"].items():
        for k, v in st.items():
            assert torch.equal(v, o2["state"][i][k]), (i, k)
    assert t1.lr_scheduler_configs[0].scheduler.state_dict() == t2.lr_scheduler_configs[0].scheduler.state_dict()
    for step in range(cb.start_step + 1, MAX_STEPS + 1):
        assert m2.losses[step] == m1.losses[step], step


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_fit_crash_resume_is_exact(tmp_path: Path, manual: bool) -> None:
    ref = fit(tmp_path / "ref", manual=manual, compressor="none")
    assert ref[1].global_step == MAX_STEPS  # global_step advances, so max_steps stops the fit
    assert lowdiff.recover(tmp_path / "ref").step == MAX_STEPS
    with pytest.raises(Crash):
        fit(tmp_path / "run", manual=manual, compressor="none", crash_at=7)
    got = fit(tmp_path / "run", manual=manual, compressor="none")
    # Automatic optimization: the crash came inside the closure, after step 7 was logged; manual: before step 8's
    # opt.step(), with step 7 not yet over (an exception drops the iteration in progress; step 7 is redone).
    assert got[2].start_step == (7 if not manual else 6)
    assert_same_end(ref, got)


@pytest.mark.parametrize("crash_at", [1, 2, 3, 5, 10])
def test_accumulated_gradients_resume_mid_epoch_exactly(tmp_path: Path, crash_at: int) -> None:
    """accumulate_grad_batches=2 over 5 batches an epoch: windows of 2, 2 and 1 batches (Lightning steps on an
    epoch's last batch). A resumed epoch used to count its batches from 0 against the full length, so Lightning
    did not see its last batch coming, accumulated it instead of stepping, and the next epoch zeroed it."""
    ref = fit(tmp_path / "ref", manual=False, compressor="none", accumulate=2)
    with pytest.raises(Crash):
        fit(tmp_path / "run", manual=False, compressor="none", crash_at=crash_at, accumulate=2)
    got = fit(tmp_path / "run", manual=False, compressor="none", accumulate=2)
    assert got[2].start_step in (crash_at - 1, crash_at)
    assert got[1].current_epoch == ref[1].current_epoch
    assert_same_end(ref, got)


@pytest.mark.parametrize("crash_at", [2, 3, 4, 9])
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_validation_every_few_batches_resumes_exactly(tmp_path: Path, crash_at: int, manual: bool) -> None:
    """Validation after every 2nd batch: what it draws from the RNG between two training steps is part of the
    uninterrupted run, and a resumed fit does not run again a validation that had run before the crash."""
    ref = fit(tmp_path / "ref", manual=manual, compressor="none", val_every=2)
    with pytest.raises(Crash):
        fit(tmp_path / "run", manual=manual, compressor="none", crash_at=crash_at, val_every=2)
    got = fit(tmp_path / "run", manual=manual, compressor="none", val_every=2)
    assert got[2].start_step in (crash_at - 1, crash_at)
    assert_same_end(ref, got)


@pytest.mark.parametrize("crash_at", [3, 6, 8, 11])
def test_scheduler_every_second_batch_resumes_exactly(tmp_path: Path, crash_at: int) -> None:
    """``frequency: 2``: Lightning steps the scheduler when the batch index within the epoch (from 1) is even,
    so a resumed epoch must continue the crashed run's batch index (5 batches an epoch: the parity restarts)."""
    ref = fit(tmp_path / "ref", manual=False, compressor="none", sched_frequency=2)
    with pytest.raises(Crash):
        fit(tmp_path / "run", manual=False, compressor="none", crash_at=crash_at, sched_frequency=2)
    got = fit(tmp_path / "run", manual=False, compressor="none", sched_frequency=2)
    assert got[2].start_step == crash_at
    assert_same_end(ref, got)


def test_topk_resume_at_snapshot_is_exact(tmp_path: Path) -> None:
    """Top-k's error-feedback residuals are exact at a snapshot step: LowDiffCallback(at="snapshot")."""
    ref = fit(tmp_path / "ref", manual=False, compressor="topk")
    with pytest.raises(Crash):
        fit(tmp_path / "run", manual=False, compressor="topk", crash_at=10)
    got = fit(tmp_path / "run", manual=False, compressor="topk", at="snapshot")
    assert got[2].start_step == 8
    assert_same_end(ref, got)


def test_closure_is_run_once_and_lbfgs_is_refused(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, {"run_dir": str(tmp_path / "a")})
    calls = []

    def closure() -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert calls == [True] and isinstance(loss, torch.Tensor) and opt.iteration == 1
    opt.close()
    with pytest.raises(lowdiff.UnsupportedError, match="requires a closure"):
        lowdiff.wrap(torch.optim.LBFGS(model.parameters()), model, {"run_dir": str(tmp_path / "b")})
