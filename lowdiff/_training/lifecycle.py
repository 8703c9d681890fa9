"""The wrapper's surroundings: closing it at interpreter exit or when it is collected, the GradScaler hook, and
the checks ``wrap()`` and ``load_state_dict()`` make. Kept apart from lowdiff/_training/optimizer.py, which is the
step."""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import signal
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lowdiff._persist import signals
from lowdiff._persist.checkpointer import Checkpointer
from lowdiff._training.capture import LayerwiseCapture
from lowdiff._training.iteration import IterationEnd
from lowdiff._transfer.host_copies import on_copy_thread
from lowdiff.config import Config
from lowdiff.errors import UnsupportedError


class Wrapper(Protocol):
    """What this module needs of the optimizer wrapper (lowdiff._training.optimizer), which imports this module."""

    config: Config

    def close(self, interrupted: bool = False) -> None: ...

log = logging.getLogger("lowdiff._training.optimizer")

OPEN: weakref.WeakSet[Wrapper] = weakref.WeakSet()
"""Wrappers with a run directory, not closed yet."""


SIGTERM_EXIT = 128 + signal.SIGTERM
"""The exit status of a trainer that lowdiff's SIGTERM handler stopped (what a shell reports for SIGTERM)."""
_terminated = False
_deferred = 0
MAX_DEFERRALS = 200
"""How many times (5 ms apart) SIGTERM waits for the main thread to leave lowdiff's code."""


class Terminated(SystemExit):
    """Raised in the main thread by lowdiff's SIGTERM handler: the stack unwinds (``with opt:`` and ``finally``
    blocks run), the open wrappers are closed at exit with the interrupted iteration left out, and the process exits
    with status 143."""


def _inside_lowdiff(frame: Any, outside: tuple[str, ...] = ("lowdiff.integrations",)) -> bool:
    """Whether the main thread is in lowdiff's own code (not the integrations, which run the user's loop, nor
    the modules named in ``outside``)."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("lowdiff.") and not name.startswith(outside):
            return True
        frame = frame.f_back
    return False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _terminated, _deferred, _int_deferred, _int_pending
    if signals.state.sending or (_inside_lowdiff(frame) and _deferred < MAX_DEFERRALS):
        # Not in the middle of lowdiff's bookkeeping (a step staged but not held, a record sealed but not handed
        # over): the signal comes back to the main thread in 5 ms (interrupting a sleep or a blocking call there),
        # until the main thread is in the user's code; after 1 s of that, it is taken wherever the thread is. Never
        # inside a message to the persistence process (lowdiff/_persist/signals.py).
        if not signals.state.sending:
            _deferred += 1
        threading.Timer(0.005, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM)).start()
        return
    _terminated = True
    _int_deferred, _int_pending = 0, False  # a Ctrl-C deferred before: this exit supersedes it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    log.warning("lowdiff: SIGTERM: flushing the log before exiting (a second SIGTERM exits at once)")
    raise Terminated(SIGTERM_EXIT)


_int_deferred = 0
_int_pending = False
_int_resent = False
_int_pid: int | None = None


def _on_sigint(signum: int, frame: Any) -> None:
    """Python's KeyboardInterrupt, raised outside lowdiff's own code. A Ctrl-C taken in the middle of lowdiff's
    bookkeeping (a record handed over but not marked so, a message to the persistence process half built) left
    the persistence process expecting a step it never got: it failed, and the next step raised
    CheckpointWriteError. Deferred, it is raised as ``opt.step()`` returns (:func:`raise_deferred_interrupt`), or
    where the main thread is 5 ms later if it has left lowdiff's code by then (the signal comes back, interrupting a
    wait); after 1 s of that, wherever the thread is. Deferred only while a wrapper is open, in the process that
    installed the handler (not a DataLoader worker forked from it), and not in lowdiff.data's loader, which runs
    the program's dataset code."""
    global _int_deferred, _int_pending, _int_resent
    resent, _int_resent = _int_resent, False
    if resent and not _int_pending:
        return  # the re-sent signal of an interrupt already raised at the end of a step
    deferring = signals.state.sending or (
        _inside_lowdiff(frame, ("lowdiff.integrations", "lowdiff.data")) and _int_deferred < MAX_DEFERRALS)
    if deferring and len(OPEN) and os.getpid() == _int_pid:
        if not signals.state.sending:
            _int_deferred += 1
        _int_pending = True
        threading.Timer(0.005, _resend_sigint).start()
        return
    _int_deferred, _int_pending = 0, False
    raise KeyboardInterrupt


def _resend_sigint() -> None:
    global _int_resent
    if _int_pending:
        _int_resent = True
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def raise_deferred_interrupt() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C deferred while lowdiff's code ran (called as ``opt.step()``
    returns: its step is applied and logged)."""
    global _int_deferred, _int_pending
    if _int_pending and threading.current_thread() is threading.main_thread():
        _int_deferred, _int_pending = 0, False
        raise KeyboardInterrupt


def guard_sigint() -> None:
    """Install lowdiff's SIGINT handler over Python's default one: at ``wrap()``, and at every step, since a
    notebook kernel puts the default back for each cell it runs. A handler of the program's own is left alone."""
    global _int_pid
    if len(OPEN) and signal.getsignal(signal.SIGINT) is signal.default_int_handler \
            and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
        _int_pid = os.getpid()


signals.HANDLERS.update({_on_sigterm, _on_sigint})


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


def opened(opt: Wrapper) -> None:
    """``opt`` holds a run directory until it is closed. The first one installs the SIGTERM handler, when the
    process has none of its own and this is the main thread: a scheduler's SIGTERM then flushes the log (what
    the writer thread holds would otherwise die with the process) instead of ending the process on the spot.
    Python's own SIGINT handler (KeyboardInterrupt) is replaced by one that raises it outside lowdiff's code
    (:func:`guard_sigint`)."""
    OPEN.add(opt)
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    guard_sigint()


@atexit.register  # after h5py's import (lowdiff._storage), so it runs before h5py's exit handler
def _close_at_exit() -> None:
    # An uncaught exception ended the script (the interpreter sets sys.last_value before exit handlers run), or
    # SIGTERM did: the iteration in progress may have stopped halfway, so it is not logged.
    interrupted = getattr(sys, "last_value", None) is not None or _terminated
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


def hook_scaler_update(on_update: Callable[[Callable[[Any], Any], Any], Any], scaler: Any) -> None:
    """Route a tracked GradScaler's ``update()`` through ``on_update(update, new_scale)``, a method of the wrapper
    (an instance attribute, as LR schedulers patch ``optimizer.step``); the scaler holds the wrapper weakly."""
    ref = weakref.WeakMethod(on_update)
    update = scaler.update

    def lowdiff_update(new_scale: Any = None) -> Any:
        handler = ref()
        return update(new_scale) if handler is None else handler(update, new_scale)

    scaler.update = lowdiff_update


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


