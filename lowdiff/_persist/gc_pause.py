"""Pause Python's cyclic garbage collector while a writer turns a segment or a snapshot into a file.

Writing a segment unpacks its records into thousands of short-lived objects (a tensor view and a dict per payload,
an entry and a memoryview per piece): 8 000 of them were alive at once in a 16-step Top-k segment of the 48-block
MLP. Collections triggered meanwhile (by the writer's allocations or the training thread's) found them alive and
promoted them to the oldest generation, so CPython ran a full collection every 3-5 s of training: 120-150 ms each,
holding the GIL, so the training thread stood still (thread persistence; the `off` twin ran none after start-up).
Those objects have no reference cycles: reference counting frees them when the write ends. With the collector paused
for the write they are never promoted, and the collections it postponed run, cheaply, when it resumes.

The pause is process-wide (``gc.disable``); it is counted, so overlapping writes (several writer threads) resume it
once, and only if it was enabled before the first of them. A ``gc.disable()`` made by another thread during a write is
undone at its end: the one interaction with user code, and harmless to correctness. A write that stalls (a hung
disk) keeps the collector paused meanwhile: reference counting frees memory as usual, cyclic garbage waits. A process
forked during a write (a DataLoader worker) has no writer thread to end the pause: it starts with the collector as
it was before the write, and a fresh lock.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            if _depth:  # 0: this process was forked inside the pause, which the fork handler ended
                _depth -= 1
                if _depth == 0 and _was_enabled:
                    gc.enable()


def _after_fork_in_child() -> None:
    global _lock, _depth
    _lock = threading.Lock()  # a writer thread of the parent may have held it at the fork
    if _depth:
        _depth = 0
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
