"""Lightning 2.x: resume a ``Trainer.fit`` from the lowdiff run directory, bit for bit.

Wrap the optimizer in ``configure_optimizers`` and attach schedulers to the wrapper (Lightning accepts only
schedulers of the optimizers it is given); add :class:`LowDiffCallback` to the Trainer::

    class Model(lightning.pytorch.LightningModule):
        def configure_optimizers(self):
            opt = lowdiff.wrap(torch.optim.AdamW(self.parameters(), lr=1e-3), self, "lowdiff.yaml")
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10_000)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = lightning.pytorch.Trainer(max_steps=10_000, callbacks=[LowDiffCallback()])
    trainer.fit(Model(), train_dataloaders=ResumableLoader(DataLoader(ds, batch_size=32,
                                                                      sampler=ResumableSampler(len(ds)))))

Run the same script again after a crash: ``on_train_start`` tracks every scheduler of the Trainer, the precision
plugin's GradScaler and the training loaders that are :class:`lowdiff.data.ResumableLoader`, calls
``opt.resume()``, and sets ``trainer.global_step`` (and ``current_epoch``, from a tracked loader) to the resumed
iteration. Automatic and manual optimization both work: the wrapper runs Lightning's closure once, then steps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lowdiff import LowDiffOptimizer
from lowdiff.data import ResumableLoader
from lowdiff.errors import LowDiffError

log = logging.getLogger(__name__)

__all__ = ["LowDiffCallback", "lowdiff_optimizer"]


def lowdiff_optimizer(trainer: Trainer) -> LowDiffOptimizer:
    """The one :class:`~lowdiff.LowDiffOptimizer` among the Trainer's optimizers."""
    found = [o for o in trainer.optimizers if isinstance(o, LowDiffOptimizer)]
    if len(found) != 1:
        raise LowDiffError(f"LowDiffCallback needs exactly one optimizer wrapped by lowdiff.wrap() among the "
                           f"Trainer's optimizers, found {len(found)}: return lowdiff.wrap(inner, self, config) "
                           "from configure_optimizers")
    return found[0]


class LowDiffCallback(Callback):
    """Resumes a Lightning run from lowdiff's log at the start of training and closes the wrapper at its end.

    ``at``: ``"latest"`` (the latest durable iteration) or ``"snapshot"`` (the newest snapshot step, where Top-k's
    and PowerSGD's error-feedback memory is exact too); ``track``: more objects to track by name (anything with
    ``state_dict()`` / ``load_state_dict()``), besides the schedulers, the GradScaler and ResumableLoaders found
    automatically."""

    def __init__(self, *, at: str = "latest", track: Mapping[str, Any] | None = None) -> None:
        self.at = at
        self.extra = dict(track or {})
        self.start_step: int | None = None
        """The iteration the last fit resumed at (0 for a new run); None before training starts."""
        self._opt: LowDiffOptimizer | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        opt = self._opt = lowdiff_optimizer(trainer)
        for i, config in enumerate(trainer.lr_scheduler_configs):
            opt.track(config.scheduler, f"lightning/lr_scheduler/{i}")
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            opt.track(scaler, "lightning/grad_scaler")
        loaders = _resumable_loaders(trainer.train_dataloader)
        for i, loader in enumerate(loaders):
            opt.track(loader, f"lightning/train_dataloader/{i}", at="step")
        for name, obj in self.extra.items():
            opt.track(obj, name)
        start = self.start_step = opt.resume(at=self.at)
        if start == 0:
            return
        _set_progress(trainer, pl_module, start, loaders[0] if loaders else None)
        if not loaders:
            log.warning("lowdiff: resumed Lightning at step %d without a lowdiff.data.ResumableLoader: the training "
                        "data restarts its epoch, so the batches differ from the uninterrupted run's", start)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A validation inside fit runs between two steps and draws from the global RNG (its DataLoader iterator
        # takes a seed); a resumed fit does not run it again, so the RNG state is taken after it.
        if self._opt is not None and not trainer.sanity_checking:
            self._opt.capture_rng()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._opt is not None:
            self._opt.flush()  # the last iteration is over: its step is logged

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._opt is not None:
            self._opt.close(interrupted=True)  # the iteration in progress is not logged; a resume redoes it
            self._opt = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._opt is not None and stage == "fit":
            self._opt.close()  # the next fit wraps again (configure_optimizers) and resumes
            self._opt = None


def _resumable_loaders(loaders: Any) -> list[ResumableLoader]:
    if isinstance(loaders, ResumableLoader):
        return [loaders]
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return [x for item in loaders for x in _resumable_loaders(item)]
    return []


def _set_progress(trainer: Trainer, pl_module: LightningModule, step: int, loader: ResumableLoader | None) -> None:
    """Lightning's counters at the resumed iteration: ``global_step`` (what ``max_steps`` and step-wise schedulers
    count) and, from a tracked loader, ``current_epoch`` and the batch index in a resumed epoch."""
    loop = trainer.fit_loop.epoch_loop
    if pl_module.automatic_optimization:
        steps = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        steps = loop.manual_optimization.optim_step_progress.total
    steps.ready = steps.completed = step
    loop._batches_that_stepped = step  # the step loggers are given
    if loader is None:
        return
    epoch = loader.epoch
    trackers: tuple[Any, ...] = (trainer.fit_loop.epoch_progress.current, trainer.fit_loop.epoch_progress.total)
    for tracker in trackers:
        tracker.ready = tracker.started = tracker.processed = tracker.completed = epoch
    sampler = loader.sampler
    if epoch != loader.state_dict()["epoch"] or loader.offset == 0:
        return  # at an epoch's start: Lightning's batch index starts at 0 there anyway
    # In the middle of an epoch: the batches this rank consumed in it. Without them Lightning counts the resumed
    # epoch's batches from 0 against the full epoch's length, so it does not see the last batch coming and, with
    # accumulate_grad_batches > 1, accumulates it instead of stepping (the next epoch then zeroes that gradient).
    done = -(-loader.offset // (loader.batch_size * sampler.replicas_per_step))
    batches = loop.batch_progress
    for tracker, value in ((batches.current, done), (batches.total, epoch * int(trainer.num_training_batches) + done)):
        # Typed as the base tracker (ready, completed), built as the processed one (started and processed too).
        for counter in ("ready", "started", "processed", "completed"):
            setattr(tracker, counter, value)
    # As a restore from a Lightning checkpoint saved after the last completed batch: the epoch loop keeps these
    # counters (instead of zeroing them) when it starts, and its data fetcher counts the consumed batches as fetched.
    loop.restarting = True
    loop.update_restart_stage()
