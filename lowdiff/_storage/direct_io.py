"""A container's bulk bytes written past the page cache (``O_DIRECT``), where the file system takes it.

A snapshot is written once and read only at a recovery, yet a buffered ``pwrite`` copies it into the page cache,
and the pages the kernel must find for it cost system CPU on the writer's core: on the shared 2-core VM, 130 MB of
snapshot took about 390 ms of the persistence process's CPU, 70 % of all it spent, beside a training thread it
slows through the shared caches and memory bandwidth (docs/measurements/directio.md). Written with ``O_DIRECT``
from a reused, aligned bounce buffer, the same bytes cost a copy (about 25 ms) and the device's DMA.

``O_DIRECT`` wants offsets, lengths and memory aligned to the device's block: the data region's unaligned head and
tail go through the page cache as before, the aligned middle directly. A stretch of the caller's memory that is
itself aligned (a log segment built into lowdiff._storage.segment_packed's page-aligned buffer, in a data region the
container aligns in the file) is written from where it lies; the rest is copied through a bounce buffer in blocks of
:data:`BOUNCE_BYTES`. Where the
file system refuses ``O_DIRECT`` (tmpfs, many FUSE file systems) at the open or at a write, or a write comes back
short, the rest is written buffered (a refusal costs one system call per file). Everything still goes through the
write seam (``lowdiff.testing.intercept_writes``), and the caller fsyncs the file as before (an ``fsync`` covers the
file, whichever descriptor wrote it). ``log.direct_io: false`` turns it off.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Any

import numpy as np

from lowdiff._storage import atomic

ALIGN = 4096
"""Offsets, lengths and memory of direct writes are multiples of this (every device's logical block divides it)."""
MIN_BYTES = 1 << 20
"""Data regions smaller than this are written buffered: a second descriptor costs more than it saves."""
BOUNCE_BYTES = 8 << 20
OWN_BYTES = 256 << 20
"""The most bytes of the caller's aligned memory written by one call (Linux writes at most 2 GiB - 4 kB a call; a
short direct write sends the rest of its block through the page cache)."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; not on macOS or Windows
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}
_bounces: list[mmap.mmap] = []
_lock = threading.Lock()


def write_data(fd: int, path: os.PathLike[str] | str, chunks: list[Any], offset: int, *, direct: bool = True) -> None:
    """Write ``chunks`` back to back at ``offset`` of the file ``fd`` has open for writing (``path`` names it)."""
    views = [v for v in (memoryview(c).cast("B") for c in chunks) if v.nbytes]
    total = sum(v.nbytes for v in views)
    start, end = -(-offset // ALIGN) * ALIGN, (offset + total) // ALIGN * ALIGN
    if not direct or not _O_DIRECT or end - start < MIN_BYTES:
        atomic.pwrite_all(fd, views, offset)
        return
    try:
        dfd = os.open(path, os.O_WRONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno not in _REFUSED:
            raise
        atomic.pwrite_all(fd, views, offset)
        return
    stream = _Stream(views)
    try:
        atomic.pwrite_all(fd, stream.take(start - offset), offset)
        _write_middle(dfd, fd, stream, start, end)
        atomic.pwrite_all(fd, stream.take(offset + total - end), end)
    finally:
        os.close(dfd)


def probe(directory: os.PathLike[str] | str) -> bool:
    """Whether the file system holding ``directory`` takes an aligned ``O_DIRECT`` write (writes a 4 kB file there
    and removes it)."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, f".lowdiff-direct-probe-{os.getpid()}-{threading.get_ident()}")
    page = mmap.mmap(-1, ALIGN)  # page-aligned memory
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o600)
        try:
            os.pwrite(fd, page, 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _write_middle(dfd: int, fd: int, stream: _Stream, start: int, end: int) -> None:
    """The aligned middle, ``start`` to ``end``: directly while the file system takes it, then through the page
    cache. Aligned stretches of the caller's memory go as they are, the rest through the bounce buffer."""
    bounce: mmap.mmap | None = None
    try:
        pos, refused = start, False
        while pos < end:
            own, k = stream.next_block(min(BOUNCE_BYTES, end - pos), min(OWN_BYTES, end - pos))
            pieces = stream.take(k)
            if refused:
                atomic.pwrite_all(fd, pieces, pos)
                pos += k
                continue
            if own:
                (block,) = pieces  # the caller's aligned memory, written from where it lies
            else:
                if bounce is None:
                    bounce = _take_bounce()
                buf = np.frombuffer(bounce, dtype=np.uint8)
                at = 0
                for p in pieces:  # numpy's copy releases the GIL (a writer thread shares it with training)
                    np.copyto(buf[at:at + p.nbytes], np.frombuffer(p, dtype=np.uint8))
                    at += p.nbytes
                block = memoryview(bounce)[:k]
            try:
                n = atomic.pwritev(dfd, [block], pos)
            except OSError as e:
                if e.errno not in _REFUSED:
                    raise
                refused, n = True, 0  # took the open, not the write (some FUSE file systems)
            n = max(n, 0)
            if n < k:  # a short direct write cannot go on unaligned: the rest of the block through the page cache
                atomic.pwrite_all(fd, [block[n:]], pos + n)
            pos += k
    finally:
        if bounce is not None:
            _give_bounce(bounce)


def _take_bounce() -> mmap.mmap:
    """A page-aligned buffer of BOUNCE_BYTES, kept for the process's next write: fresh pages cost system CPU on
    every first touch, which is what this module saves."""
    with _lock:
        if _bounces:
            return _bounces.pop()
    return mmap.mmap(-1, BOUNCE_BYTES)


def _give_bounce(bounce: mmap.mmap) -> None:
    with _lock:
        _bounces.append(bounce)


class _Stream:
    """Byte views consumed from the front, ``take(n)`` at a time (views into the callers' buffers, no copy)."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._i = 0
        self._at = 0

    def next_block(self, bounced: int, limit: int) -> tuple[bool, int]:
        """The next block at an aligned position: ``(True, n)`` when the memory at the front is aligned and holds
        ``n`` (a multiple of ALIGN, at most ``limit``) bytes to write from where they lie; else ``(False, n)``, at most
        ``bounced`` bytes to copy through the bounce buffer, ending where a view of aligned memory starts at an
        aligned distance (that view then goes as it is)."""
        v, at = self._views[self._i], self._at
        if v.nbytes - at >= ALIGN and _address(v, at) % ALIGN == 0:
            return True, min((v.nbytes - at) // ALIGN * ALIGN, limit)
        d, i = v.nbytes - at, self._i + 1
        while d < bounced and i < len(self._views):
            w = self._views[i]
            if d % ALIGN == 0 and w.nbytes >= ALIGN and _address(w, 0) % ALIGN == 0:
                return False, d
            d, i = d + w.nbytes, i + 1
        return False, bounced

    def take(self, n: int) -> list[memoryview]:
        out: list[memoryview] = []
        while n > 0:
            v = self._views[self._i]
            k = min(n, v.nbytes - self._at)
            out.append(v[self._at:self._at + k])
            n -= k
            self._at += k
            if self._at == v.nbytes:
                self._i, self._at = self._i + 1, 0
        return out


def _address(v: memoryview, at: int) -> int:
    """The memory address of byte ``at`` of ``v``."""
    return int(np.frombuffer(v, dtype=np.uint8).ctypes.data) + at
