"""The optimizer wrapper: compress -> decode -> inner step -> hand the step's record to the checkpointer."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lowdiff._compressors import Payload
from lowdiff._compressors.base import StepPayloads
from lowdiff._persist.checkpointer import CheckpointStats, LayerwiseStats
from lowdiff._training import fsdp, interrupts, lifecycle
from lowdiff._training.ddp import calling_scaler, unscaled_by
from lowdiff._training.iteration import AT_END, AT_STEP, Pending, is_grad_scaler
from lowdiff._training.lifecycle import (
    hook_scaler_update,
    init_hook_dicts,
    refuse_reevaluating,
    refuse_wrapper,
    release,
    same_state,
    same_tensor,
)
from lowdiff._training.opening import Run
from lowdiff._training.resume import resume_run
from lowdiff.config import Config, load_config
from lowdiff.errors import LowDiffError, UnsupportedError

log = logging.getLogger(__name__)


class LowDiffOptimizer(torch.optim.Optimizer):
    """Drop-in for the wrapped optimizer: ``step``, ``zero_grad``, ``param_groups`` and ``state`` behave as the
    inner optimizer's; every ``step`` is also logged. Build it with :func:`lowdiff.wrap`.

    A ``torch.optim.Optimizer`` (LR schedulers, GradScaler, Lightning and accelerate accept it), whose parameter
    groups, state and defaults are the inner optimizer's own objects."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, config: Config) -> None:
        init_hook_dicts(self)  # not Optimizer.__init__: param_groups, state and defaults are the inner optimizer's
        if isinstance(optimizer, LowDiffOptimizer):
            raise LowDiffError("this optimizer is already wrapped by lowdiff")
        refuse_wrapper(optimizer)
        refuse_reevaluating(optimizer)
        self.inner = optimizer
        self.config = config
        run = self._run = Run(optimizer, model, config)  # opens (or creates) the run directory
        self.model = run.model
        self.compressor = run.compressor
        self._loop = run.loop
        if run.checkpointer is not None:
            # close() at interpreter exit or when collected unclosed: else a script without close() loses its last
            # partial segment, and the daemon writer may die mid-write (exit status 134). Never holds the wrapper.
            self._release = weakref.finalize(self, release, run.checkpointer, run.stager.layerwise, run.iteration)
            self._release.atexit = False  # _close_at_exit runs it, before h5py's own exit handler
            lifecycle.opened(self)

    # -- the torch.optim.Optimizer surface -----------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refused, except for the state the optimizer already has (accelerate reloads it to place it on its
        device): a different state under the log would make replay wrong."""
        if same_state(self.inner.state_dict(), state_dict):
            self._run.stager.settle_snapshot()
            self.inner.load_state_dict(state_dict)
            return
        raise UnsupportedError("load optimizer state before lowdiff.wrap(), or restore a lowdiff run with "
                               "opt.resume(); changing it under the log would make replay wrong")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UnsupportedError("add parameter groups before lowdiff.wrap(): the run directory records the groups")

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a LowDiffOptimizer cannot be pickled or copied: it owns a run directory")

    def __repr__(self) -> str:
        return f"LowDiffOptimizer({self.inner!r}, run_dir={str(self.config.run_dir)!r})"

    @property
    def iteration(self) -> int:
        """The last logged iteration: the state now is the one after iteration ``iteration`` (what ``resume()``
        returned, plus one per ``step()``, plus one per iteration a tracked GradScaler skipped)."""
        return self._loop.step

    @property
    def step_count(self) -> int:
        """The same as :attr:`iteration` (optimizer steps, when no tracked GradScaler skips any)."""
        return self._loop.step

    @property
    def needs_resume(self) -> bool:
        """Whether the run directory holds a run that :meth:`resume` has not restored yet."""
        return self._loop.needs_resume

    def track(self, obj: Any, name: str = "data", *, at: str = "auto") -> Any:
        """Log ``obj.state_dict()`` with every step and restore it with ``load_state_dict`` in :meth:`resume`, as
        it was at the END of the resumed iteration (after the loop's ``sched.step()`` / ``scaler.update()``).

        Anything with ``state_dict()`` / ``load_state_dict()``: LR schedulers, a ``torch.amp.GradScaler`` (whose
        skipped steps then count as iterations), a :class:`lowdiff.data.ResumableLoader`, counters. The state may
        hold numbers, strings, lists, tuples, dicts, Counters and one-element tensors (``UnsupportedError``
        otherwise, saying what to do). ``at``: when the state is taken, ``"end"`` (when the iteration ends) or
        ``"step"`` (inside ``opt.step()``: right for data loaders, which hand out the next batch before the next
        step); ``"auto"`` picks ``"step"`` for iterables, else ``"end"``. Call before ``resume()``, once per name;
        returns ``obj``. Under DDP every rank must track the same names with the same state."""
        if self._loop.step > 0:
            raise LowDiffError(f"opt.track({name!r}) must come before opt.resume() and the first step")
        kind = self._run.tracker.add(obj, name, at)
        if is_grad_scaler(obj):
            hook_scaler_update(self._scaler_update, obj)
            self._run.tracker.end_seen.add(name)
        elif kind == AT_END and lifecycle.is_scheduler(obj) and lifecycle.hook_scheduler_step(self._end_call, obj):
            self._run.tracker.end_seen.add(name)
        return obj

    def _end_call(self, obj: Any) -> None:
        if self._run.iteration is not None:
            self._run.iteration.end_call(obj)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def resume(self, at: str = "latest") -> int:
        """Restore model, optimizer, compressor, tracked objects and RNG state to the end of a logged iteration and
        return its number (0 when the run directory is new): the next ``step()`` belongs to iteration
        ``start + 1``. ``at="latest"``: the latest durable iteration; ``at="snapshot"``: the newest snapshot
        step, where Top-k's and PowerSGD's error-feedback memory is exact too (the loop then redoes the iterations
        after it, bit for bit). Call once, before the first ``step``."""
        if not self._loop.needs_resume:
            return self._loop.step
        step = resume_run(self._run, at)
        lifecycle.several_at_resume(self)
        return step

    def flush(self) -> int:
        """End the iteration in progress (call it after the loop's last change to tracked objects) and commit
        every logged step; returns the newest durable step."""
        interrupts.stop_if_requested(self._end_iteration)
        self._end_iteration()
        return self._run.checkpointer.flush() if self._run.checkpointer else self._loop.step

    def end_iteration(self) -> None:
        """Optional: the loop has made this iteration's last change to objects tracked at its end (a counter of its
        own; schedulers' and GradScalers' calls are seen without it). Its end state as it is now goes to the
        persistence process, so a trainer killed before the next ``opt.step()`` loses nothing. The next
        ``opt.step()`` still takes the state again (an exception before it drops the iteration). No wait."""
        if self._run.iteration is not None:
            self._run.iteration.end_all()

    def _end_iteration(self) -> None:
        if self._run.iteration is not None:
            self._run.iteration.seal()

    def capture_rng(self) -> None:
        """Take the RNG state for the iteration in progress again, now: call it after random draws that come
        between ``opt.step()`` and the next iteration's forward pass and that a resumed run does not repeat (an
        evaluation between two steps: iterating a DataLoader draws its seed from torch's generator). A resume then
        continues from the state after them, as the uninterrupted run did. ``LowDiffCallback`` calls it after each
        validation inside a Lightning fit. No effect before the first step or after ``flush()``."""
        if self._run.iteration is not None and self._run.checkpointer is not None:
            self._run.iteration.retake_rng(self._run.stager.rng())

    @property
    def durable_step(self) -> int:
        """The newest step guaranteed to be on disk."""
        return self._run.checkpointer.durable_step if self._run.checkpointer else 0

    @property
    def stats(self) -> CheckpointStats | None:
        """A reading of the checkpointer's counters: steps and bytes committed, time written and blocked, queue
        depth, the snapshot interval and batch size in force, the tuner's decisions (None with
        ``enabled: false``): ``opt.stats.durable_step``, ``.steps_committed``, ``.blocked_s``."""
        if self._run.checkpointer is None:
            return None
        lw = self._run.stager.layerwise
        return dataclasses.replace(
            self._run.checkpointer.stats(), host_buffers_reused=self._run.stager.reused,
            snapshot_buffers_reused=self._run.stager.snapshots_reused,
            layerwise=LayerwiseStats(lw.hits, lw.misses, lw.active) if lw is not None else None)

    def close(self, interrupted: bool = False) -> None:
        """End the iteration in progress, flush and release the run directory; everything logged is durable when it
        returns. ``interrupted=True`` (an exception stopped the loop mid-iteration): that iteration is not logged,
        since what it left in tracked objects is unknown; a resume redoes it."""
        if self._loop.closed:
            return
        self._loop.closed = True
        interrupts.OPEN.discard(self)
        if self._run.checkpointer is not None:
            self._run.stager.settle_snapshot()  # a copy still running must not outlive the buffers close gives back
            self._run.stager.drop_targets()  # a slot handed to the compressor for a step that raised
            # detach(), not self._release(): a finalizer called after weakref's own exit hook (registered when
            # the process's first finalize was made, possibly after ours) does nothing.
            if self._release.detach() is not None:
                release(self._run.checkpointer, self._run.stager.layerwise, self._run.iteration, interrupted)
            self._run.stager.copier.close()
        elif self._run.stager.layerwise is not None:
            self._run.stager.layerwise.remove()
        interrupts.after_close()

    def __enter__(self) -> LowDiffOptimizer:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(interrupted=exc_type is not None)

    # -- the step ------------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Compress (if configured) -> decode into ``.grad`` -> inner step -> log the step.

        ``closure`` (Lightning passes one): run once, with gradients enabled, before the step (it computes the loss
        and the gradients); its value is returned."""
        self._check_usable()
        interrupts.stop_if_requested(self._end_iteration)  # after a SIGTERM: the last iteration has ended
        interrupts.guard_sigint()
        if self._run.writes is not None:
            self._run.writes.check(self._loop.step + 1)
        if self._run.hooks is not None:
            self._run.hooks.check(self._loop.step + 1)
        if self._loop.step0 is not None:
            self._run.settle_step0()
        if self._run.iteration is not None:
            self._run.iteration.seal()  # the previous iteration ended: this one has reached its step
            if self._run.checkpointer is not None:
                self._run.checkpointer.report_backpressure(self._loop.step)
        # Pre-hooks run where torch runs them, before the closure, and before the gradient is compressed and logged:
        # what a hook leaves in .grad is what the log holds.
        for pre in list(self._optimizer_step_pre_hooks.values()):
            pre(self, (), {})
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._run.checkpointer is not None:
            self._run.checkpointer.check()
            # The last snapshot's copy ran beside the forward and backward passes; the compressor and the inner
            # step change what it reads. Time spent waiting for it here is reported as waiting for the writer.
            self._run.checkpointer.waited(self._run.stager.settle_snapshot())
        t_apply = time.perf_counter()
        self._loop.memory_step = None  # compressing changes the compressor's memory (the stop file's condition)
        aggregated = self._run.hook.take() if self._run.hook is not None else None
        grads, payloads = self._payloads(aggregated)
        ckpt = self._run.checkpointer
        copies, stage_s, data, scale = None, 0.0, {}, None
        if ckpt is not None:
            data = self._step_state()  # before anything changes: a state that cannot be logged stops the step here
            if aggregated is not None:  # DDP: the hook compressed the gradients before a GradScaler unscaled them
                # Queued before the record's copies, which then complete after it (no wait for the device here).
                scalers = [*self._run.tracker.scalers(), calling_scaler(sys._getframe(1))]
                scale = unscaled_by(self, [s for s in scalers if s is not None])
            # Queued before the inner step, so on a GPU the copies to host memory overlap the optimizer's kernels.
            t_stage = time.perf_counter()
            copies = self._run.stager.copy_step(grads, ckpt.slots, payloads)
            stage_s = time.perf_counter() - t_stage
        groups = self._run.iteration.groups.encode(self.inner.param_groups) if self._run.iteration else []
        out = self.inner.step()
        # compress + decode + inner step, staging excluded: the tuner's estimate of one replayed step.
        apply_s = time.perf_counter() - t_apply - stage_s
        step = self._loop.step + 1
        self._loop.step = step
        self._loop.stepped = True
        self._loop.memory_step = step
        if ckpt is not None and copies is not None:
            self._hold(self._run.stager.finish_step(copies, step, groups, data, grad_scale=scale), apply_s)
        if self._run.writes is not None:
            self._run.writes.arm(step)
        # After the watch is armed: a post-hook that writes parameters (a weight constraint) is reported at the next
        # step, since no replay runs it.
        for post in list(self._optimizer_step_post_hooks.values()):
            post(self, (), {})
        interrupts.raise_deferred_interrupt()  # a Ctrl-C that came during this step: raised now that it is logged
        return loss if closure is not None else out

    def _payloads(self, aggregated: dict[str, Payload] | None
                  ) -> tuple[dict[str, dict[str, torch.Tensor]], StepPayloads | None]:
        """Every gradient's payload, compressed here (or by DDP's communication hook: ``aggregated``) and decoded
        into ``.grad``. Returns the payloads of the parameters this rank logs, and where the compressor wrote them
        if it wrote them all into its reused buffers (lowdiff._compressors.base.StepPayloads)."""
        grads: dict[str, dict[str, torch.Tensor]] = {}
        if aggregated is None:
            # On the CPU the payloads go straight into the writer's slot where they can (Stager.step_targets).
            ckpt = self._run.checkpointer
            self.compressor.begin_step(self._run.stager.step_targets(ckpt.slots) if ckpt is not None else None)
        try:
            with torch.no_grad():
                for name, p in self._run.spec.optimized:
                    g = fsdp.local(p.grad)
                    if g is None:
                        continue
                    if g.is_sparse:
                        raise UnsupportedError(f"parameter {name!r} has a sparse gradient; lowdiff logs dense ones")
                    if aggregated is not None:
                        payload = aggregated.get(name)
                        if payload is None:
                            raise LowDiffError(f"parameter {name!r} has a gradient DDP's communication hook did not "
                                               "aggregate this step (accumulating outside no_sync()?)")
                    else:
                        payload, decoded = self.compressor.compress_decode(name, g)
                        if not same_tensor(decoded, g):
                            fsdp.set_grad(p, g, decoded)
                    if name in self._run.owned_log:
                        grads[name] = payload
        finally:
            payloads = self.compressor.end_step() if aggregated is None else None
        return grads, payloads

    def _check_usable(self) -> None:
        if self._loop.closed:
            raise LowDiffError("step() after close(): wrap the optimizer again to continue")
        if self._loop.needs_resume:
            raise LowDiffError(f"{self.config.run_dir} already holds a run; call opt.resume() before training, "
                               "or use a new run_dir")

    def _step_state(self) -> dict[str, Any]:
        data, errors = self._run.tracker.state(AT_STEP, self._run.iteration.read if self._run.iteration else None)
        if errors:
            raise UnsupportedError(errors[0])
        return data

    def _hold(self, record: Any, apply_s: float | None) -> None:
        """Keep ``record`` (and the snapshot, at a snapshot step) until its iteration ends (iteration.py)."""
        assert self._run.checkpointer is not None and self._run.iteration is not None
        step = record.item.step
        snapshot, block_s = None, 0.0
        if self._run.checkpointer.needs_capture(step):
            t_snap = time.perf_counter()
            try:
                snapshot = self._run.stager.snapshot(step, record.item.data, self._run.checkpointer.slots)
            except BaseException:
                # Ctrl-C while it waited for the previous snapshot, a state_dict() that raised: the inner step is
                # applied, so its record is still held and logged (without this snapshot), then the error goes on.
                self._run.iteration.hold(Pending(record, None, 0.0, apply_s))
                raise
            block_s = time.perf_counter() - t_snap
        self._run.iteration.hold(Pending(record, snapshot, block_s, apply_s))

    def _scaler_update(self, update: Callable[[Any], Any], new_scale: Any, scaler: Any) -> Any:
        """A tracked GradScaler's ``update()``. In an iteration without an optimizer step (the scaler found inf or
        NaN gradients) the previous iteration has ended before it, and this one is logged as a step without
        gradients, so step numbers count iterations."""
        if self._loop.stepped:
            out = update(new_scale)
            self._loop.stepped = False
            self._end_call(scaler)
            return out
        self._check_usable()
        if self._loop.step0 is not None:
            self._run.settle_step0()
        if self._run.iteration is not None:
            self._run.iteration.seal()
        data = self._step_state() if self._run.checkpointer is not None else {}
        out = update(new_scale)
        if self._run.hook is not None:
            self._run.hook.take()  # the skipped iteration's payloads: never consumed
        step = self._loop.step + 1
        if self._run.checkpointer is not None:
            copies = self._run.stager.copy_step({})  # only the buffers its forward pass changed
            assert self._run.iteration is not None
            groups = self._run.iteration.groups.encode(self.inner.param_groups)
            self._hold(self._run.stager.finish_step(copies, step, groups, data, skipped=True), None)
        self._loop.step = step
        if self._loop.memory_step == step - 1:  # the memory of the skipped iteration is still the last step's
            self._loop.memory_step = step
        self._end_call(scaler)  # this iteration's update() has run (before its hold)
        return out


def wrap(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
         config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> LowDiffOptimizer:
    """Wrap ``optimizer`` so every step is logged as a differential checkpoint.

    >>> opt = lowdiff.wrap(torch.optim.AdamW(model.parameters()), model, "lowdiff.yaml")  # doctest: +SKIP
    >>> start = opt.resume()                                                              # doctest: +SKIP
    """
    return LowDiffOptimizer(optimizer, model, load_config(config))
