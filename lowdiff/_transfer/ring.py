"""Shared host memory between the training process and its persistence process (``log.persistence: process``).

An :class:`Arena` is an anonymous memory file (``memfd_create``) mapped in both processes; its descriptor crosses the
control socket once (SCM_RIGHTS). The training side carves step records out of it with a :class:`RingAllocator`
(first in, first out, frees may come out of order), and the stager packs each step into its slot
(lowdiff._transfer.packing); a snapshot is packed into an arena of its own, and the persistence side sees the same
bytes as tensor views (lowdiff._storage.packed). A record or a snapshot crosses as a small message plus bytes
already in the arena; the only tensors pickled are a few scalars off the device the rest was packed from (Adam's
step counts on the CPU beside GPU parameters).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import OrderedDict

import torch

log = logging.getLogger(__name__)

ALIGN = 64
"""Every allocation and every dtype region starts on a multiple of this many bytes (views of any dtype are aligned)."""


_MAX_VIEWS = 1024


class Arena:
    """``nbytes`` of shared memory as a flat uint8 tensor (``buf``); ``fd`` is what the other process maps."""

    def __init__(self, nbytes: int, fd: int | None = None) -> None:
        self.nbytes = nbytes
        if fd is None:
            fd = os.memfd_create("lowdiff-ring", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        self.fd = fd
        self._map = mmap.mmap(fd, nbytes)
        self.buf = torch.frombuffer(self._map, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        """Registration with CUDA was tried (:meth:`pin`)."""
        self._registered = False
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``buf[offset:offset + nbytes]``, the same tensor each time for the same range: a ring's records of one
        size come back to the same offsets, and their consumers (lowdiff._training.flat_steps) cache what they
        built on a slot by its tensor."""
        v = self._views.get((offset, nbytes))
        if v is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            v = self._views[(offset, nbytes)] = self.buf[offset:offset + nbytes]
        return v

    def pin(self) -> None:
        """Register the mapping with CUDA as pinned memory, so copies from a GPU into it run asynchronously. If
        CUDA refuses, the copies still land, synchronously, and lowdiff says so."""
        self.pinned = True
        err = int(torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.nbytes, 0))
        self._registered = err == 0
        if not self._registered:
            log.warning("lowdiff: could not pin the %d-byte record ring (CUDA error %d); copies from the GPU into "
                        "it are synchronous", self.nbytes, err)

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self._registered = False
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._views.clear()
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RingAllocator:
    """First-in first-out byte ranges of a ring of ``capacity`` bytes. ``alloc`` returns (id, offset) or None when
    the range does not fit now; ``free(id)`` may come in any order, space is reused once every older range is free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._head = 0  # monotonic byte counters; offset = counter % capacity
        self._tail = 0
        self._live: OrderedDict[int, list[int]] = OrderedDict()  # id -> [start, end, freed]
        self._next = 0

    def __len__(self) -> int:
        return len(self._live)

    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        n = max(aligned(nbytes), ALIGN)
        if n > self.capacity:
            return None
        start = self._head
        pos = start % self.capacity
        if pos + n > self.capacity:  # never split a range: skip to the start of the ring
            start += self.capacity - pos
        if start + n - self._tail > self.capacity:
            return None
        self._head = start + n
        aid = self._next
        self._next += 1
        self._live[aid] = [start, start + n, 0]
        return aid, start % self.capacity

    def free(self, aid: int) -> None:
        entry = self._live.get(aid)
        if entry is None:
            return
        entry[2] = 1
        while self._live:
            first = next(iter(self._live.values()))
            if not first[2]:
                break
            self._live.popitem(last=False)
            self._tail = first[1]
        if not self._live:
            self._tail = self._head


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def copy_region(parts: list[torch.Tensor], region: torch.Tensor) -> None:
    """Concatenate ``parts`` along their first dimension into ``region`` (one copy; other dimensions equal). A 1-D
    first part that already lies at the start of a 1-D region (a compressor wrote it there) is not copied."""
    if parts and region.dim() == 1 and parts[0].dim() == 1 and parts[0].data_ptr() == region.data_ptr() \
            and parts[0].dtype == region.dtype and parts[0].is_contiguous():
        region, parts = region[parts[0].numel():], parts[1:]
    if len(parts) == 1:
        region.copy_(parts[0])
    elif parts:
        torch.cat(parts, out=region)
