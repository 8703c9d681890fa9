"""Getting tensors off the training device without making training wait (the "snapshot" phase).

On the CPU a staged tensor is the tensor itself, or a clone when it aliases live state the caller may change
later. On a GPU, each tensor is copied into pinned host memory by a non-blocking copy on a side stream; the
training thread never waits. The batch of copies completes at a CUDA event that travels with the record or
snapshot (:class:`Staged`), and the background writer waits for it before reading (``Staged.wait``).

The tensors of one call are first concatenated on the device, one flat tensor per dtype (microseconds on the
GPU), so the copy reads a private tensor and training may change live state (parameters, optimizer state, a
gradient the user zeroes in place) at once; and one step costs a few CUDA calls however many tensors it has.
When the device has too little spare memory for that, each tensor is copied directly and the training stream
waits (on the GPU, not on the host) until the copies are done before running anything that could change
them: the next step waits only for the copy, never for the disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from lowdiff._transfer.packing import StepLayout, pack_host, region_parts, region_view

log = logging.getLogger(__name__)

# The device-side concatenation of one call may use at most this fraction of the device's free memory.
SPARE_FRACTION = 0.5
COPY_THREAD = "lowdiff-copy"
"""The name (prefix) of the copiers' threads."""
# Released host buffers kept for reuse, per (dtype, size).
POOL_MAX_FREE = 64
SPARE_EVERY = 256
"""Copies between two questions to the driver about free device memory, per size copied."""


T = TypeVar("T")


@dataclass
class Staged(Generic[T]):
    """A staged step record or snapshot: ``item`` holds host tensors the training side no longer writes to.

    On a GPU their copies may still be in flight: ``ready`` is the CUDA event they complete at, and the consumer
    calls :meth:`wait` before reading them. :meth:`release` hands pooled host buffers back for reuse once the
    item has been persisted (or dropped); it runs at most once."""

    item: T
    ready: Any = None
    release_fn: Callable[[], None] | None = None

    def wait(self) -> T:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.item

    def release(self) -> None:
        fn, self.release_fn = self.release_fn, None
        if fn is not None:
            fn()


class HostPool:
    """Flat CPU buffers reused from step to step for the copies of live CPU tensors (compressor none's gradients).

    A fresh 40 MB allocation every step is a fresh mmap whose pages fault in as the copy writes them: measured
    4-10 points of step time on the 2-core machine (docs/measurements/gil.md). Buffers go back to the pool when
    the writer has persisted the record (``Staged.release``); a record dropped without that just lets its buffer
    be garbage-collected. Taken on the training thread, given back on the writer's, hence the lock."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, bool], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, dtype: torch.dtype, numel: int, pinned: bool = False) -> torch.Tensor:
        """A buffer (``pinned``: page-locked, for copies from a GPU: allocated once, then reused)."""
        with self._lock:
            free = self._free.get((dtype, numel, pinned))
            if free:
                self.reused += 1
                return free.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault((buf.dtype, buf.numel(), buf.is_pinned()), [])
            if len(free) < POOL_MAX_FREE:
                free.append(buf)


class CopyInFlight:
    """Host copies running on :class:`HostCopier`'s copy thread, waited for like the CUDA event of a GPU copy:
    ``query()`` (done?) and ``synchronize()`` (wait; raises what the copy raised)."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self._future.result()


class HostCopier:
    """Copies tensors of one device to host memory. ``stage`` returns host tensors and a ready event."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        self.device: torch.device | None = None
        self.stream: Any = None
        self.snapshot_stream: Any = None
        """Snapshots' copies (tens of milliseconds) run on a stream of their own: a step's copy never queues behind
        one."""
        self._spare: dict[int, tuple[bool, int]] = {}  # bytes -> (fit in spare device memory, calls until re-asked)
        self._thread: ThreadPoolExecutor | None = None
        if len(devices) == 1:
            self.device = next(iter(devices))
            self.stream = torch.cuda.Stream(device=self.device)
            self.snapshot_stream = torch.cuda.Stream(device=self.device)
        elif len(devices) > 1:
            log.warning("lowdiff: parameters span %d GPUs; their copies to host memory are synchronous",
                        len(devices))

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def pack_later(self, layout: StepLayout, tensors: list[torch.Tensor], buf: torch.Tensor) -> CopyInFlight:
        """:meth:`pack` of CPU tensors on a thread of its own (one, so copies complete in order): the training
        thread goes on, and must not change ``tensors`` until the copy is done (``CopyInFlight``). For a
        snapshot's parameters and optimizer state, which nothing changes before the next ``opt.step()``."""
        try:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=COPY_THREAD)
            return CopyInFlight(self._thread.submit(_pack_on_copy_thread, layout, tensors, buf))
        except RuntimeError:  # the interpreter is shutting down (training in a thread the main thread outlived)
            done: Future[None] = Future()
            _pack_no_grad(layout, tensors, buf)
            done.set_result(None)
            return CopyInFlight(done)

    def close(self) -> None:
        """Let the copy thread end once its copies are done."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def stage(self, tensors: list[torch.Tensor], live: list[bool],
              pool: HostPool | None = None) -> tuple[list[torch.Tensor], Any, Callable[[], None] | None]:
        """Host copies of ``tensors`` the caller owns; an event they are complete at (None: complete now); and
        a callback that hands pooled buffers back once the copies are no longer used (None: nothing pooled).

        ``live[i]``: the tensor may be changed in place after this call (a parameter, optimizer state, a
        gradient); otherwise it is a fresh tensor nothing else writes to (a compressor's payload). With
        ``pool``, live CPU tensors are copied into reused buffers of it."""
        cuda = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
        if not self.asynchronous or not cuda:
            if pool is not None:
                return _pooled_copy(tensors, live, pool)
            return [_host_copy(t, lv) for t, lv in zip(tensors, live)], None, None
        out = [t if t.device.type == "cuda" else _host_copy(t, lv) for t, lv in zip(tensors, live)]
        main = torch.cuda.current_stream(self.device)
        nbytes = sum(tensors[i].numel() * tensors[i].element_size() for i in cuda)
        spare = self._fits(nbytes)
        by_dtype = _by_dtype(tensors, cuda)
        # With spare memory: one concatenation per dtype on the training stream (a private copy, so live tensors
        # may change at once), then ONE pinned buffer and ONE copy per dtype on the side stream: a few CUDA calls
        # per step instead of several per tensor. Host tensors are views into the pinned buffer.
        flats = {dt: torch.cat([tensors[i].detach().reshape(-1) for i in idx]) for dt, idx in by_dtype.items()} \
            if spare else {}
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for dt, idx in by_dtype.items():
                if spare:
                    _views_into(_pinned(flats[dt]), tensors, idx, out)
                    continue
                for i in idx:  # no room for copies on the device: read the live tensors themselves
                    out[i] = _pinned(tensors[i].detach())
        event = torch.cuda.Event()
        event.record(self.stream)
        if not spare:
            main.wait_event(event)  # nothing on the training stream may change the sources before they are read
        return out, event, None  # pinned buffers: the caching host allocator reuses them


    def pack(self, layout: StepLayout, tensors: list[torch.Tensor] | None, buf: torch.Tensor,
             kind: str = "step") -> Any:
        """Copy ``tensors`` (all on ``layout.device``) into the host buffer ``buf`` as ``layout`` places them; the
        event the copies complete at (None: complete now). On a GPU, with spare device memory, one concatenation
        per region on the training stream (a private copy: live tensors may change at once) and one copy per region
        into ``buf`` on the side stream; ``buf`` should be pinned for the copies to be asynchronous. ``kind``:
        "step" (a step's record) or "snapshot", for lowdiff.testing.copies_in_flight. ``tensors`` None: they lie
        in ``buf`` already (a compressor wrote them there), nothing is copied."""
        ready = None if tensors is None else \
            self._pack(layout, tensors, buf, self.snapshot_stream if kind == "snapshot" else self.stream)
        return copy_event(kind, ready)

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in the spare device memory: asked of the driver every SPARE_EVERY calls per size,
        not every step."""
        fits, left = self._spare.get(nbytes, (False, 0))
        if left <= 0:
            fits = nbytes <= SPARE_FRACTION * torch.cuda.mem_get_info(self.device)[0]
            left = SPARE_EVERY
            if len(self._spare) >= POOL_MAX_FREE:  # sizes that keep changing (a mixture of experts): kept bounded
                self._spare.clear()
        self._spare[nbytes] = (fits, left - 1)
        return fits

    def _pack(self, layout: StepLayout, tensors: list[torch.Tensor], buf: torch.Tensor, stream: Any) -> Any:
        if layout.device.type != "cuda" or not self.asynchronous:
            if layout.device.type != "cpu":
                tensors = [t.cpu() for t in tensors]
            pack_host(layout, tensors, buf)
            return None
        main = torch.cuda.current_stream(self.device)
        spare = self._fits(layout.nbytes)
        parts = region_parts(layout, tensors)
        flats = [torch.cat(p) for p, _ in parts] if spare else []
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            if spare:
                for flat, (_, r) in zip(flats, parts):
                    region_view(buf, layout, r).copy_(flat, non_blocking=True)
                    flat.record_stream(stream)
            else:  # no room for a private copy on the device: read the tensors themselves, training waits below
                for p, r in parts:
                    dst, at = region_view(buf, layout, r, flat=True), 0
                    for t in p:
                        dst[at:at + t.numel()].copy_(t.reshape(-1), non_blocking=True)
                        at += t.numel()
        event = torch.cuda.Event()
        event.record(stream)
        if not spare:
            main.wait_event(event)
        return event


@dataclass
class Slot:
    """A host buffer a step is packed into (lowdiff._transfer.packing). ``handle``: where it lives for the sink that
    gave it (None: a private buffer); ``release``: give it back once the record is persisted or dropped."""

    buf: torch.Tensor
    handle: Any
    release: Callable[[], None] | None


class HostSlots:
    """The writer thread's slots: pooled host buffers (pinned ones when the copies come from a GPU, allocated once
    per size and reused). Snapshots have a pool of their own, so a step never takes a snapshot's buffer."""

    def __init__(self) -> None:
        self._pool = HostPool()
        self._snapshot_pool = HostPool()

    def alloc(self, nbytes: int, pinned: bool) -> Slot:
        return _slot(self._pool, nbytes, pinned)

    def alloc_snapshot(self, nbytes: int, pinned: bool) -> Slot:
        return _slot(self._snapshot_pool, nbytes, pinned)

    @property
    def reused(self) -> int:
        return self._pool.reused

    @property
    def snapshots_reused(self) -> int:
        return self._snapshot_pool.reused


def _slot(pool: HostPool, nbytes: int, pinned: bool) -> Slot:
    # Pinned ones too: a cache miss of the caching host allocator is a cudaHostAlloc on the training thread. Given
    # back once the writer has written the record, after waiting for its copies.
    buf = pool.take(torch.uint8, nbytes, pinned)
    return Slot(buf, None, lambda: pool.give(buf))


def _pinned(src: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that ``src`` is being copied into on the current (side) stream."""
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    # The caching allocator must not hand src's memory out again before the copy has read it.
    src.record_stream(torch.cuda.current_stream(src.device))
    return dst


def _pooled_copy(tensors: list[torch.Tensor], live: list[bool],
                 pool: HostPool) -> tuple[list[torch.Tensor], None, Callable[[], None] | None]:
    out = [_host_copy(t, False) for t in tensors]  # CPU: the tensors themselves; CUDA ones copied now
    bufs = []
    live_cpu = [i for i, (t, lv) in enumerate(zip(tensors, live)) if lv and t.device.type == "cpu"]
    for dt, idx in _by_dtype(tensors, live_cpu).items():
        buf = pool.take(dt, sum(tensors[i].numel() for i in idx))
        torch.cat([tensors[i].detach().reshape(-1) for i in idx], out=buf)
        bufs.append(buf)
        _views_into(buf, tensors, idx, out)
    if not bufs:
        return out, None, None

    def release() -> None:
        for b in bufs:
            pool.give(b)

    return out, None, release


def _by_dtype(tensors: list[torch.Tensor], indices: list[int]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i in indices:
        groups.setdefault(tensors[i].dtype, []).append(i)
    return groups


def _views_into(flat: torch.Tensor, tensors: list[torch.Tensor], idx: list[int], out: list[torch.Tensor]) -> None:
    """out[i] = the piece of ``flat`` holding tensors[i] (concatenated in ``idx`` order), in its shape."""
    for i, part in zip(idx, torch.split(flat, [tensors[i].numel() for i in idx])):
        shape = tensors[i].shape
        out[i] = part if part.shape == shape else part.view(shape)


def _host_copy(t: torch.Tensor, live: bool) -> torch.Tensor:
    if t.device.type != "cpu":
        return t.detach().to("cpu", copy=True)
    return t.detach().clone() if live else t.detach()


_copy_delay_s = 0.0
_copy_events: Callable[[str], Any] | None = None


def set_copy_events(make_event: Callable[[str], Any] | None) -> Callable[[str], Any] | None:
    """Report every copy :meth:`HostCopier.pack` makes as completing at ``make_event(kind)`` instead of its own
    event (lowdiff.testing.copies_in_flight; None: their own); returns the function in force before."""
    global _copy_events
    previous, _copy_events = _copy_events, make_event
    return previous


def copies_pretend() -> bool:
    """Whether a test says when copies complete (:func:`set_copy_events`)."""
    return _copy_events is not None


def copy_event(kind: str, ready: Any) -> Any:
    """The event a copy of ``kind`` ("step", "snapshot", "scalar") completes at: ``ready``, its own, unless a test
    says otherwise (:func:`set_copy_events`)."""
    return _copy_events(kind) if _copy_events is not None else ready


def set_copy_delay(seconds: float) -> float:
    """Make every copy on a copier's thread take ``seconds`` longer (lowdiff.testing.slow_copies); returns the
    delay in force before."""
    global _copy_delay_s
    previous, _copy_delay_s = _copy_delay_s, seconds
    return previous


def _pack_on_copy_thread(layout: StepLayout, tensors: list[torch.Tensor], buf: torch.Tensor) -> None:
    if _copy_delay_s > 0:
        time.sleep(_copy_delay_s)
    _pack_no_grad(layout, tensors, buf)


def _pack_no_grad(layout: StepLayout, tensors: list[torch.Tensor], buf: torch.Tensor) -> None:
    with torch.no_grad():  # per thread: parameters may require grad, and cat(out=) refuses to record it
        pack_host(layout, tensors, buf)


def on_copy_thread() -> bool:
    """Whether the caller runs on a copier's thread (where a garbage collection may finalize an optimizer nobody
    closed: its close, which waits for that thread's copy, must run elsewhere; lowdiff._training.lifecycle)."""
    return threading.current_thread().name.startswith(COPY_THREAD)
