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

from lowdiff._storage import atomic

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


def fd_path(fd: int) -> str:
    """The path of an open file descriptor (Linux), for interceptors that fail only some files."""
    return os.readlink(f"/proc/self/fd/{fd}")


PERSISTENCE_ENV = "LOWDIFF_TESTING_PERSISTENCE"
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


def apply_persistence_env() -> None:
    """Called by the persistence process at start: installs what :func:`intercept_persistence_process` asked for."""
    import json
    import time

    spec = os.environ.get(PERSISTENCE_ENV)
    if not spec:
        return
    cfg = json.loads(spec)
    delay, err = float(cfg.get("commit_delay_s") or 0.0), cfg.get("fail_errno")

    def fail(fd: int, buffers: list[Any], offset: int) -> int:
        raise OSError(err, os.strerror(err))

    cm = intercept_writes(pwritev=fail if err is not None else None,
                          before_commit=(lambda path: time.sleep(delay)) if delay > 0 else None)
    cm.__enter__()
    _kept.append(cm)  # a collected generator would run its exit and restore the real functions


_kept: list[Any] = []
