"""Reading a packed buffer: a step record's or a snapshot's tensors as views of the one buffer they were packed
into (by the trainer, lowdiff._transfer.packing; in the persistence process's shared ring, lowdiff._transfer.ring).

The reader's half of the packing: the writer thread, the persistence process and recovery's tests read packed
buffers with it, on their own side of the trainer. A :data:`Wire` is what a reader needs to know of a layout.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

Key = tuple[str, str]
"""``(parameter, field)`` for a payload tensor, ``("", buffer name)`` for a changed buffer."""
Region = tuple[torch.dtype, int, int]
"""(dtype, byte offset in the buffer, elements): the tensors of one region, concatenated in key order."""
Wire = tuple[list[Key], list[Region], list[tuple[int, tuple[int, ...]]]]
"""What the reader of a packed buffer needs: keys, regions, and per key (region index, shape)."""


class Ref:
    """A tensor's place in a packed message: index into the layout."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ref, (self.i,))


def unpack_skeleton(skel: Any, regions: list[tuple[torch.dtype, int, int]], places: list[tuple[int, tuple[int, ...]]],
           src: torch.Tensor) -> Any:
    """The object :func:`skeleton` was given, its tensors now views into ``src`` (the allocation's bytes)."""
    return _fill(skel, views(regions, places, src))


def views(regions: list[tuple[torch.dtype, int, int]], places: list[tuple[int, tuple[int, ...]]],
          src: torch.Tensor) -> list[torch.Tensor]:
    """Per place (region index, shape), in order, the tensor it describes: a view into ``src``.

    One ``split`` per region: a region whose tensors share a row shape is split along its first dimension into
    tensors already shaped (Top-k's hundreds of 1-D values and indices, PowerSGD's rank-r factors); slicing and
    reshaping each tensor in Python cost 3 us apiece, 1.25 ms a step for Top-k's 384 on the 48-block MLP, on the
    writer's side (against 0.19 ms)."""
    placed: list[torch.Tensor] = [None] * len(places)  # type: ignore[list-item]
    for (dt, offset, numel), (members, sizes, rows, shapes) in zip(regions, _split_plan(regions, places)):
        if not members:
            continue
        flat = src[offset:offset + numel * dt.itemsize].view(dt)
        if rows is not None:
            parts = flat.view(-1, *rows).split(sizes)
        else:
            parts = [t.view(shape) for t, shape in zip(flat.split(sizes), shapes)]
        for i, t in zip(members, parts):
            placed[i] = t
    return placed


T = TypeVar("T")
_Plan = list[tuple[list[int], list[int], "tuple[int, ...] | None", list[tuple[int, ...]]]]
_PLANS: OrderedDict[int, tuple[Any, Any, _Plan]] = OrderedDict()
_PLANS_KEPT = 128
"""Split plans kept, by the identity of the ``places`` list (a layout's, reused every step), the latest used last."""
_PLANS_LOCK = threading.Lock()
_BYTE_PLANS: OrderedDict[int, tuple[Any, Any, BytePlan]] = OrderedDict()


def _split_plan(regions: list[tuple[torch.dtype, int, int]], places: list[tuple[int, tuple[int, ...]]]) -> _Plan:
    """Per region: the indices of its places in order, the sizes to split it into (rows, or elements when the
    tensors do not share a row shape), the row shape (None: split flat, then view each) and the shapes."""
    return _kept(_PLANS, places, regions, lambda: _build_split_plan(regions, places))


def _build_split_plan(regions: list[tuple[torch.dtype, int, int]], places: list[tuple[int, tuple[int, ...]]]
                      ) -> _Plan:
    members: list[list[int]] = [[] for _ in regions]
    for i, (r, _) in enumerate(places):
        members[r].append(i)
    plan: _Plan = []
    for idx in members:
        shapes = [tuple(places[i][1]) for i in idx]
        rows = shapes[0][1:] if shapes and shapes[0] else None
        if rows is not None and all(d > 0 for d in rows) and all(s and s[1:] == rows for s in shapes):
            sizes = [s[0] for s in shapes]
        else:
            rows = None
            sizes = [math.prod(s) for s in shapes]
        plan.append((idx, sizes, rows, shapes))
    return plan


def _kept(cache: OrderedDict[int, tuple[Any, Any, Any]], places: Any, regions: Any, build: Callable[[], T]) -> T:
    """``build()``'s plan of a layout, kept in ``cache`` by the identity of its ``places`` list (the latest used
    last, at most _PLANS_KEPT): the writer thread and the training thread (a snapshot) may both ask."""
    with _PLANS_LOCK:
        hit = cache.get(id(places))
        if hit is not None and hit[0] is places and hit[1] is regions:  # kept alive here: ids are not reused
            cache.move_to_end(id(places))
            return hit[2]
    plan = build()
    with _PLANS_LOCK:
        cache[id(places)] = (places, regions, plan)
        while len(cache) > _PLANS_KEPT:
            cache.popitem(last=False)
    return plan


class BytePlan(NamedTuple):
    """Where each key of a layout lies in its packed buffer, as bytes (:func:`byte_plan`)."""

    spans: list[tuple[int, int]]
    """Per key, (byte offset in the buffer, bytes)."""
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    """Per key, its tensor's dtype and shape."""
    grouped: list[int]
    """The payload keys (a parameter's), grouped by parameter in order of first appearance, each parameter's fields
    in their order: the order :func:`unpack` gives them in."""
    nbytes: int
    """The end of the last key's bytes."""


def byte_plan(wire: Wire) -> BytePlan:
    """The :class:`BytePlan` of a layout, computed once per layout (kept like :func:`views`'s split plans)."""
    return _kept(_BYTE_PLANS, wire[2], wire[1], lambda: _build_byte_plan(wire))


def _build_byte_plan(wire: Wire) -> BytePlan:
    keys, regions, places = wire
    at = [offset for _, offset, _ in regions]
    spans = []
    for r, shape in places:
        n = math.prod(shape) * regions[r][0].itemsize
        spans.append((at[r], n))
        at[r] += n
    by_name: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(keys):
        if name:
            by_name.setdefault(name, []).append(i)
    return BytePlan(spans, [regions[r][0] for r, _ in places], [tuple(s) for _, s in places],
                    [i for idx in by_name.values() for i in idx], max((a + n for a, n in spans), default=0))


class ReadLayout:
    """What a reader holds of a layout: its :data:`Wire` (the ``layout`` of a :class:`Received` step)."""

    __slots__ = ("wire",)

    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    @property
    def payload_nbytes(self) -> int:
        plan = byte_plan(self.wire)
        return sum(plan.spans[k][1] for k in plan.grouped)


class Received:
    """A step packed in ``buf`` (uint8) as ``layout.wire`` places it, as the persistence process receives it: what
    ``StepRecord.packed`` holds on the writer's side (the trainer's is lowdiff._transfer.packing.PackedStep)."""

    __slots__ = ("buf", "layout")

    def __init__(self, buf: torch.Tensor, wire: Wire) -> None:
        self.buf = buf
        self.layout = ReadLayout(wire)

    def owned(self) -> Received:
        """A copy whose buffer is its own (the ring slot can be given back)."""
        return Received(self.buf[:byte_plan(self.layout.wire).nbytes].clone(), self.layout.wire)


def _fill(obj: Any, placed: list[torch.Tensor]) -> Any:
    if isinstance(obj, Ref):
        return placed[obj.i]
    if isinstance(obj, dict):
        return {k: _fill(v, placed) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, placed) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(v, placed) for v in obj)
    return obj


def unpack(wire: Wire, buf: torch.Tensor) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(payloads by parameter and field, changed buffers) of a buffer packed with ``wire``, as views of ``buf``."""
    keys, regions, places = wire
    grads: dict[str, dict[str, torch.Tensor]] = {}
    buffers: dict[str, torch.Tensor] = {}
    for (name, field), t in zip(keys, views(regions, places, buf)):
        if name:
            grads.setdefault(name, {})[field] = t
        else:
            buffers[field] = t
    return grads, buffers
