"""The wrapper's surroundings: closing it at interpreter exit or when it is collected, the GradScaler hook, and
the checks ``wrap()`` and ``load_state_dict()`` make. Kept apart from lowdiff/_training/optimizer.py, which is the
step."""

from __future__ import annotations

import atexit
import inspect
import logging
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowdiff._persist.checkpointer import Checkpointer
from lowdiff._training import interrupts
from lowdiff._training.capture import LayerwiseCapture
from lowdiff._training.interrupts import OPEN, Wrapper, guard_sigint, install_sigterm
from lowdiff._training.iteration import IterationEnd
from lowdiff._transfer.host_copies import on_copy_thread
from lowdiff.config import Config
from lowdiff.errors import UnsupportedError

log = logging.getLogger(__name__)




def several_at_resume(opt: Wrapper) -> None:
    """Said when ``opt`` resumes beside other open wrappers (a GAN's two optimizers): each resume restores the
    process's RNG state from its own run, so the one resumed last decides it, and after a crash between their steps
    one run is an iteration ahead of the other."""
    others = [o for o in OPEN if o is not opt]
    if not others:
        return
    log.warning("lowdiff: %d lowdiff optimizers are open in this process; each logs and resumes its own run, and "
                "each resume() restores the process's RNG state as its own run logged it, so the one resumed last "
                "decides it. Resume them in the order they step in an iteration (the one that steps last, last), "
                "and check that every resume() returns the same iteration: a crash between their steps leaves one "
                "an iteration ahead (docs/guide/exact-resume.md, 'Several optimizers')", len(others) + 1)


def close_earlier(run_dir: str | Path) -> None:
    """Before a wrapper opens ``run_dir``: an open wrapper of this process that holds it (a notebook cell run
    again, a script that wraps twice) is closed first, its steps logged. Left open, it would keep the new one
    waiting for its persistence process, or refused by its lock."""
    target = Path(run_dir).resolve()
    for opt in list(OPEN):
        if Path(opt.config.run_dir).resolve() == target:
            log.warning("lowdiff: %s is open in this process by an earlier lowdiff optimizer (a cell run again?); "
                        "closing that one first (everything it logged is kept: resume() continues from it)",
                        opt.config.run_dir)
            opt.close()


def opened(opt: Wrapper) -> None:
    """``opt`` holds a run directory until it is closed. The first one installs the SIGTERM handler, when the
    process has none of its own and this is the main thread: a scheduler's SIGTERM then flushes the log (what
    the writer thread holds would otherwise die with the process) instead of ending the process on the spot.
    Python's own SIGINT handler (KeyboardInterrupt) is replaced by one that raises it outside lowdiff's code
    (:func:`guard_sigint`)."""
    OPEN.add(opt)
    if threading.current_thread() is not threading.main_thread():
        return
    install_sigterm()
    guard_sigint()


@atexit.register  # after h5py's import (lowdiff._storage), so it runs before h5py's exit handler
def _close_at_exit() -> None:
    # An uncaught exception ended the script (the interpreter sets sys.last_value before exit handlers run), or
    # SIGTERM did: the iteration in progress may have stopped halfway, so it is not logged.
    interrupts.exiting = True
    interrupted = getattr(sys, "last_value", None) is not None or interrupts.terminated()
    for opt in list(OPEN):
        try:
            opt.close(interrupted=interrupted)
        except Exception as e:  # one failure must not keep the others open
            log.error("lowdiff: closing %s at interpreter exit failed: %s", opt.config.run_dir, e)


def release(checkpointer: Checkpointer, layerwise: LayerwiseCapture | None, iteration: IterationEnd | None,
             interrupted: bool = False) -> None:
    """What close() does: end (or drop) the iteration in progress, remove the capture hooks, flush the log and
    release the run directory."""
    args = (checkpointer, layerwise, iteration, interrupted)
    if checkpointer.on_writer_thread() or on_copy_thread():
        # A garbage collection the writer thread (or a copy thread) happened to run: a flush there would wait for
        # that very thread.
        threading.Thread(target=_close, args=args, name="lowdiff-close").start()
        return
    _close(*args)


def _close(checkpointer: Checkpointer, layerwise: LayerwiseCapture | None, iteration: IterationEnd | None,
           interrupted: bool) -> None:
    try:
        if iteration is not None:
            if interrupted:
                iteration.drop()
            else:
                iteration.seal(strict=False)
    finally:
        if layerwise is not None:
            layerwise.remove()
        checkpointer.close()


def hook_scaler_update(on_update: Callable[[Callable[[Any], Any], Any, Any], Any], scaler: Any) -> None:
    """Route a tracked GradScaler's ``update()`` through ``on_update(update, new_scale, scaler)``, a method of the
    wrapper (an instance attribute, as LR schedulers patch ``optimizer.step``); the scaler holds the wrapper
    weakly."""
    ref, scaler_ref = weakref.WeakMethod(on_update), weakref.ref(scaler)
    update = scaler.update  # another wrapper's lowdiff_update where two track one scaler (a GAN's)

    def lowdiff_update(new_scale: Any = None) -> Any:
        handler = ref()
        return update(new_scale) if handler is None else handler(update, new_scale, scaler_ref())

    scaler.update = lowdiff_update


_END_CALLED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""Per hooked scheduler: the weak method told after each of its ``step()`` calls."""
_SEEING: dict[type, type] = {}


def hook_scheduler_step(on_called: Callable[[Any], None], scheduler: Any) -> bool:
    """Tell ``on_called(scheduler)`` after each of a tracked LR scheduler's ``step()`` calls (the end of an
    iteration, lowdiff._training.iteration.IterationEnd.end_call); the scheduler holds the wrapper weakly. An
    instance attribute would land in the scheduler's ``state_dict()`` (all of its ``__dict__``), so the scheduler's
    class is swapped for a subclass whose ``step()`` says so. False when that cannot be done (a class with
    ``__slots__``, say): then that iteration's end is known only at the next ``opt.step()``."""
    cls = type(scheduler)
    sub = _SEEING.get(cls)
    if sub is None:
        if hasattr(cls, "__slots__"):
            return False

        base_step = cls.step

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = base_step(self, *args, **kwargs)
            ref = _END_CALLED.get(self)
            handler = ref() if ref is not None else None
            if handler is not None:
                handler(self)
            return out

        sub = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _SEEING[cls] = sub
    try:
        scheduler.__class__ = sub
    except TypeError:
        return False
    _END_CALLED[scheduler] = weakref.WeakMethod(on_called)
    return True


def is_scheduler(obj: Any) -> bool:
    sched = torch.optim.lr_scheduler
    return isinstance(obj, (sched.LRScheduler, sched.ReduceLROnPlateau))


def init_hook_dicts(opt: torch.optim.Optimizer) -> None:
    """The hook registries torch.optim.Optimizer.__init__ would create (register_step_pre_hook & co. work)."""
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                 "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                 "_optimizer_load_state_dict_post_hooks"):
        setattr(opt, attr, OrderedDict())


def refuse_wrapper(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that wraps another one (accelerate's ``AcceleratedOptimizer``, ...) cannot be rebuilt by replay
    from its class and defaults: lowdiff must wrap the optimizer itself, before any such wrapper."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        raise UnsupportedError(f"{type(optimizer).__name__} wraps another optimizer ({type(inner).__name__}); recovery "
                               "rebuilds the optimizer from its class, so wrap that one: lowdiff.wrap(inner, model, "
                               "config) first, then hand lowdiff's optimizer to the wrapper (accelerate's prepare() "
                               "takes it)")


def refuse_reevaluating(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer whose ``step()`` requires a closure evaluates the loss several times inside one step (LBFGS's
    line search): no single gradient per step exists to log, so it cannot be replayed."""
    try:
        param = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if param is not None and param.default is inspect.Parameter.empty:
        raise UnsupportedError(f"{type(optimizer).__name__}.step() requires a closure: it re-evaluates the loss "
                               "inside each step, so no single gradient per step can be logged and replayed")


def same_state(a: Any, b: Any) -> bool:
    """Two optimizer state dicts hold the same values (tensors compared bit for bit, on the CPU)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN hyperparameters compare equal


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b`` or a same-shaped view of the same memory (the identity compressor's decode)."""
    return a is b or (a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def record_bytes_bound(optimized: Any, cc: Any) -> float | None:
    """An upper bound on one step's record before any is seen, the same on every rank (the tuner caps its
    bootstrap batch with it): the dense gradient for compressor none, values plus indices (int64 at most) of the
    kept fraction for Top-k; None for PowerSGD (small factors: the bootstrap batch stands)."""
    dense = sum(p.numel() * p.element_size() for _, p in optimized)
    if cc.name == "none":
        return float(dense)
    if cc.name == "topk":
        return dense * float(cc.ratio) * 3.0  # 4-byte value + up to 8-byte index per kept element of 4 bytes
    return None


def wants_layerwise(config: Config) -> bool:
    # auto = step: on the CPU a hook's copy overlaps nothing, and on an H100 the step-time staging (itself
    # overlapping inner.step) measured as fast or faster (docs/reference/design.md).
    return config.log.capture == "layerwise"


