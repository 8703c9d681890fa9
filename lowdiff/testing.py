"""Fault injection for tests: the documented seam through which every byte lowdiff writes passes.

Tests of lowdiff, and of training code built on it, simulate a full disk, an I/O error or a slow disk here
instead of patching lowdiff's modules (whose internals may change):

>>> import errno, os
>>> def full_disk(fd, buffers, offset):
...     raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
>>> with lowdiff.testing.intercept_writes(pwritev=full_disk):   # doctest: +SKIP
...     train()   # the next step() after a failed background write raises CheckpointWriteError

The seam is process-wide (the background writer thread uses it too) and restored when the block exits;
blocks nest. It never changes what is written, only whether and when.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lowdiff._persist import process_writer
from lowdiff._storage import atomic, direct_io
from lowdiff._transfer import host_copies

real_pwritev: Callable[[int, list[Any], int], int] = os.pwritev
"""The real gathered write: call it from a ``pwritev`` interceptor to let bytes through."""


@contextmanager
def intercept_writes(pwritev: Callable[[int, list[Any], int], int] | None = None,
                     before_commit: Callable[[Path], None] | None = None) -> Iterator[None]:
    """While open: every gathered write of a file lowdiff commits calls ``pwritev(fd, buffers, offset)`` (the
    signature and return value of :func:`os.pwritev`; raise ``OSError`` to fail it), and every atomic commit
    calls ``before_commit(final_path)`` just before the rename (sleep there for a slow disk; raise to fail the
    commit). Either may be None: that part is left as it is."""
    current_pwritev, current_commit = atomic.set_write_seam(None, None)
    atomic.set_write_seam(pwritev if pwritev is not None else current_pwritev,
                          before_commit if before_commit is not None else current_commit)
    try:
        yield
    finally:
        atomic.set_write_seam(current_pwritev, current_commit)


def takes_direct_io(directory: str | os.PathLike[str]) -> bool:
    """Whether the file system holding ``directory`` takes the ``O_DIRECT`` writes ``log.direct_io`` asks for (where
    it does not, lowdiff writes through the page cache): writes and removes a 4 kB probe file."""
    return direct_io.probe(directory)


def fd_path(fd: int) -> str:
    """The path of an open file descriptor (Linux), for interceptors that fail only some files."""
    return os.readlink(f"/proc/self/fd/{fd}")


PERSISTENCE_ENV = atomic.PERSISTENCE_ENV
"""The environment variable through which :func:`intercept_persistence_process` reaches the processes it starts."""


@contextmanager
def intercept_persistence_process(commit_delay_s: float = 0.0, fail_errno: int | None = None) -> Iterator[None]:
    """The same seam for ``log.persistence: process``, which cannot run the caller's functions: persistence
    processes started while the block is open sleep ``commit_delay_s`` before every commit (a slow disk) and, with
    ``fail_errno``, fail every gathered write with that ``OSError`` (a full disk: ``errno.ENOSPC``).

    >>> with lowdiff.testing.intercept_persistence_process(fail_errno=errno.ENOSPC):   # doctest: +SKIP
    ...     opt = lowdiff.wrap(inner, model, {"run_dir": d, "log": {"persistence": "process"}})
    """
    import json

    old = os.environ.get(PERSISTENCE_ENV)
    os.environ[PERSISTENCE_ENV] = json.dumps({"commit_delay_s": commit_delay_s, "fail_errno": fail_errno})
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PERSISTENCE_ENV, None)
        else:
            os.environ[PERSISTENCE_ENV] = old


@contextmanager
def slow_copies(delay_s: float) -> Iterator[None]:
    """While open: every copy lowdiff makes on a thread of its own (a CPU snapshot copied beside the next forward
    and backward passes, ``snapshot.background_copy: true``) takes ``delay_s`` longer, as on a slow memory system.
    A test of code that changes parameters between two steps keeps the copy running past that code with it.

    >>> with lowdiff.testing.slow_copies(0.3):   # doctest: +SKIP
    ...     train()   # each snapshot still equals the state at its step
    """
    previous = host_copies.set_copy_delay(delay_s)
    try:
        yield
    finally:
        host_copies.set_copy_delay(previous)


@contextmanager
def small_rings() -> Iterator[None]:
    """While open: the shared-memory ring a trainer fills for its persistence process (``log.persistence:
    process``) is only as large as one segment's records need, instead of at least 4 MB, so it wraps within a few
    steps, as a ring of large records does. Tests of the ring's reuse (a slot that is never given back stops
    training once the ring wraps) run with small records inside it."""
    previous = process_writer.set_ring_min_bytes(0)
    try:
        yield
    finally:
        process_writer.set_ring_min_bytes(previous)


@contextmanager
def copies_in_flight(make_event: Callable[[str], Any]) -> Iterator[None]:
    """While open: every copy of a step's record, of a snapshot, or of a one-element tensor lowdiff logs (a tensor
    learning rate, a GradScaler's scale) to host memory is reported complete only when ``make_event(kind)`` says so
    (``kind``: "step", "snapshot" or "scalar"), an object with ``query()`` (True once complete,
    without waiting) and ``synchronize()`` (wait for it), as a ``torch.cuda.Event``. The bytes are copied at once;
    only their completion is what the test says. A CPU test of how lowdiff treats copies still running on a GPU
    (who waits for them, and when) runs with it.

    >>> with lowdiff.testing.copies_in_flight(lambda kind: NeverDone()):   # doctest: +SKIP
    ...     train()
    """
    previous = host_copies.set_copy_events(make_event)
    try:
        yield
    finally:
        host_copies.set_copy_events(previous)
