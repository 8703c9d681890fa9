"""Sharded layouts (format 2.3): how the parameters of a ``fully_shard`` (FSDP2) run are cut into per-rank shards.

Under FSDP2 every rank holds, of every parameter, the rows ``[offset, offset + length)`` along dimension 0 that
``torch.chunk`` gives it, and its optimizer steps that local shard as a tensor of its own. lowdiff stores each such
shard as a tensor of its own, named ``NAME#I-of-N`` (shard I of a mesh of N ranks), in rank I's file of each
snapshot and segment; the manifest's ``sharding`` object records, per mesh size the run was trained on, every
parameter's shards (docs/reference/FORMAT.md section 9). A mesh of one rank holds whole tensors under their own
names, so a run resumed on one rank (sharded or not) writes the plain layout.

:func:`view` turns the manifest of the model (global names and shapes) into the manifest of one layout's stored
tensors, which every reader and the replayer use as they are: replaying each shard as its own tensor is what
training did, so it is bit-exact for element-wise optimizers. :func:`unshard` joins the replayed shards into the
model's tensors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from lowdiff.errors import CorruptFileError

PER_ELEMENT_COMPRESSOR_KEYS = frozenset({"residual"})
"""Compressor memory with one value per element of its parameter (error feedback, flat or shaped): joined and cut by
rows like the parameter. Anything else (PowerSGD's Q) belongs to its shard."""
SEP = "#"
"""Separates a parameter's name from its shard's number in stored tensor names (refused in parameter names)."""
MAX_MESH = 1 << 16


def chunk_bounds(size: int, count: int) -> list[tuple[int, int]]:
    """(offset, length) of each of ``count`` shards of ``size`` rows, as ``torch.chunk`` (and FSDP2) cut them:
    ceil(size / count) rows each, the last ones shorter or empty."""
    per = -(-size // count) if count else 0
    return [(min(i * per, size), max(0, min(per, size - i * per))) for i in range(count)]


def shard_name(name: str, index: int, count: int) -> str:
    return name if count == 1 else f"{name}{SEP}{index}-of-{count}"


def layout_json(shapes: dict[str, tuple[int, ...]], count: int) -> dict[str, Any]:
    """One mesh size's entry of the manifest's ``sharding.layouts``: every parameter's (offset, length) shards."""
    return {"mesh_size": count,
            "shards": {n: [list(b) for b in chunk_bounds(s[0] if s else 1, count)] for n, s in shapes.items()}}


def layouts(sharding: dict[str, Any] | None) -> dict[int, dict[str, list[tuple[int, int]]]]:
    """The manifest's layouts by mesh size (already checked by :func:`check_sharding`)."""
    if not sharding:
        return {}
    return {int(lay["mesh_size"]): {n: [(int(o), int(ln)) for o, ln in b] for n, b in lay["shards"].items()}
            for lay in sharding["layouts"]}


def check_sharding(doc: Any, shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, Any]:
    """Validate a manifest's ``sharding`` object against its parameters (FORMAT.md section 9)."""
    if not isinstance(doc, dict) or doc.get("dim") != 0 or not isinstance(doc.get("layouts"), list) \
            or not 0 < len(doc["layouts"]) <= 64:
        raise CorruptFileError(f"{path}: sharding must be an object with dim 0 and a list of layouts")
    seen = set()
    for lay in doc["layouts"]:
        count = lay.get("mesh_size") if isinstance(lay, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or not 1 < count <= MAX_MESH or count in seen:
            raise CorruptFileError(f"{path}: sharding layout with invalid or repeated mesh_size {str(count)[:20]}")
        seen.add(count)
        shards = lay.get("shards")
        if not isinstance(shards, dict) or set(shards) != set(shapes):
            raise CorruptFileError(f"{path}: the layout of mesh size {count} must list every parameter's shards")
        for name, bounds in shards.items():
            rows = shapes[name][0] if shapes[name] else 1
            if bounds != [list(b) for b in chunk_bounds(rows, count)]:
                raise CorruptFileError(f"{path}: shards of {name!r} on {count} ranks are {str(bounds)[:80]}, not "
                                       "the rows torch.chunk gives each rank")
    return doc


def layout_of(manifest: Any, files: Any) -> int:
    """The layout a file set is in: its shard count when the run has a sharded layout of that many ranks, else 1
    (whole tensors, each rank of a DDP run a share of them)."""
    n = len(files.paths)
    return n if n in layouts(manifest.sharding) else 1


def for_files(manifest: Any, files: Any) -> Any:
    """The manifest the tensors of the file set ``files`` are checked against (:func:`view` of its layout)."""
    return view(manifest, layout_of(manifest, files))


def view(manifest: Any, count: int) -> Any:
    """The manifest of the tensors a file set of ``count`` shards stores: ``manifest`` itself for whole tensors,
    else every parameter replaced by its ``count`` shards (in order, groups likewise)."""
    bounds = layouts(manifest.sharding).get(count)
    if bounds is None:
        return manifest
    params, names = [], {}
    for p in manifest.params:
        names[p.name] = [shard_name(p.name, i, count) for i in range(count)]
        for i, (_, length) in enumerate(bounds[p.name]):
            shape = (length, *p.shape[1:]) if p.shape else (length,)
            params.append(dataclasses.replace(p, name=names[p.name][i], shape=shape))  # a manifest TensorSpec
    return dataclasses.replace(manifest, params=params, sharding=None, layout=count,
                               param_groups=[[s for n in g for s in names[n]] for g in manifest.param_groups])


def unshard(manifest: Any, count: int, params: dict[str, torch.Tensor],
            optimizer_state: dict[str, dict[str, Any]], compressor_state: dict[str, dict[str, torch.Tensor]]
            ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, dict[str, torch.Tensor]]]:
    """Join the shards of a ``count``-shard layout into the model's tensors: parameters and every per-element
    optimizer or compressor tensor are concatenated along dimension 0; scalar optimizer state (Adam's ``step``)
    is the same in every shard and taken from shard 0. Compressor state that is not per element (PowerSGD's Q)
    belongs to its shard and stays under the shard's name."""
    if count not in layouts(manifest.sharding):
        return params, optimizer_state, compressor_state
    out_p: dict[str, torch.Tensor] = {}
    out_o: dict[str, dict[str, Any]] = {}
    out_c: dict[str, dict[str, torch.Tensor]] = {}
    for p in manifest.params:
        names = [shard_name(p.name, i, count) for i in range(count)]
        if all(n in params for n in names):
            out_p[p.name] = _join([params[n] for n in names], p.shape)
        states = [optimizer_state.get(n) for n in names]
        if all(st is not None for st in states):
            out_o[p.name] = _join_state(states, [params.get(n) for n in names], p.shape)  # type: ignore[arg-type]
        comp = [compressor_state.get(n, {}) for n in names]
        for key in set().union(*comp):
            parts = [c.get(key) for c in comp]
            if key in PER_ELEMENT_COMPRESSOR_KEYS and all(
                    t is not None and params.get(n) is not None and t.numel() == params[n].numel()
                    for t, n in zip(parts, names)):  # per element (Top-k's residual is flat): joined likewise
                whole = parts[0].shape == params[names[0]].shape  # type: ignore[union-attr]
                out_c.setdefault(p.name, {})[key] = _join(parts, p.shape if whole else (p.numel,))  # type: ignore
            else:
                for n, c in zip(names, comp):
                    if key in c:
                        out_c.setdefault(n, {})[key] = c[key]
    return out_p, out_o, out_c


def split(manifest: Any, state: Any, count: int) -> list[Any]:
    """The inverse of :func:`unshard` for a whole snapshot (``lowdiff compact`` of a sharded run): one
    :class:`~lowdiff._storage.snapshot.SnapshotState` per rank of the ``count``-shard layout, rank 0 with the buffers
    and RNG states."""
    bounds = layouts(manifest.sharding)[count]
    stored = view(manifest, count)
    groups = [dict(g) | {"params": names} for g, names in zip(state.param_groups, stored.param_groups)]
    out = []
    for i in range(count):
        params, opt, comp = {}, {}, {}
        for p in manifest.params:
            off, length = bounds[p.name][i]
            name = shard_name(p.name, i, count)
            params[name] = rows(state.params[p.name], p.shape, off, length)
            if p.name in state.optimizer_state:
                opt[name] = {k: rows(v, p.shape, off, length)
                             if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) else v
                             for k, v in state.optimizer_state[p.name].items()}
            own = {k: rows(v, p.shape, off, length) for k, v in state.compressor_state.get(p.name, {}).items()
                   if k in PER_ELEMENT_COMPRESSOR_KEYS and v.numel() == p.numel}
            own.update(state.compressor_state.get(name, {}))
            if own:
                comp[name] = own
        out.append(dataclasses.replace(state, params=params, optimizer_state=opt, compressor_state=comp,
                                       param_groups=groups, buffers=state.buffers if i == 0 else {},
                                       rng=state.rng if i == 0 else {}))
    return out


def _join(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Shards are row ranges, so their elements in order are the whole tensor's, row-major."""
    return torch.cat([t.reshape(-1) for t in parts]).reshape(shape)


def rows(whole: torch.Tensor, shape: tuple[int, ...], offset: int, length: int) -> torch.Tensor:
    """Rows ``[offset, offset + length)`` of a per-element tensor of a parameter of ``shape``: a view of them,
    kept flat when ``whole`` is flat (as Top-k's residual)."""
    if tuple(whole.shape) == tuple(shape):
        return whole[offset:offset + length]
    per = 1
    for s in shape[1:]:
        per *= s
    return whole.reshape(-1)[offset * per:(offset + length) * per]


def _join_state(states: list[dict[str, Any]], shards: list[torch.Tensor | None], shape: tuple[int, ...]
                ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, first in states[0].items():
        if isinstance(first, torch.Tensor) and all(
                isinstance(st.get(key), torch.Tensor) and s is not None and st[key].shape == s.shape
                for st, s in zip(states, shards)):
            out[key] = _join([st[key] for st in states], shape)
        else:
            out[key] = first
    return out
