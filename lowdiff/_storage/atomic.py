"""Atomic commits: write ``NAME.tmp``, fsync it, rename it to ``NAME``, fsync the directory.

A reader therefore sees either the whole committed file or nothing; a crash leaves at most a stale
``*.tmp`` that readers ignore and the next writer removes.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowdiff._storage.format import TMP_SUFFIX
from lowdiff.errors import CheckpointWriteError

# The seam every committed byte and every commit goes through; set only through lowdiff.testing.
_pwritev: Callable[[int, list[Any], int], int] = os.pwritev
_before_commit: Callable[[Path], None] | None = None
_IOV_MAX = 1024


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cached(fd: int) -> None:
    """Let the kernel drop the page cache of a file just written and fsynced (its pages are clean).

    A checkpoint is written once and read only at recovery: left cached, its pages push out the training data's.
    Measured on the shared VM (docs/measurements/writebw.md): writing a segment into pages the kernel must newly
    find costs 2-3 ms of system CPU per MB; into pages a dropped segment just gave back, 0.25."""
    advise = getattr(os, "posix_fadvise", None)  # not on macOS or Windows
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:  # advice only
            pass


HDF5_HEADROOM_BYTES = 64 << 10
"""Room :func:`ensure_space` asks for beyond a container's bytes: libhdf5's own metadata is a few kB."""


def ensure_space(directory: Path, nbytes: int) -> None:
    """Raise ``OSError(ENOSPC)`` where the file system holding ``directory`` has no room for ``nbytes`` more.

    Called before libhdf5 writes a container: on a full disk its file close fails half done, and the process later
    dies of a segmentation fault inside libhdf5 (h5py 3.16 with HDF5 2.0, a fault probe on a small tmpfs, 3 runs of
    3) instead of raising, so a full disk must be found before it writes. Space taken by others between this check
    and the write can still get there. Root may use the blocks reserved for it."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return  # unknown: the write says
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    if free < nbytes + HDF5_HEADROOM_BYTES:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free, about {nbytes} to write)")


def pwrite_all(fd: int, chunks: list[Any], offset: int) -> None:
    """Write every chunk at ``offset`` onwards with gathered writes (``pwritev``: few system calls, no
    joining copy, the GIL released), retrying short writes."""
    views = [v for v in (memoryview(c).cast("B") for c in chunks) if v.nbytes]
    while views:
        batch = views[:_IOV_MAX]
        n = _pwritev(fd, batch, offset)
        if n <= 0:
            raise OSError(f"short write at offset {offset}")
        offset += n
        # Drop what was written, keeping the unwritten tail of a partly written buffer.
        while n and views:
            if views[0].nbytes <= n:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def pwritev(fd: int, buffers: list[Any], offset: int) -> int:
    """One ``pwritev`` through the seam (short counts are the caller's to handle)."""
    return _pwritev(fd, buffers, offset)


def set_write_seam(pwritev: Callable[[int, list[Any], int], int] | None,
                   before_commit: Callable[[Path], None] | None) -> tuple[Any, Any]:
    """Install the functions writes and commits go through (None: the real ones); returns the previous pair.
    Public use is :func:`lowdiff.testing.intercept_writes`."""
    global _pwritev, _before_commit
    previous = (_pwritev, _before_commit)
    _pwritev = pwritev if pwritev is not None else os.pwritev
    _before_commit = before_commit
    return previous


def commit(tmp: Path, final: Path, synced: bool = False) -> None:
    """fsync ``tmp`` (unless the caller has: ``synced``), rename it over ``final`` and fsync the directory."""
    if _before_commit is not None:
        _before_commit(final)
    if not synced:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = tmp_path(path)
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pwrite_all(fd, [data], 0)
        finally:
            os.close(fd)
        commit(tmp, path)
    except OSError as e:
        remove_quietly(tmp)
        raise CheckpointWriteError(e.errno, f"writing {path} failed: {e.strerror or e}; nothing was committed "
                                   "for it", str(path)) from e
    except BaseException:
        remove_quietly(tmp)
        raise


def clean_stale_tmp(run_dir: Path) -> list[Path]:
    """Remove ``*.tmp`` left by a crashed writer (call only while holding the writer lock)."""
    removed = []
    for d in (run_dir, run_dir / "snapshots", run_dir / "log", run_dir / "stops"):
        if d.is_dir():
            for p in d.iterdir():
                if p.name.endswith(TMP_SUFFIX) and p.is_file():
                    remove_quietly(p)
                    removed.append(p)
    return removed


PERSISTENCE_ENV = "LOWDIFF_TESTING_PERSISTENCE"
"""Set by ``lowdiff.testing.intercept_persistence_process`` for the persistence processes it starts: JSON with
``commit_delay_s`` and ``fail_errno``."""


def seam_from_environment() -> None:
    """Called by a persistence process at start: install the seam :data:`PERSISTENCE_ENV` asks for (a process
    cannot be handed the test's own functions), or nothing when it is unset."""
    import time

    spec = os.environ.get(PERSISTENCE_ENV)
    if not spec:
        return
    cfg = json.loads(spec)
    delay, err = float(cfg.get("commit_delay_s") or 0.0), cfg.get("fail_errno")

    def fail(fd: int, buffers: list[Any], offset: int) -> int:
        raise OSError(err, os.strerror(err))

    current_pwritev, current_commit = set_write_seam(None, None)
    set_write_seam(fail if err is not None else current_pwritev,
                   (lambda path: time.sleep(delay)) if delay > 0 else current_commit)
