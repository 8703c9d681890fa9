"""Step records packed into one flat host buffer: a few copies on the training thread, views elsewhere.

A step's payload tensors (hundreds: Top-k's values and indices, PowerSGD's factors, per parameter) and the buffers
it changed are concatenated straight into a host buffer (a slot of the persistence process's shared ring,
or a pooled host buffer for the writer thread): one ``torch.cat`` per region, whose Python cost does not grow with
the number of parameters beyond building two lists. A region holds the tensors of one dtype and one row shape
(every dimension but the first: ``()`` for 1-D tensors, ``(r,)`` for PowerSGD's rank-r factors, ``(in,)`` for the
weight gradients of Linear layers), so they concatenate along their first dimension as they are: reshaping each to
1-D first cost more than the copy on fast steps (266 ``reshape`` calls took 0.33 ms, the copy without them 0.06 ms).
Where a compressor wrote the payloads into flat buffers (Top-k, PowerSGD: lowdiff._compressors.step_buffers), the
region of a dtype holds all its payloads flattened, whatever their shapes, and a step copies the flats (one per
dtype) without a Python operation per tensor.
The layout (which tensor lies where) is the same from step to step (Top-k's k, PowerSGD's rank and the gradients'
shapes are fixed), so it is computed once, given an id, and only checked afterwards. The writer turns the buffer
back into per-tensor views (lowdiff._storage.packed.unpack) on its own thread or in its own process, never on the
training thread.

Keys are ``(parameter, field)`` for payloads and ``("", buffer name)`` for changed buffers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

import torch

from lowdiff._storage.packed import Key, Region, Wire
from lowdiff._transfer.ring import aligned, copy_region

Rows = tuple[int, ...] | None
"""A region's row shape: its tensors' dimensions but the first; None for tensors flattened to 1-D (0-d ones, and
those with a zero dimension past the first)."""


@dataclass(frozen=True)
class StepLayout:
    id: int
    keys: list[Key]
    sizes: list[torch.Size]
    dtypes: list[torch.dtype]
    """Per key, its tensor's shape and dtype (two lists: :meth:`StepPacker.plan` compares each at C speed)."""
    regions: list[Region]
    places: list[tuple[int, tuple[int, ...]]]
    members: list[list[int]]
    """Per region, the indices (into keys) of its tensors, in order."""
    rows: list[Rows]
    """Per region, the row shape of its tensors."""
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


_shape = attrgetter("shape")
_dtype = attrgetter("dtype")

_LAYOUT_IDS = itertools.count(1)
"""Layout ids are unique in the process: a persistence process keeps the layouts of several packers by id."""


class StepPacker:
    """Plans step layouts: the previous one is reused while keys, dtypes and shapes stay the same."""

    def __init__(self) -> None:
        self._layout: StepLayout | None = None

    def plan(self, keys: list[Key], tensors: list[torch.Tensor]) -> tuple[StepLayout | None, bool]:
        """The layout of these tensors and whether it is new; (None, False) when they cannot be packed together
        (on different devices)."""
        old = self._layout
        # Checked every step, in two passes of C-level attribute reads: half the cost of building (dtype, shape)
        # pairs, for Top-k's hundreds of tensors.
        if (old is not None and keys == old.keys and list(map(_shape, tensors)) == old.sizes
                and list(map(_dtype, tensors)) == old.dtypes):
            return old, False
        self._layout = layout_of(keys, tensors)
        return self._layout, self._layout is not None


def layout_of(keys: list[Key], tensors: list[torch.Tensor], flat: int = 0) -> StepLayout | None:
    """A new layout for these tensors; None when they cannot be packed together (on different devices). The first
    ``flat`` tensors are flattened: one region per dtype holds them all, whatever their shapes (:func:`from_flats`)."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return None
    return _layout(next(_LAYOUT_IDS), keys, [(t.dtype, t.shape) for t in tensors],
                   next(iter(devices), torch.device("cpu")), flat)


def _layout(lid: int, keys: list[Key], shapes: list[tuple[torch.dtype, torch.Size]],
            device: torch.device, flat: int = 0) -> StepLayout:
    index: dict[tuple[torch.dtype, Rows], int] = {}
    numels: list[int] = []
    members: list[list[int]] = []
    places = []
    payload = 0
    for i, ((name, _), (dt, shape)) in enumerate(zip(keys, shapes)):
        # Rows with a zero dimension cannot be viewed as (-1, *rows): such tensors (and 0-d ones) are flattened.
        rows = tuple(shape[1:]) if i >= flat and len(shape) and 0 not in shape[1:] else None
        r = index.setdefault((dt, rows), len(index))
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
    for (dt, _), r in index.items():
        regions.append((dt, offset, numels[r]))
        offset += aligned(numels[r] * dt.itemsize)
    return StepLayout(lid, list(keys), [s for _, s in shapes], [d for d, _ in shapes], regions, places, members,
                      [rows for _, rows in index], device, offset, payload)


def from_flats(layout: StepLayout, n_payload: int,
               flats: dict[torch.dtype, int]) -> tuple[StepLayout, list[torch.dtype]] | None:
    """``layout`` packed from other pieces: the flat tensors a compressor wrote a step's payloads into, one per
    dtype (lowdiff._compressors.base.StepPayloads; ``flats``: their numel), then the buffers. The payloads are
    ``layout``'s first ``n_payload`` keys, flattened (``layout_of(..., flat=n_payload)``: any shape), and lie in their
    flat in key order; then the region of a dtype begins with its whole flat, and a step is packed by copying the
    flats instead of concatenating the payloads.
    Returns the layout whose ``members`` index ``[flat of each dtype returned, in order] + buffers``, or None when
    the payloads do not lie that way."""
    order: list[torch.dtype] = []
    heads: list[int] = []
    for (dt, _, _), members, rows in zip(layout.regions, layout.members, layout.rows):
        head = sum(1 for i in members if i < n_payload)
        if head and (rows is not None or any(i >= n_payload for i in members[:head]) or dt in order
                     or flats.get(dt) != sum(layout.sizes[i].numel() for i in members[:head])):
            return None
        if head:
            order.append(dt)
        heads.append(head)
    if len(order) != len(flats):
        return None
    pieces = [([order.index(layout.regions[r][0])] if head else [])
              + [len(order) + i - n_payload for i in layout.members[r][head:]] for r, head in enumerate(heads)]
    return replace(layout, id=next(_LAYOUT_IDS), members=pieces), order


def region_parts(layout: StepLayout, tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], int]]:
    """Per region, the tensors to concatenate into it (along their first dimension) and the region's index."""
    out = []
    for r, (members, rows) in enumerate(zip(layout.members, layout.rows)):
        parts = [tensors[i] for i in members] if rows is not None else [tensors[i].reshape(-1) for i in members]
        out.append((parts, r))
    return out


def region_view(buf: torch.Tensor, layout: StepLayout, r: int, *, flat: bool = False) -> torch.Tensor:
    """Region ``r`` of ``buf`` in the shape its tensors concatenate into (1-D with ``flat``)."""
    dt, offset, numel = layout.regions[r]
    view = buf[offset:offset + numel * dt.itemsize].view(dt)
    rows = layout.rows[r]
    return view if flat or not rows else view.view(-1, *rows)


def pack_host(layout: StepLayout, tensors: list[torch.Tensor], buf: torch.Tensor) -> None:
    """Copy CPU ``tensors`` into ``buf`` (uint8, at least ``layout.nbytes``): one concatenation per region."""
    for parts, r in region_parts(layout, tensors):
        copy_region(parts, region_view(buf, layout, r))
