"""A log segment's bytes built straight from steps still packed with one layout (a writer thread's steady state).

A segment stores each (parameter, field) as one column: its bytes at every step, back to back (segment.py). Each
step arrives packed, its tensors back to back in one buffer (lowdiff._transfer.packing), so a column is the same
byte range cut from every step's buffer. Turning each buffer into per-tensor views first and joining a column's
views cost several torch calls per tensor and step (Top-k on the 41-block MLP: 328 tensors, 16 steps, about 22 ms
of the writer's CPU a segment, against 15 ms this way); a writer thread's torch calls each release the GIL, which a
Python-bound training thread takes in between and then waits to get back (docs/measurements/gil.md). Here the
steps are stacked into one (steps x bytes) array with one numpy call, and each column is copied out of it with
one more: per segment, a numpy call per column and no torch call per tensor. The result is one buffer holding
every entry's bytes in entry order (write_container's ``joined``).

Both buffers are kept by the writing thread for its next segment (up to :data:`KEEP_BYTES` each): fresh ones cost
the writer a page fault and the kernel a page of zeros per 4 kB, every segment (about 4.5 of the 7 ms that stacking
and joining 14 MB took; copying 192 MB into a fresh buffer took 200-280 ms on the 2-core VM, into a kept one 13-16
ms, and with the old 128 MB limit compressor none's 198 MB segments of a 50M model paid that twice a segment). The
joined buffer is page-aligned, and the container aligns its data region in the file, so a direct write takes it from
where it lies, without the bounce copy (lowdiff._storage.direct_io).
"""

from __future__ import annotations

import mmap
import threading
from typing import Any

import numpy as np
import torch

from lowdiff._storage.container import EntryIn
from lowdiff._storage.format import dtype_name
from lowdiff._storage.packed import BytePlan, byte_plan

KEEP_BYTES = 1 << 30
"""The largest buffer a thread keeps for its next segment; a larger segment's buffers are made afresh and freed.
Segments of a run are of about one size, so a kept buffer raises the writer's memory between segments, not its
peak."""
_GRAIN = 1 << 20
_scratch = threading.local()  # per writing thread: a writer thread, a persistence process's writer


def uniform(records: list[Any], keep_field: str) -> BytePlan | None:
    """The byte plan of the layout every record is packed with; None where one is not packed, holds tensors outside
    its buffer, is packed with another layout, or holds a ``keep_field`` (its repeats are dropped per step)."""
    first = records[0].packed
    if first is None:
        return None
    wire = first.layout.wire
    for r in records:
        if r.packed is None or r.grads or r.buffers or r.packed.layout.wire[2] is not wire[2]:
            return None
    if any(f == keep_field for _, f in wire[0]):
        return None
    return byte_plan(wire)


def packed_entries(records: list[Any], plan: BytePlan, tail: list[EntryIn]) -> tuple[list[EntryIn], memoryview]:
    """The entries of ``records`` (all packed as ``plan`` says): the gradient columns, then each buffer at the
    steps where its bytes changed, then ``tail`` (small entries of tensors: the RNG states), and one buffer
    holding all their bytes in that order; each entry's ``raw`` is its slice of it."""
    keys = records[0].packed.layout.wire[0]
    steps = len(records)
    rows = [r.packed.buf.numpy()[:plan.nbytes] for r in records]
    # One copy of every step: columns are then strided slices of it. A one-step segment (compressor none's, a
    # step's whole gradient) is sliced from its step's buffer as it lies.
    stacked = rows[0].reshape(1, plan.nbytes) if steps == 1 else \
        np.stack(rows, out=_buffer("stacked", steps * plan.nbytes).reshape(steps, plan.nbytes))
    entries: list[EntryIn] = []
    pieces: list[tuple[Any, int]] = []  # (source, bytes) in output order
    for k in plan.grouped:
        a, n = plan.spans[k]
        shape = plan.shapes[k]
        entries.append(EntryIn(f"grad/{keys[k][0]}/{keys[k][1]}", [], {
            "dtype": dtype_name(plan.dtypes[k]), "inner_shape": [-1, *shape[1:]] if shape else [-1],
            "counts": [n // plan.dtypes[k].itemsize] * steps}))
        pieces.append((stacked[:, a:a + n], n * steps))
    for k, (name, bname) in enumerate(keys):
        if name:
            continue
        a, n = plan.spans[k]
        counts, changed, prev = [], [], None
        for row in rows:
            # The stager hands every buffer over every step (telling which changed would synchronize the device):
            # bytes equal to the step before's are left out, as if they had not been handed over.
            cur = row.data[a:a + n]
            if prev is not None and cur == prev:
                counts.append(-1)
            else:
                counts.append(n // plan.dtypes[k].itemsize)
                changed.append(cur)
            prev = cur
        entries.append(EntryIn(f"buffer/{bname}", [], {"dtype": dtype_name(plan.dtypes[k]),
                                                       "inner_shape": list(plan.shapes[k]), "counts": counts}))
        pieces.append((changed, n * len(changed)))
    for e in tail:
        flat = [_u8(t) for t in e.raw]
        entries.append(EntryIn(e.name, [], e.fields))
        pieces.append((flat, sum(v.nbytes for v in flat)))
    out = _buffer("joined", sum(n for _, n in pieces))
    view = out.data
    at = 0
    for e, (src, n) in zip(entries, pieces):
        dst = out[at:at + n]
        if isinstance(src, np.ndarray):
            np.copyto(dst.reshape(src.shape), src)
        else:
            o = 0
            for v in src:
                dst[o:o + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
                o += v.nbytes
        e.raw.append(view[at:at + n])
        at += n
    return entries, view


def _buffer(name: str, nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of ``nbytes``: the calling thread's kept ``name`` buffer where it is large enough.
    Its contents are the previous segment's until overwritten: every byte of the result is written before use."""
    kept = getattr(_scratch, name, None)
    if kept is not None and kept.nbytes >= nbytes:
        return kept[:nbytes]
    size = max(-(-nbytes // _GRAIN) * _GRAIN, _GRAIN)
    buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    if size <= KEEP_BYTES:
        setattr(_scratch, name, buf)
    return buf[:nbytes]


def _u8(t: torch.Tensor) -> memoryview:
    return t.detach().reshape(-1).view(torch.uint8).numpy().data
