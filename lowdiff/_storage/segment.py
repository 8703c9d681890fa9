"""Log segments: B consecutive steps in one file, stored column-wise (one entry per parameter and field).

Entry ``grad/<param>/<field>`` holds the field's bytes for every step of the segment back to back;
``counts[i]`` is its element count at the i-th step (-1: no gradient that step). ``buffer/<name>`` holds a
buffer's value at the steps where it changed (-1: unchanged); ``rng/<source>`` likewise the RNG state after
each step (always present at the segment's first step). Step scalars (the hyperparameters of every
optimizer group, lr included) and data positions are in the file's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lowdiff._storage.container import EntryIn, write_container
from lowdiff._storage.format import LOG_DIR, UNSHARDED, Shard, dtype_name, segment_name
from lowdiff._storage.packed import unpack as unpack_buffer
from lowdiff._storage.segment_packed import packed_entries, uniform
from lowdiff._storage.segment_reader import KIND, RNG_MAX_NBYTES, SegmentReader, StepData

__all__ = ["KIND", "RNG_MAX_NBYTES", "SegmentReader", "StepData", "StepRecord", "write_segment"]


@dataclass
class StepRecord:
    """Everything needed to redo one optimizer step; all tensors are owned CPU copies."""

    step: int
    groups: list[dict[str, Any]]
    """Encoded scalar hyperparameters of each optimizer group at this step (lr, betas, ...)."""
    grads: dict[str, dict[str, torch.Tensor]]
    """Payload per parameter name; parameters without a gradient this step are absent."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Persistent buffers as the step left them: the stager hands every one over; a segment keeps those whose value
    changed since the previous step."""
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """RNG state right after this step (lowdiff.rng.capture): 1-D uint8 tensors by source name."""
    data: dict[str, Any] = field(default_factory=dict)
    """The state of every object ``opt.track`` registered, by name, encoded (lowdiff._storage.format.encode_value):
    at the end of the iteration this step belongs to (data loaders: after the step). The same on every rank."""
    end_groups: list[dict[str, Any]] | None = None
    """Encoded hyperparameters of each group at the end of the iteration (after the loop's ``sched.step()``): what
    the next step starts from. None until the iteration ends (lowdiff._training.iteration)."""
    grad_scale: float | torch.Tensor | None = None
    """The factor the optimizer's gradients are the decoded payloads times (2.5; None: 1). Under DDP lowdiff's hook
    compresses the gradients before a GradScaler unscales them: the log holds the scaled ones, and this is the
    scaler's ``1 / scale`` that the optimizer's step consumed them multiplied by. On the training side a 0-d host
    tensor whose copy completes with the record's (read once the record is ready: :func:`scale_of`)."""
    skipped: bool = False
    """An iteration without an optimizer step (a tracked GradScaler skipped it): no gradients, nothing to replay
    but its buffers, RNG state and tracked state."""
    packed: Any = None
    """A packed step (``buf`` and ``layout.wire``, lowdiff._transfer.packing) holding ``grads`` and ``buffers`` still
    packed (staged that way by the training thread); :meth:`unpack` turns it into them on the writer's side."""

    @property
    def payload_nbytes(self) -> int:
        if self.packed is not None:
            return int(self.packed.layout.payload_nbytes)
        return sum(t.numel() * t.element_size() for p in self.grads.values() for t in p.values())

    def unpacked(self) -> StepRecord:
        """This record with ``grads`` and ``buffers`` as views of the packed buffer, as a new record; this one stays
        packed. A writer keeps a segment's records packed until it writes them: a record is then a handful of
        objects instead of hundreds of tensors and dicts, which lived long enough to reach the garbage collector's
        oldest generation and made it run full collections (140 ms, holding the GIL) every few seconds."""
        if self.packed is None:
            return self
        grads, buffers = unpack_buffer(self.packed.layout.wire, self.packed.buf)
        return replace(self, grads={**self.grads, **grads}, buffers={**self.buffers, **buffers}, packed=None)

    def unpack(self) -> StepRecord:
        """Fill ``grads`` and ``buffers`` from the packed buffer (views of it); a record never packed is left as it
        is. Call once the buffer's copies are complete (``Staged.wait``)."""
        if self.packed is not None:
            grads, buffers = unpack_buffer(self.packed.layout.wire, self.packed.buf)
            self.grads.update(grads)
            self.buffers.update(buffers)
            self.packed = None
        return self


def write_segment(run_dir: Path, records: list[StepRecord], codec: str, compressor: str,
                  shard: Shard = UNSHARDED, *, run_id: str | None = None, branch: str | None = None,
                  compressor_params: dict[str, Any] | None = None, direct: bool = True) -> int:
    """Commit ``log/steps-F-L.h5`` (or this rank's shard of it) holding ``records``. ``run_id``: the manifest's;
    ``branch``: the history the run is in (lowdiff._storage.history; None: its first);
    ``compressor_params``: the compressor's ``ratio`` and ``rank``, which bound every payload a reader accepts;
    ``direct``: write_container's."""
    first, last = records[0].step, records[-1].step
    if [r.step for r in records] != list(range(first, last + 1)):
        raise ValueError(f"segment steps must be consecutive, got {[r.step for r in records]}")
    plan = uniform(records, KEEP)
    if plan is not None:  # the writer thread's steady state: one buffer built from the packed steps
        built, joined = packed_entries(records, plan, _rng_entries(records))
        return write_container(run_dir / LOG_DIR / segment_name(first, last, shard), KIND,
                               _segment_meta(records, compressor, shard, run_id, branch, compressor_params), built,
                               codec, direct=direct, joined=joined)
    records = [r.unpacked() for r in records]
    entries: list[EntryIn] = []
    # One pass over (step, parameter, field), columns in order of first appearance: this is per-piece Python work
    # (Top-k: 152 columns x batch_steps), on the writer thread, holding the GIL.
    columns: dict[tuple[str, str], tuple[list[int], list[torch.Tensor], torch.Tensor]] = {}
    for i, r in enumerate(records):
        for pname, payload in r.grads.items():
            for fname, t in kept(payload).items():
                col = columns.get((pname, fname))
                if col is None:
                    col = columns[(pname, fname)] = ([-1] * i, [], t)
                counts = col[0]
                if len(counts) < i:
                    counts.extend([-1] * (i - len(counts)))
                counts.append(t.numel())
                col[1].append(t)
    for (pname, fname), (counts, raw, t) in columns.items():
        counts.extend([-1] * (len(records) - len(counts)))
        entries.append(EntryIn(f"grad/{pname}/{fname}", raw, {
            "dtype": dtype_name(t.dtype), "inner_shape": [-1, *t.shape[1:]] if t.dim() >= 1 else [-1],
            "counts": counts}))
    bufnames: dict[str, torch.Tensor] = {}
    for r in records:
        for bname, t in r.buffers.items():
            bufnames.setdefault(bname, t)
    for bname, like in bufnames.items():
        counts, raw, prev = [], [], None
        for r in records:
            bt = r.buffers.get(bname)
            # The stager hands every buffer over every step (telling which changed would synchronize the device):
            # a value equal to the step before's is left out, as if it had not been handed over.
            if bt is None or (prev is not None and prev.shape == bt.shape and prev.dtype == bt.dtype
                              and torch.equal(prev, bt)):
                counts.append(-1)
            else:
                counts.append(bt.numel())
                raw.append(bt)
            prev = bt if bt is not None else prev
        entries.append(EntryIn(f"buffer/{bname}", raw, {"dtype": dtype_name(like.dtype),
                                                        "inner_shape": list(like.shape), "counts": counts}))
    entries += _rng_entries(records)
    return write_container(run_dir / LOG_DIR / segment_name(first, last, shard), KIND,
                           _segment_meta(records, compressor, shard, run_id, branch, compressor_params), entries,
                           codec, direct=direct)


def _segment_meta(records: list[StepRecord], compressor: str, shard: Shard, run_id: str | None, branch: str | None,
                  compressor_params: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "first_step": records[0].step, "last_step": records[-1].step, "compressor": compressor,
        "shard": [shard.index, shard.count], "steps": [_step_meta(r) for r in records]}
    if run_id is not None:
        meta["run_id"] = run_id
    if branch is not None:
        meta["branch"] = branch
    if compressor_params is not None:
        meta["compressor_params"] = compressor_params
    return meta


KEEP = "keep"
"""A payload field no file holds: uint8, one per entry of the payload's other fields, 0 where the entry is a repeat to
drop (Top-k's merge of the ranks' selections under DDP, lowdiff._compressors.topk.merge_gathered, whose size only
the device knows; the training thread hands the fixed-size form over rather than wait for it)."""


def kept(payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``payload`` as the log holds it: without :data:`KEEP` and the entries where it is 0 (host tensors)."""
    keep = payload.get(KEEP)
    if keep is None:
        return payload
    mask = keep.bool()
    return {f: t[mask] for f, t in payload.items() if f != KEEP}


def scale_of(r: StepRecord) -> float | None:
    """``r.grad_scale`` as a float (call once the record's copies are complete). A tensor is a host one (0-d, its copy
    queued before the record's): read from its memory, which involves no device (the persistence process's hand-over
    reads it on the training thread)."""
    g = r.grad_scale
    if g is None or isinstance(g, float):
        return g
    if g.device.type != "cpu":
        raise ValueError(f"a step record's grad_scale is a host tensor, got one on {g.device}")
    return float(g.detach().numpy())


def _step_meta(r: StepRecord) -> dict[str, Any]:
    meta: dict[str, Any] = {"step": r.step, "groups": r.groups}
    if r.data:
        meta["data"] = r.data
    if r.end_groups is not None:
        meta["end_groups"] = r.end_groups
    if r.skipped:
        meta["skipped"] = True
    if r.grad_scale is not None:
        meta["grad_scale"] = scale_of(r)
    return meta


def _rng_entries(records: list[StepRecord]) -> list[EntryIn]:
    """``rng/<source>``: the state at the segment's first step and wherever it changed (-1: as the step
    before), so every segment is readable on its own and unused generators cost one copy per segment."""
    names: dict[str, None] = {}
    for r in records:
        names.update(dict.fromkeys(r.rng))
    out = []
    for name in names:
        counts, raw, prev = [], [], None
        for r in records:
            t = r.rng.get(name)
            if t is None or (prev is not None and torch.equal(prev, t)):
                counts.append(-1)
            else:
                counts.append(t.numel())
                raw.append(t)
            prev = t if t is not None else prev
        out.append(EntryIn(f"rng/{name}", raw, {"dtype": "uint8", "inner_shape": [-1], "counts": counts}))
    return out
