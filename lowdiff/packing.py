"""Step records packed into one flat host buffer: one copy per dtype on the training thread, views elsewhere.

A step's payload tensors (hundreds: Top-k's values and indices, PowerSGD's factors, per parameter) and the buffers
it changed are concatenated per dtype straight into a host buffer (a slot of the persistence process's shared ring,
or a pooled host buffer for the writer thread): one ``torch.cat`` per dtype, whose Python cost does not grow with
the number of parameters beyond building two lists. The layout (which tensor lies where) is the same from step to
step (Top-k's k, PowerSGD's rank and the gradients' shapes are fixed), so it is computed once, given an id, and only
checked afterwards. The writer turns the buffer back into per-tensor views (:func:`unpack`) on its own thread or
in its own process, never on the training thread.

Keys are ``(parameter, field)`` for payloads and ``("", buffer name)`` for changed buffers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from lowdiff import ring
from lowdiff.ring import aligned, copy_region

Key = tuple[str, str]
Region = tuple[torch.dtype, int, int]
"""(dtype, byte offset in the buffer, elements): the tensors of one dtype, concatenated in key order."""
Wire = tuple[list[Key], list[Region], list[tuple[int, tuple[int, ...]]]]
"""What the reader of a packed buffer needs: keys, regions, and per key (region index, shape)."""


@dataclass(frozen=True)
class StepLayout:
    id: int
    keys: list[Key]
    shapes: list[tuple[torch.dtype, torch.Size]]
    regions: list[Region]
    places: list[tuple[int, tuple[int, ...]]]
    members: list[list[int]]
    """Per region, the indices (into keys) of its tensors, in order."""
    flat: bool
    """Every tensor is 1-D (no reshape needed to concatenate)."""
    device: torch.device
    nbytes: int
    payload_nbytes: int
    """Bytes of the payloads alone (buffers excluded): what the tuner counts as a record's size."""

    @property
    def wire(self) -> Wire:
        return self.keys, self.regions, self.places


@dataclass
class PackedStep:
    """A step's payloads and changed buffers in ``buf`` (uint8) as ``layout`` places them. ``handle``: where the
    buffer lives for the writer that gave it (a ring slot's ids), None for a private host buffer."""

    buf: torch.Tensor
    layout: StepLayout
    handle: Any = None


KNOWN_LAYOUTS = 64
"""Layouts a persistence process keeps, the newest first sent: both sides forget the oldest in the same order, so
a step whose parameters with gradients keep changing (a mixture of experts) does not grow them without bound."""


def remember(known: dict[int, Any], lid: int, wire: Any) -> None:
    """Add layout ``lid`` to ``known`` (insertion-ordered), forgetting the oldest past KNOWN_LAYOUTS."""
    known[lid] = wire
    while len(known) > KNOWN_LAYOUTS:
        del known[next(iter(known))]


_LAYOUT_IDS = itertools.count(1)
"""Layout ids are unique in the process: a persistence process keeps the layouts of several packers by id."""


class StepPacker:
    """Plans step layouts: the previous one is reused while keys, dtypes and shapes stay the same."""

    def __init__(self) -> None:
        self._layout: StepLayout | None = None

    def plan(self, keys: list[Key], tensors: list[torch.Tensor]) -> tuple[StepLayout | None, bool]:
        """The layout of these tensors and whether it is new; (None, False) when they cannot be packed together
        (on different devices)."""
        shapes = [(t.dtype, t.shape) for t in tensors]
        old = self._layout
        if old is not None and shapes == old.shapes and keys == old.keys:
            return old, False
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            return None, False
        self._layout = _layout(next(_LAYOUT_IDS), keys, shapes, next(iter(devices), torch.device("cpu")))
        return self._layout, True


def _layout(lid: int, keys: list[Key], shapes: list[tuple[torch.dtype, torch.Size]],
            device: torch.device) -> StepLayout:
    index: dict[torch.dtype, int] = {}
    numels: list[int] = []
    members: list[list[int]] = []
    places = []
    payload = 0
    for i, ((name, _), (dt, shape)) in enumerate(zip(keys, shapes)):
        r = index.setdefault(dt, len(index))
        if r == len(numels):
            numels.append(0)
            members.append([])
        n = shape.numel()
        numels[r] += n
        members[r].append(i)
        places.append((r, tuple(shape)))
        if name:
            payload += n * dt.itemsize
    regions, offset = [], 0
    for dt, r in index.items():
        regions.append((dt, offset, numels[r]))
        offset += aligned(numels[r] * dt.itemsize)
    return StepLayout(lid, list(keys), shapes, regions, places, members, all(len(s) == 1 for _, s in shapes),
                      device, offset, payload)


def region_parts(layout: StepLayout, tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], Region]]:
    """Per region, the 1-D tensors to concatenate into it."""
    out = []
    for region, members in zip(layout.regions, layout.members):
        parts = [tensors[i] for i in members] if layout.flat else [tensors[i].reshape(-1) for i in members]
        out.append((parts, region))
    return out


def region_view(buf: torch.Tensor, region: Region) -> torch.Tensor:
    dt, offset, numel = region
    return buf[offset:offset + numel * dt.itemsize].view(dt)


def pack_host(layout: StepLayout, tensors: list[torch.Tensor], buf: torch.Tensor) -> None:
    """Copy CPU ``tensors`` into ``buf`` (uint8, at least ``layout.nbytes``): one concatenation per dtype."""
    for parts, region in region_parts(layout, tensors):
        copy_region(parts, region_view(buf, region))


def unpack(wire: Wire, buf: torch.Tensor) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(payloads by parameter and field, changed buffers) of a buffer packed with ``wire``, as views of ``buf``."""
    keys, regions, places = wire
    grads: dict[str, dict[str, torch.Tensor]] = {}
    buffers: dict[str, torch.Tensor] = {}
    for (name, field), t in zip(keys, ring.unpack([ring.Ref(i) for i in range(len(keys))], regions, places, buf)):
        if name:
            grads.setdefault(name, {})[field] = t
        else:
            buffers[field] = t
    return grads, buffers
