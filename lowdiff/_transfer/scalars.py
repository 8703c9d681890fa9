"""One-element tensors read without making the training thread wait for their device (issue 35).

A tensor hyperparameter (a learning rate on the GPU, which a scheduler's ``fill_`` changes every step) and a
GradScaler's scale are logged with every step; ``.item()`` would make the host wait until the device has run
everything queued before it, which costs the training thread its lead over the GPU. :func:`read_later` instead
queues a copy of the value into pinned host memory (``non_blocking``, on the current stream, an event after it;
the buffer comes from torch's caching host allocator, so steps after the first allocate none) and returns a
:class:`ScalarCopy`, a :class:`lowdiff._storage.later.Later` that the writer reads once the copy is done: the
writer thread when it writes the record, the persistence process's hand-over when the message goes
(lowdiff._persist.handover sends the end state of an iteration only once its copies are seen complete).

On the CPU the value is read at once, from the tensor's memory (no operator: the step guards look for ``.item()``),
except while a test says when copies complete (``lowdiff.testing.copies_in_flight``, kind "scalar"): then it is
cloned and read later, as on a GPU, so CPU tests see the GPU's order of events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from lowdiff._storage.later import Later
from lowdiff._transfer.host_copies import copies_pretend, copy_event

LAZY_DEVICES = ("cpu", "cuda")
"""Where a value is copied and read later; anything else is read at once (``.item()``)."""

T = TypeVar("T")


def host_number(t: torch.Tensor) -> bool | int | float:
    """The value of a one-element host tensor as ``.item()`` gives it, read from its memory (no operator: a
    ``.item()`` here is what the step guards look for)."""
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are the upper half of a float32's
        bits = int(t.view(torch.int16).numpy().reshape(-1)[0]) & 0xFFFF
        return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (float8), a negative or conjugate view
        return t.item()
    value: bool | int | float = arr.reshape(-1)[0].item()
    return value


class ScalarCopy(Later):
    """The value of a one-element tensor as it was when this was made, copied to host memory: ``ready()`` once
    the copy is done, ``get()`` the number (waits for the copy if needed)."""

    __slots__ = ("_host", "_event", "_value")

    def __init__(self, value: torch.Tensor) -> None:
        src = value.detach()
        event: Any = None
        if src.device.type == "cuda":
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)  # the caching host allocator's
            host.copy_(src, non_blocking=True)  # on the current stream of the source's device
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(src.device))
        else:
            host = src.clone()
        self._host: torch.Tensor | None = host
        self._event = copy_event("scalar", event)
        self._value: bool | int | float = 0

    def ready(self) -> bool:
        event = self._event
        return self._host is None or event is None or bool(event.query())

    def get(self) -> bool | int | float:
        host, event = self._host, self._event
        if host is not None:
            if event is not None and not event.query():
                event.synchronize()
            self._value = host_number(host)
            self._host = self._event = None  # after the value: another thread reading now sees one or the other
        return self._value


def read_later(value: torch.Tensor) -> Later | bool | int | float:
    """A one-element tensor's value as :func:`lowdiff._storage.format.encode_value` takes it (its ``read``): a
    :class:`ScalarCopy` on a GPU; on the CPU the number, read from its memory at once (nothing to wait for), or a
    copy too while a test says when copies complete (``lowdiff.testing.copies_in_flight``); elsewhere the number
    (``.item()``)."""
    if value.device.type == "cpu" and not copies_pretend():
        return host_number(value.detach())
    if value.device.type not in LAZY_DEVICES:
        number: bool | int | float = value.detach().cpu().item()
        return number
    return ScalarCopy(value)


class ScalarReader:
    """:func:`read_later` for the training thread, each tensor copied once between two calls of :meth:`fresh`.

    An iteration's end state is taken when its end calls have run (``sched.step()``), taken again when it ends (the
    next ``opt.step()``), and the next step's groups right after: copies made at the end calls are reused by the
    later two when the tensor is the same object at the same version (a GradScaler's growth tracker: at its
    scale's version, since ``torch._amp_update_scale_`` leaves the tracker's counter alone). Across iterations
    nothing is reused (:meth:`fresh`): a write that the version counter misses (through ``.data``) is seen at the
    next iteration's end calls, unless made between an iteration's end calls and its seal. :meth:`collect` says
    which copies an encoding used."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[torch.Tensor, int, Later | bool | int | float]] = {}
        self._used: list[Later] | None = None

    def fresh(self) -> None:
        """Copy every tensor read from now on again."""
        self._made.clear()

    def __call__(self, value: torch.Tensor, versioned_by: torch.Tensor | None = None
                 ) -> Later | bool | int | float:
        """``value``'s copy; ``versioned_by``: a tensor whose version counter changes whenever ``value`` does."""
        try:
            version = (value if versioned_by is None else versioned_by)._version
        except (RuntimeError, TypeError):  # inference tensors have no version counter
            version = -1
        hit = self._made.get(id(value))
        if hit is not None and hit[0] is value and hit[1] == version >= 0:
            got = hit[2]
        else:
            got = read_later(value)
            self._made[id(value)] = (value, version, got)  # held until fresh(): its id is not reused meanwhile
        if self._used is not None and isinstance(got, Later):
            self._used.append(got)
        return got

    def collect(self, fn: Callable[..., T], *args: Any) -> tuple[T, list[Later]]:
        """``fn(*args)``, and the copies this reader handed out during it."""
        outer, self._used = self._used, []
        try:
            return fn(*args), self._used
        finally:
            self._used = outer
