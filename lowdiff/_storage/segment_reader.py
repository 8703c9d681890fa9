"""Reading log segments (lowdiff/_storage/segment.py writes them) as untrusted input.

Everything a segment claims is checked when it is opened, from its metadata alone, before a payload byte is
read: that it belongs to this run (run id) and holds the steps and shard its name says; every step's
hyperparameters (lowdiff._storage.validate); and every column's dtype, shape and per-step element counts against
the manifest's parameter and the compressor's bounds (k of Top-k, rank of PowerSGD; lowdiff._storage.tensors).
Top-k indices are checked when read: int32, in range, strictly increasing within a step (docs/reference/FORMAT.md
sections 5 and 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowdiff._storage.container_reader import ContainerReader
from lowdiff._storage.format import DTYPES, FileSet, decode_value, parse_segment_name, tensor_from_bytes
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.tensors import (
    COMPRESSOR_NAMES,
    FIELDS_OF,
    MAX_RNG_SOURCES,
    RNG_SOURCE_RE,
    field_layout,
    rng_nbytes,
    topk_bound,
)
from lowdiff._storage.validate import check_belongs, check_groups, check_shard, check_tracked_state
from lowdiff.errors import CorruptFileError, ForeignFileError

KIND = "segment"
# An RNG state is a few KB (torch CPU: 5056 bytes); anything larger in a file is damage.
RNG_MAX_NBYTES = 1 << 16
_ALL_FIELDS = frozenset().union(*(f for fs in FIELDS_OF.values() for f in fs))


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
    """Tracked state (decoded) at the end of this step's iteration (FORMAT.md section 7)."""
    end_groups: list[dict[str, Any]] | None = None
    """Encoded hyperparameters at the end of the iteration (2.2); None when the writer did not record them."""
    skipped: bool = False
    """An iteration without an optimizer step (2.2): replay applies its buffers but does not step."""
    grad_scale: float | None = None
    """The optimizer's gradients are the decoded payloads times this (2.5, FORMAT.md section 5; None: 1)."""


@dataclass
class _Column:
    reader: ContainerReader
    dtype: torch.dtype
    counts: list[int]
    tail: tuple[int, ...]
    """A step's tensor has shape ``(count / prod(tail), *tail)``; buffers: their full shape."""
    fixed: bool = False
    """A buffer: every present step holds exactly the full shape."""


class SegmentReader:
    """Validated view of one segment; reads only the columns asked for."""

    def __init__(self, files: FileSet | Path, manifest: Manifest, first: int, last: int) -> None:
        self.files = files if isinstance(files, FileSet) else FileSet((files,))
        self.path = self.files.name
        self.manifest = manifest
        self.first, self.last = first, last
        self._readers: list[ContainerReader] = []
        self._columns: dict[str, _Column] = {}
        try:
            for path in self.files.paths:
                r = ContainerReader(path, KIND, confined=True)
                self._readers.append(r)
                self._check_meta(r)
            meta = self._readers[0].meta
            self.steps: list[dict[str, Any]] = meta["steps"]
            self.compressor = str(meta["compressor"])
            self.compressor_params: dict[str, Any] = dict(meta.get("compressor_params") or {})
            for r in self._readers:
                self._check_entries(r, meta.get("compressor_params") or {})
            self._check_fields()
        except CorruptFileError as e:
            self.close()
            e.path = e.path or self.files.paths[0]
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as e:
            self.close()
            raise self._fail(f"invalid segment content ({e!r})") from e
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str, step: int | None = None, path: Path | None = None, entry: str | None = None
              ) -> CorruptFileError:
        where = f"{path or self.path}" + (f" [{entry}]" if entry else "") + (f" (step {step})" if step else "")
        return CorruptFileError(f"{where}: {what}", path=path or self.files.paths[0], step=step)

    # -- metadata ----------------------------------------------------------------------------------------------

    def _check_meta(self, r: ContainerReader) -> None:
        meta, path, first, last = r.meta, r.path, self.first, self.last
        named = parse_segment_name(path.name)
        if named is not None:
            check_shard(meta, named[2].index, named[2].count, path)
        if (meta.get("first_step"), meta.get("last_step")) != (first, last):
            raise ForeignFileError(f"{path}: holds steps {str(meta.get('first_step'))[:20]}-"
                                   f"{str(meta.get('last_step'))[:20]}, its name says {first}-{last} (a segment "
                                   "copied or renamed; remove it)", path=path, step=first)
        check_belongs(meta, self.manifest.run_id, path, self.manifest.history, (first - 1, last))
        if meta.get("compressor") not in COMPRESSOR_NAMES:
            raise self._fail(f"unknown compressor {str(meta.get('compressor'))[:40]!r}", path=path)
        params = meta.get("compressor_params")
        if params is not None:
            ratio, rank = (params.get("ratio"), params.get("rank")) if isinstance(params, dict) else (None, None)
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1 \
                    or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise self._fail(f"invalid compressor_params {str(params)[:80]}", path=path)
        steps = meta.get("steps")
        if not isinstance(steps, list) or len(steps) != last - first + 1:
            raise self._fail(f"step list does not match {first}-{last}", path=path)
        for i, s in enumerate(steps):
            if not isinstance(s, dict) or s.get("step") != first + i or isinstance(s.get("step"), bool):
                raise self._fail(f"step list does not match {first}-{last}", path=path)
            where = f"{path} (step {first + i})"
            check_groups(s.get("groups"), self.manifest, where, with_names=False)
            check_tracked_state(s.get("data", {}), where)
            if s.get("end_groups") is not None:
                check_groups(s["end_groups"], self.manifest, f"{where} end of iteration", with_names=False)
            if not isinstance(s.get("skipped", False), bool):
                raise self._fail("invalid 'skipped' flag", step=first + i, path=path)
            scale = s.get("grad_scale")
            if scale is not None and (not isinstance(scale, float) or not math.isfinite(scale) or scale <= 0):
                raise self._fail(f"invalid grad_scale {str(scale)[:20]} (a finite float > 0)", step=first + i,
                                 path=path)
        if self._readers and r is not self._readers[0]:
            m0 = self._readers[0].meta
            if (steps, meta.get("compressor"), params) != (m0["steps"], m0["compressor"], m0.get("compressor_params")):
                raise self._fail("step metadata differs from its sibling shard's", path=path)

    # -- columns -----------------------------------------------------------------------------------------------

    def _check_entries(self, r: ContainerReader, params: dict[str, Any]) -> None:
        m, nsteps, shards = self.manifest, self.last - self.first + 1, len(self.files.paths)
        optimized = set(m.optimized_params)
        nrng = 0
        for name, d in r.entries.items():
            where = f"{r.path} [{name}]"
            if name in self._columns:
                raise self._fail(f"entry {name!r} is also in {self._columns[name].reader.path}", path=r.path)
            counts = d.get("counts")
            if not isinstance(counts, list) or len(counts) != nsteps or not all(type(c) is int for c in counts) \
                    or (counts and min(counts) < -1):
                raise self._fail(f"invalid per-step counts (must be {nsteps} integers >= -1)", path=r.path, entry=name)
            dtype, inner = d.get("dtype"), d.get("inner_shape")
            kind, _, rest = name.partition("/")
            if kind == "grad":
                pname, _, fname = rest.rpartition("/")
                if pname not in optimized or fname not in _ALL_FIELDS:
                    raise self._fail(f"gradient {fname[:20]!r} for {pname[:80]!r}, which is not an optimized "
                                     "parameter of this run", path=r.path)
                spec = m.param(pname)
                want = "int32" if fname == "indices" else spec.dtype
                if dtype != want:
                    raise self._fail(f"is {str(dtype)[:20]}, expected {want}", path=r.path, entry=name)
                rank = params.get("rank") if self.compressor == "powersgd" else None
                row, most = field_layout(spec, fname, inner, rank if isinstance(rank, int) else 1 << 62, where)
                if fname in ("values", "indices"):
                    most = topk_bound(spec.numel, params.get("ratio") if self.compressor == "topk" else None, shards)
                    exact = False
                else:
                    exact = True
                tail = tuple(inner[1:]) if isinstance(inner, list) else ()
            elif kind == "buffer":
                if not m.has_buffer(rest):
                    raise self._fail(f"unknown buffer {rest[:80]!r}", path=r.path)
                spec = m.buffer(rest)
                if dtype != spec.dtype or inner != list(spec.shape):
                    raise self._fail(f"is {str(dtype)[:20]}{str(inner)[:40]}, the manifest says "
                                     f"{spec.dtype}{list(spec.shape)}", path=r.path, entry=name)
                row, most, exact, tail = 1, spec.numel, True, spec.shape
            elif kind == "rng":
                nrng += 1
                if nrng > MAX_RNG_SOURCES or not RNG_SOURCE_RE.match(rest) or dtype != "uint8" or inner != [-1]:
                    raise self._fail(f"RNG state {rest[:60]!r} is not a 1-D uint8 tensor of a known source",
                                     path=r.path)
                size = rng_nbytes(rest)
                row, most, exact, tail = 1, RNG_MAX_NBYTES if size is None else size, size is not None, ()
            else:
                raise self._fail(f"unknown entry {name[:80]!r}", path=r.path)
            if counts and (max(counts) > most or (exact and not set(counts) <= {-1, most})
                           or (row > 1 and any(c % row for c in counts if c > 0))):
                i, c = next((i, c) for i, c in enumerate(counts)
                            if c >= 0 and (c > most or (exact and c != most) or c % row))
                raise self._fail(f"holds {c} elements, at most {most} fit (in rows of {row})",
                                 step=self.first + i, path=r.path, entry=name)
            self._columns[name] = _Column(r, DTYPES[dtype], counts, tail, fixed=kind == "buffer")

    def _check_fields(self) -> None:
        """Per parameter the field set of its segment's compressor, present at the same steps, factors of one rank;
        no gradient at a step marked skipped."""
        skipped = [i for i, s in enumerate(self.steps) if s.get("skipped") is True]
        fields: dict[str, dict[str, _Column]] = {}
        for name, col in self._columns.items():
            kind, _, rest = name.partition("/")
            if kind == "grad":
                pname, _, fname = rest.rpartition("/")
                fields.setdefault(pname, {})[fname] = col
                if any(col.counts[i] >= 0 for i in skipped):
                    i = next(i for i in skipped if col.counts[i] >= 0)
                    raise self._fail("a gradient at a step marked skipped (no optimizer step)", step=self.first + i,
                                     path=col.reader.path, entry=name)
        for pname, cols in fields.items():
            if frozenset(cols) not in FIELDS_OF[self.compressor]:
                raise self._fail(f"payload fields {sorted(cols)} of {pname!r} are not what {self.compressor} writes")
            a, *others = cols.values()
            for b in others:
                if [c >= 0 for c in a.counts] != [c >= 0 for c in b.counts] or a.tail != b.tail or (
                        "values" in cols and a.counts != b.counts):
                    raise self._fail(f"payload fields of {pname!r} disagree on their steps or sizes")

    @property
    def nbytes(self) -> int:
        return sum(d["nbytes"] for r in self._readers for d in r.entries.values())

    def grad_columns(self) -> dict[str, list[str]]:
        """Parameter name -> payload field names present in this segment."""
        out: dict[str, list[str]] = {}
        for name in self._columns:
            kind, _, rest = name.partition("/")
            if kind == "grad":
                pname, _, fname = rest.rpartition("/")
                out.setdefault(pname, []).append(fname)
        return out

    def read_column(self, name: str) -> list[torch.Tensor | None]:
        """One tensor (or None) per step of the segment for entry ``name`` (checked when the segment opened)."""
        col = self._columns[name]
        where = f"{col.reader.path} [{name}]"
        itemsize = torch.empty((), dtype=col.dtype).element_size()
        total = sum(c for c in col.counts if c > 0)
        raw = col.reader.read(name, total * itemsize)
        if name.endswith("/indices") and name.startswith("grad/"):
            self._check_indices(name, raw, col)
        row = 1
        for s in col.tail:
            row *= s
        out: list[torch.Tensor | None] = []
        pos = 0
        for c in col.counts:
            if c < 0:
                out.append(None)
                continue
            shape = col.tail if col.fixed else (c // row if row else 0, *col.tail)
            n = c * itemsize
            out.append(tensor_from_bytes(raw[pos : pos + n], col.dtype, shape, where))
            pos += n
        return out

    def _check_indices(self, name: str, raw: bytes | memoryview, col: _Column) -> None:
        """Top-k indices: in [0, numel) and strictly increasing within each step (sorted and unique, FORMAT §5).
        One vectorized pass over the whole column (numpy: these columns are small and many)."""
        numel = self.manifest.param(name.split("/", 1)[1].rpartition("/")[0]).numel
        flat = np.frombuffer(raw, dtype="<i4")
        if not flat.size:
            return
        increasing = np.empty(flat.size, dtype=bool)
        increasing[0] = True
        np.greater(flat[1:], flat[:-1], out=increasing[1:])
        starts = np.cumsum([c for c in col.counts if c > 0])[:-1]  # a step's first index follows another step's
        increasing[starts] = True
        if bool(increasing.all()) and int(flat.min()) >= 0 and int(flat.max()) < numel:
            return
        pos = 0
        for i, c in enumerate(col.counts):
            if c > 0:
                idx = flat[pos : pos + c]
                if int(idx.min()) < 0 or int(idx.max()) >= numel or not bool((idx[1:] > idx[:-1]).all()):
                    raise self._fail(f"top-k indices out of range [0, {numel}), repeated or unsorted",
                                     step=self.first + i, path=col.reader.path, entry=name)
                pos += c

    def read_steps(self, params: list[str] | None, with_buffers: bool) -> list[StepData]:
        """Steps of the segment with the gradients of ``params`` (None: all) and, optionally, buffers."""
        try:
            return self._read_steps(params, with_buffers)
        except CorruptFileError as e:
            e.path = e.path or self.files.paths[0]
            raise

    def _read_steps(self, params: list[str] | None, with_buffers: bool) -> list[StepData]:
        out = [StepData(step=s["step"], groups=s["groups"], grads={}, buffers={}, end_groups=s.get("end_groups"),
                        skipped=s.get("skipped") is True, grad_scale=s.get("grad_scale")) for s in self.steps]
        wanted = None if params is None else set(params)
        for pname, fields in self.grad_columns().items():
            if wanted is not None and pname not in wanted:
                continue
            for fname in fields:
                for sd, t in zip(out, self.read_column(f"grad/{pname}/{fname}")):
                    if t is not None:
                        sd.grads.setdefault(pname, {})[fname] = t
        if with_buffers:
            for name in self._columns:
                kind, _, bname = name.partition("/")
                if kind == "buffer":
                    for sd, t in zip(out, self.read_column(name)):
                        if t is not None:
                            sd.buffers[bname] = t
            self._read_rng_and_data(out)
        return out

    def _read_rng_and_data(self, out: list[StepData]) -> None:
        for name in self._columns:
            kind, _, source = name.partition("/")
            if kind != "rng":
                continue
            last = None
            for sd, t in zip(out, self.read_column(name)):
                last = t if t is not None else last
                if last is not None:
                    sd.rng[source] = last
        for sd, s in zip(out, self.steps):
            sd.data = decode_value(s.get("data", {}))

    def close(self) -> None:
        for r in self._readers:
            r.close()

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
