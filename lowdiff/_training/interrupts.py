"""lowdiff's SIGTERM and SIGINT handlers, and the open wrappers they act for.

SIGTERM (a scheduler ending the job, torchrun stopping its ranks): lowdiff lets the loop finish the iteration in
progress and stops the process as the next ``opt.step()`` begins, with that iteration logged and the compressor's
memory its own, so the stop is a clean one (the stop file, docs/reference/FORMAT.md section 4a) and a resume
continues bit for bit. A second SIGTERM, or none of the loop's steps within ``STOP_GRACE_S``, stops it where it is.
SIGINT (Ctrl-C) raises KeyboardInterrupt outside lowdiff's own bookkeeping.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from lowdiff._persist import signals
from lowdiff.config import Config

log = logging.getLogger(__name__)


class Wrapper(Protocol):
    """What lowdiff's handlers need of the optimizer wrapper (lowdiff._training.optimizer)."""

    config: Config

    def close(self, interrupted: bool = False) -> None: ...

OPEN: weakref.WeakSet[Wrapper] = weakref.WeakSet()
"""Wrappers with a run directory, not closed yet."""


SIGTERM_EXIT = 128 + signal.SIGTERM
"""The exit status of a trainer that lowdiff's SIGTERM handler stopped (what a shell reports for SIGTERM)."""
STOP_GRACE_S = 10.0
"""How long after a SIGTERM lowdiff waits for the loop's next ``opt.step()`` before it stops the process wherever
it is (the iteration in progress is then left out of the log, and a resume there is not bit for bit)."""
_terminated = False
_stop_requested = False
_term_pid: int | None = None
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
    global _stop_requested
    if _stop_requested or not len(OPEN) or os.getpid() != _term_pid:
        _take_sigterm(frame)  # a second SIGTERM, the grace over, or no run open: now
        return
    # The first one: the loop ends the iteration in progress, and the process stops at the next opt.step() (or
    # flush() or close()), where that iteration is logged whole and the compressor's memory is its own: a resume
    # continues bit for bit. Taken anyway after STOP_GRACE_S.
    _stop_requested = True
    log.warning("lowdiff: SIGTERM: stopping at the next opt.step(), once the iteration in progress is logged (at "
                "most %.0f s from now; a second SIGTERM stops at once)", STOP_GRACE_S)
    timer = threading.Timer(STOP_GRACE_S, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM))
    timer.daemon = True
    timer.start()


def stop_if_requested(end_iteration: Callable[[], None]) -> None:
    """Called as ``opt.step()`` begins (and by ``flush()`` and ``close()``): after a SIGTERM, end the iteration in
    progress with ``end_iteration`` and stop the process (:class:`Terminated`, exit status 143)."""
    if _stop_requested and not _terminated and threading.current_thread() is threading.main_thread():
        end_iteration()
        _exit()


def after_close() -> None:
    """A SIGTERM waited for the next step, and the loop closed its last optimizer instead: it is taken now."""
    if _stop_requested and not _terminated and not len(OPEN) and not exiting \
            and threading.current_thread() is threading.main_thread():
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)


exiting = False
"""Set by lowdiff's exit handler: the interpreter is ending anyway."""


def _take_sigterm(frame: Any) -> None:
    global _deferred
    if signals.state.sending or (_inside_lowdiff(frame) and _deferred < MAX_DEFERRALS):
        # Not in the middle of lowdiff's bookkeeping (a step staged but not held, a record sealed but not handed
        # over): the signal comes back to the main thread in 5 ms (interrupting a sleep or a blocking call there),
        # until the main thread is in the user's code; after 1 s of that, it is taken wherever the thread is. Never
        # inside a message to the persistence process (lowdiff/_persist/signals.py).
        if not signals.state.sending:
            _deferred += 1
        threading.Timer(0.005, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM)).start()
        return
    _exit()


def _exit() -> None:
    global _terminated, _int_deferred, _int_pending
    _terminated = True
    _int_deferred, _int_pending = 0, False  # a Ctrl-C deferred before: this exit supersedes it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    log.warning("lowdiff: SIGTERM: flushing the log before exiting (a second SIGTERM exits at once)")
    raise Terminated(SIGTERM_EXIT)


def terminated() -> bool:
    """Whether lowdiff's SIGTERM handler is ending the process (the interrupted iteration is not logged)."""
    return _terminated


def install_sigterm() -> None:
    """Install lowdiff's SIGTERM handler when the process has none of its own (main thread only)."""
    global _term_pid
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _term_pid = os.getpid()


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
    wait); after 1 s of that, wherever the thread is. Deferred only while a wrapper is open (or a message to the
    persistence process is being sent: close()'s last ones), in the process that installed the handler (not a
    DataLoader worker forked from it), and not in lowdiff.data's loader, which runs the program's dataset code."""
    global _int_deferred, _int_pending, _int_resent
    resent, _int_resent = _int_resent, False
    if resent and not _int_pending:
        return  # the re-sent signal of an interrupt already raised at the end of a step
    # A message being sent defers it even with no wrapper open: close() sends its last messages after leaving OPEN,
    # and a KeyboardInterrupt between a message's write and its sequence number's count would have the next
    # message (the flush of close()'s cleanup) reuse the number.
    deferring = signals.state.sending or (len(OPEN) > 0 and _int_deferred < MAX_DEFERRALS and _inside_lowdiff(
        frame, ("lowdiff.integrations", "lowdiff.data")))
    if deferring and os.getpid() == _int_pid:
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
    if len(OPEN) and signals.handler(signal.SIGINT) is signal.default_int_handler \
            and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
        _int_pid = os.getpid()


signals.HANDLERS.update({_on_sigterm, _on_sigint})
