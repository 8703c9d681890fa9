"""transformers' ``Trainer`` (with accelerate): resume training from the lowdiff run directory, bit for bit.

Give the Trainer the wrapped optimizer, and use :class:`LowDiffTrainer` in place of ``Trainer``::

    model = MyModel()
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=5e-4), model, "lowdiff.yaml")
    trainer = LowDiffTrainer(model=model, args=TrainingArguments(..., save_strategy="no"), train_dataset=ds,
                             optimizers=(opt, None))   # None: the Trainer's own scheduler (lr_scheduler_type)
    trainer.train()

After a crash, run the same script again: ``train()`` calls ``opt.resume()`` first (model, optimizer, the
scheduler and the RNG state come back as they were at the end of the resumed step) and then lets the Trainer resume
at that global step, through its own checkpoint-resume path with nothing read from a checkpoint directory: it skips
the batches already trained on in the current epoch (``skip_first_batches``) and puts the RNG state back where it
would have put a checkpoint's. ``trainer.lowdiff_start`` is the step it resumed at. HF checkpoints
(``save_strategy``) are not needed.

This subclass overrides five of ``Trainer``'s private methods (``_init_training_state``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``), each only for its own resume; it is tested
with transformers 5.x.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME

from lowdiff import LowDiffOptimizer
from lowdiff import rng as rng_state
from lowdiff.errors import LowDiffError

__all__ = ["LowDiffTrainer"]

log = logging.getLogger(__name__)

_OVERRIDDEN = ("_init_training_state", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
               "_load_rng_state")
_MISSING = [m for m in _OVERRIDDEN if not callable(getattr(Trainer, m, None))]
if _MISSING:  # a transformers release that moved them: say so instead of resuming wrongly
    raise ImportError(f"lowdiff.integrations.transformers needs transformers' Trainer.{', '.join(_MISSING)} "
                      "(transformers 5.x); this transformers has none")


class _SchedulerSlot:
    """Stands for the Trainer's LR scheduler in ``opt.track()``: a scheduler the Trainer creates itself exists only
    after the resume, so its state is kept until then."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        sched = self.trainer.lr_scheduler
        return {} if sched is None else dict(sched.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pending = dict(state)
        self.apply()

    def apply(self) -> None:
        sched = self.trainer.lr_scheduler
        if sched is not None and self.pending:
            sched.load_state_dict(self.pending)
            self.pending = None


class _LoopCalls(TrainerCallback):
    """What lowdiff needs to hear from the Trainer's loop between two steps."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The previous step's iteration is over: its scheduler step (which lowdiff does not see: the scheduler is
        tracked through a stand-in), and the logging, evaluation, plateau scheduler step and saving the Trainer does
        after ``on_step_end``. A persistence process keeps it if the trainer dies from here on (in this step's
        forward and backward passes, say). Called first among the callbacks, before any of the program's."""
        if self.trainer.optimizer is not None:
            lowdiff_optimizer(self.trainer.optimizer).end_iteration()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.optimizer is not None:  # None: evaluate() before train()
            # An evaluation during train() draws from torch's generator (its DataLoader iterator takes a seed); a
            # resumed Trainer does not evaluate again, so the RNG state is taken after it.
            lowdiff_optimizer(self.trainer.optimizer).capture_rng()


def lowdiff_optimizer(optimizer: Any) -> LowDiffOptimizer:
    """The lowdiff wrapper under the Trainer's optimizer (accelerate wraps it in an ``AcceleratedOptimizer``)."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, LowDiffOptimizer) and seen < 8:
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    if not isinstance(optimizer, LowDiffOptimizer):
        raise LowDiffError("LowDiffTrainer needs the wrapped optimizer: Trainer(..., optimizers=(lowdiff.wrap(inner, "
                           "model, config), scheduler or None))")
    return optimizer


class LowDiffTrainer(Trainer):
    """A ``transformers.Trainer`` whose ``train()`` resumes from the lowdiff run directory.

    ``lowdiff_resume_at``: ``"latest"`` (the latest durable step) or ``"snapshot"`` (the newest snapshot step,
    where Top-k's and PowerSGD's error-feedback memory is exact too); ``lowdiff_track``: more objects to track by
    name besides the LR scheduler and accelerate's GradScaler."""

    def __init__(self, *args: Any, lowdiff_resume_at: str = "latest", lowdiff_track: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lowdiff_resume_at = lowdiff_resume_at
        self.lowdiff_start: int | None = None
        """The global step the last ``train()`` started from (0 for a new run)."""
        self._lowdiff_extra = dict(lowdiff_track or {})
        self._lowdiff_slot = _SchedulerSlot(self)
        self._lowdiff_tracked = False
        self._lowdiff_dir: str | None = None
        self._lowdiff_rng: dict[str, Any] = {}
        self._lowdiff_groups: list[dict[str, Any]] = []
        self.callback_handler.callbacks.insert(0, _LoopCalls(self))

    @property
    def lowdiff_optimizer(self) -> LowDiffOptimizer:
        return lowdiff_optimizer(self.optimizer)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint not in (None, False):
            raise ValueError("LowDiffTrainer resumes from the lowdiff run directory; do not pass "
                             "resume_from_checkpoint")
        opt = self.lowdiff_optimizer
        if not self._lowdiff_tracked and opt.iteration == 0:
            opt.track(self._lowdiff_slot, "transformers/lr_scheduler")
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                opt.track(scaler, "transformers/grad_scaler")
            for name, obj in self._lowdiff_extra.items():
                opt.track(obj, name)
            self._lowdiff_tracked = True
        start = self.lowdiff_start = opt.resume(at=self.lowdiff_resume_at)
        try:
            if start == 0:
                out = super().train(trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            else:
                # What the Trainer would have read from a checkpoint: the RNG state and hyperparameters at the end
                # of step `start` (a scheduler the Trainer creates anew resets the learning rate).
                self._lowdiff_rng = rng_state.capture(rng_state.current_rank(), rng_state.cuda_devices_in_use())
                self._lowdiff_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                with tempfile.TemporaryDirectory(prefix="lowdiff-resume-") as d:
                    TrainerState(global_step=start, train_batch_size=self._train_batch_size).save_to_json(
                        os.path.join(d, TRAINER_STATE_NAME))
                    self._lowdiff_dir = d
                    out = super().train(resume_from_checkpoint=d, trial=trial,
                                        ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except BaseException:
            opt.close(interrupted=True)  # the step in progress is not logged; a resume redoes it
            raise
        finally:
            self._lowdiff_dir = None
        opt.flush()  # the last step's iteration is over
        return out

    def _ours(self, checkpoint: Any) -> bool:
        return checkpoint is not None and checkpoint == self._lowdiff_dir

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: Any, trial: Any) -> tuple[int, int]:
        if not self._ours(resume_from_checkpoint):
            return super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                resume_from_checkpoint, trial)
        # A fresh state (logging, eval and save steps from the arguments), at the resumed global step.
        super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        start = int(self.lowdiff_start or 0)
        self.state.global_step = start
        if start >= max_steps:
            # The run had reached max_steps (the script died after train(), or was run again): nothing to train.
            # The Trainer's loop would take one more step before its first max_steps check (it does so resuming its
            # own checkpoint too), which the log would hold as a step the finished run never took.
            log.info("lowdiff: %s already holds step %d of max_steps %d; nothing to train",
                     self.lowdiff_optimizer.config.run_dir, start, max_steps)
            self.state.epoch = num_train_epochs
            return num_train_epochs, 0
        self.state.epoch = start / num_update_steps_per_epoch
        epochs = start // num_update_steps_per_epoch
        steps = 0 if self.args.ignore_data_skip else \
            (start % num_update_steps_per_epoch) * self.args.gradient_accumulation_steps
        return epochs, steps

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._ours(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # lowdiff restored the model

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if not self._ours(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self._lowdiff_slot.apply()  # the Trainer's own scheduler exists now
        for g, saved in zip(self.lowdiff_optimizer.param_groups, self._lowdiff_groups):
            g.update(saved)

    def _load_scaler(self, checkpoint: Any) -> None:
        if not self._ours(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: Any) -> None:
        if not self._ours(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        rng_state.restore(self._lowdiff_rng, rng_state.current_rank())
