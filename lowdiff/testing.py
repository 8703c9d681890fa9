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

from lowdiff.storage import atomic

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
