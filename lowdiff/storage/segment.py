"""Log segments: B consecutive steps in one file, stored column-wise (one entry per parameter and field).

Entry ``grad/<param>/<field>`` holds the field's bytes for every step of the segment back to back;
``counts[i]`` is its element count at the i-th step (-1: no gradient that step). ``buffer/<name>`` holds a
buffer's value at the steps where it changed (-1: unchanged); ``rng/<source>`` likewise the RNG state after
each step (always present at the segment's first step). Step scalars (the hyperparameters of every
optimizer group, lr included) and data positions are in the file's metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowdiff.compressors import PAYLOAD_FIELDS
from lowdiff.errors import CorruptFileError
from lowdiff.storage.container import ContainerReader, EntryIn, write_container
from lowdiff.storage.format import (
    LOG_DIR,
    UNSHARDED,
    FileSet,
    Shard,
    check_shape,
    dtype_name,
    parse_dtype,
    segment_name,
    tensor_from_bytes,
)
from lowdiff.storage.manifest import Manifest

KIND = "segment"
_ALL_FIELDS = frozenset().union(*PAYLOAD_FIELDS)


@dataclass
class StepRecord:
    """Everything needed to redo one optimizer step; all tensors are owned CPU copies."""

    step: int
    groups: list[dict[str, Any]]
    """Encoded scalar hyperparameters of each optimizer group at this step (lr, betas, ...)."""
    grads: dict[str, dict[str, torch.Tensor]]
    """Payload per parameter name; parameters without a gradient this step are absent."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Persistent buffers whose value changed since the previous step."""
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """RNG state right after this step (lowdiff.rng.capture): 1-D uint8 tensors by source name."""
    data: dict[str, Any] = field(default_factory=dict)
    """Data positions after this step by tracked name (JSON, the same on every rank)."""

    @property
    def payload_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.grads.values() for t in p.values())


def write_segment(run_dir: Path, records: list[StepRecord], codec: str, compressor: str,
                  shard: Shard = UNSHARDED) -> int:
    first, last = records[0].step, records[-1].step
    if [r.step for r in records] != list(range(first, last + 1)):
        raise ValueError(f"segment steps must be consecutive, got {[r.step for r in records]}")
    entries: list[EntryIn] = []
    # One pass over (step, parameter, field), columns in order of first appearance: this is per-piece Python work
    # (Top-k: 152 columns x batch_steps), on the writer thread, holding the GIL.
    columns: dict[tuple[str, str], tuple[list[int], list[torch.Tensor], torch.Tensor]] = {}
    for i, r in enumerate(records):
        for pname, payload in r.grads.items():
            for fname, t in payload.items():
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
        counts, raw = [], []
        for r in records:
            bt = r.buffers.get(bname)
            counts.append(-1 if bt is None else bt.numel())
            if bt is not None:
                raw.append(bt)
        entries.append(EntryIn(f"buffer/{bname}", raw, {"dtype": dtype_name(like.dtype),
                                                        "inner_shape": list(like.shape), "counts": counts}))
    entries += _rng_entries(records)
    meta = {"first_step": first, "last_step": last, "compressor": compressor,
            "steps": [{"step": r.step, "groups": r.groups} | ({"data": r.data} if r.data else {})
                      for r in records]}
    return write_container(run_dir / LOG_DIR / segment_name(first, last, shard), KIND, meta, entries, codec)


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


# An RNG state is a few KB (torch CPU: 5056 bytes); anything larger in a file is damage.
RNG_MAX_NBYTES = 1 << 16


@dataclass
class StepData:
    """One replayable step, read back from a segment."""

    step: int
    groups: list[dict[str, Any]]
    grads: dict[str, dict[str, torch.Tensor]]
    buffers: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """RNG state after this step (read with buffers; carried forward within the segment)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Data positions after this step."""


class SegmentReader:
    """Validated view of one segment; reads only the columns asked for."""

    def __init__(self, files: FileSet | Path, manifest: Manifest, first: int, last: int) -> None:
        self.files = files if isinstance(files, FileSet) else FileSet((files,))
        self.path = self.files.name
        self.manifest = manifest
        self._readers: list[ContainerReader] = []
        self._owner: dict[str, ContainerReader] = {}
        try:
            for path in self.files.paths:
                r = ContainerReader(path, KIND)
                self._readers.append(r)
                self._check_meta(r, first, last)
                for name in r.entries:
                    if name in self._owner:
                        raise CorruptFileError(f"{path}: entry {name!r} is also in {self._owner[name].path}")
                    self._owner[name] = r
        except BaseException:
            self.close()
            raise
        meta = self._readers[0].meta
        self.first, self.last = first, last
        self.steps: list[dict[str, Any]] = meta["steps"]
        self.compressor = str(meta.get("compressor"))

    def _check_meta(self, r: ContainerReader, first: int, last: int) -> None:
        meta, path = r.meta, r.path
        if (meta.get("first_step"), meta.get("last_step")) != (first, last):
            raise CorruptFileError(f"{path}: holds steps {meta.get('first_step')}-{meta.get('last_step')}, "
                                   f"its name says {first}-{last}")
        steps = meta.get("steps")
        if not isinstance(steps, list) or [s.get("step") if isinstance(s, dict) else None for s in steps] != \
                list(range(first, last + 1)):
            raise CorruptFileError(f"{path}: step list does not match {first}-{last}")
        ngroups = len(self.manifest.param_groups)
        for s in steps:
            if not isinstance(s.get("groups"), list) or len(s["groups"]) != ngroups:
                raise CorruptFileError(f"{path}: step {s['step']} has hyperparameters for "
                                       f"{len(s.get('groups') or [])} groups, the optimizer has {ngroups}")
        if self._readers and steps != self._readers[0].meta.get("steps"):
            raise CorruptFileError(f"{path}: step metadata differs from its sibling shard's")

    @property
    def nbytes(self) -> int:
        return sum(d["nbytes"] for r in self._readers for d in r.entries.values())

    def grad_columns(self) -> dict[str, list[str]]:
        """Parameter name -> payload field names present in this segment."""
        out: dict[str, list[str]] = {}
        for name in self._owner:
            kind, _, rest = name.partition("/")
            if kind == "grad":
                pname, _, fname = rest.rpartition("/")
                out.setdefault(pname, []).append(fname)
        return out

    def read_column(self, name: str, max_numel: int, fixed_shape: tuple[int, ...] | None = None
                    ) -> list[torch.Tensor | None]:
        """One tensor (or None) per step of the segment for entry ``name``."""
        reader = self._owner[name]
        d = reader.entries[name]
        where = f"{reader.path} [{name}]"
        dtype = parse_dtype(d.get("dtype"), where)
        inner = d.get("inner_shape")
        counts = d.get("counts")
        nsteps = self.last - self.first + 1
        if not isinstance(counts, list) or len(counts) != nsteps or not all(
                isinstance(c, int) and not isinstance(c, bool) and -1 <= c <= max_numel for c in counts):
            raise CorruptFileError(f"{where}: invalid per-step counts (must be {nsteps} integers in -1..{max_numel})")
        if not isinstance(inner, list) or (fixed_shape is None and not inner):
            raise CorruptFileError(f"{where}: invalid inner_shape {inner!r}")
        if fixed_shape is not None:
            if check_shape(inner, where) != fixed_shape:
                raise CorruptFileError(f"{where}: shape {inner} does not match the manifest's {list(fixed_shape)}")
        else:
            tail = check_shape(inner[1:], where)
            if inner[0] != -1:
                raise CorruptFileError(f"{where}: invalid inner_shape {inner!r}")
        tail_numel = math.prod(inner[1:]) if fixed_shape is None else math.prod(fixed_shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        total = sum(c for c in counts if c > 0)
        raw = reader.read(name, total * itemsize)
        out: list[torch.Tensor | None] = []
        pos = 0
        for c in counts:
            if c < 0:
                out.append(None)
                continue
            if fixed_shape is not None and c != tail_numel:
                raise CorruptFileError(f"{where}: a step holds {c} elements, expected {tail_numel}")
            if fixed_shape is None and tail_numel and c % tail_numel:
                raise CorruptFileError(f"{where}: {c} elements do not fit shape {inner}")
            shape = fixed_shape if fixed_shape is not None else (c // tail_numel if tail_numel else 0, *tail)
            n = c * itemsize
            out.append(tensor_from_bytes(raw[pos : pos + n], dtype, shape, where))
            pos += n
        return out

    def read_steps(self, params: list[str] | None, with_buffers: bool) -> list[StepData]:
        """Steps of the segment with the gradients of ``params`` (None: all) and, optionally, buffers."""
        out = [StepData(step=s["step"], groups=s["groups"], grads={}, buffers={}) for s in self.steps]
        wanted = None if params is None else set(params)
        for pname, fields in self.grad_columns().items():
            if wanted is not None and pname not in wanted:
                continue
            if not self.manifest.has_param(pname):
                raise CorruptFileError(f"{self.path}: gradient for unknown parameter {pname!r}")
            if not frozenset(fields) <= _ALL_FIELDS:
                raise CorruptFileError(f"{self.path}: unknown payload fields {fields} for {pname!r}")
            numel = self.manifest.param(pname).numel
            for fname in fields:
                col = self.read_column(f"grad/{pname}/{fname}", max_numel=numel)
                for sd, t in zip(out, col):
                    if t is not None:
                        sd.grads.setdefault(pname, {})[fname] = t
        if with_buffers:
            for name in self._owner:
                kind, _, bname = name.partition("/")
                if kind != "buffer":
                    continue
                if not self.manifest.has_buffer(bname):
                    raise CorruptFileError(f"{self.path}: unknown buffer {bname!r}")
                spec = self.manifest.buffer(bname)
                col = self.read_column(name, max_numel=spec.numel, fixed_shape=spec.shape)
                for sd, t in zip(out, col):
                    if t is not None:
                        sd.buffers[bname] = t
            self._read_rng_and_data(out)
        return out

    def _read_rng_and_data(self, out: list[StepData]) -> None:
        for name in self._owner:
            kind, _, source = name.partition("/")
            if kind != "rng":
                continue
            if self._owner[name].entries[name].get("dtype") != "uint8":
                raise CorruptFileError(f"{self.path}: RNG state {source!r} is not uint8")
            last = None
            for sd, t in zip(out, self.read_column(name, max_numel=RNG_MAX_NBYTES)):
                last = t if t is not None else last
                if last is not None:
                    sd.rng[source] = last
        for sd, s in zip(out, self.steps):
            data = s.get("data", {})
            if not isinstance(data, dict):
                raise CorruptFileError(f"{self.path}: step {sd.step} has an invalid data position {data!r}")
            sd.data = data

    def close(self) -> None:
        for r in self._readers:
            r.close()

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
