"""Full snapshots: parameters, buffers, optimizer state and compressor memory at one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowdiff.errors import CorruptFileError
from lowdiff.storage.container import ContainerReader, EntryIn, write_container
from lowdiff.storage.format import (
    SNAPSHOT_DIR,
    UNSHARDED,
    FileSet,
    Shard,
    check_shape,
    decode_value,
    dtype_name,
    encode_value,
    parse_dtype,
    snapshot_name,
    tensor_from_bytes,
)
from lowdiff.storage.manifest import Manifest
from lowdiff.storage.segment import RNG_MAX_NBYTES

KIND = "snapshot"


@dataclass
class SnapshotState:
    """State at ``step``, keyed by names (never by rank or index), all tensors on CPU."""

    step: int
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per parameter name: tensor state and (decoded) scalar state."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """Encoded hyperparameters of each group ("params" holds parameter names)."""
    compressor_name: str = "none"
    compressor_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON: e.g. "data" (data positions by tracked name), "compacted"."""
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """RNG state at ``step`` (lowdiff.rng.capture), 1-D uint8 tensors by source name."""


def write_snapshot(run_dir: Path, state: SnapshotState, codec: str, shard: Shard = UNSHARDED) -> int:
    """Commit ``snapshots/step-N.h5`` (or this rank's shard of it); tensors must be CPU tensors the caller no
    longer mutates. With several shards each file holds part of the tensors and the same metadata."""
    entries: list[EntryIn] = []

    def add(name: str, t: torch.Tensor) -> None:
        entries.append(EntryIn(name, [t], {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}))

    scalars: dict[str, dict[str, Any]] = {}
    for n, t in state.params.items():
        add(f"param/{n}", t)
    for n, t in state.buffers.items():
        add(f"buffer/{n}", t)
    for n, st in state.optimizer_state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                add(f"optim/{n}/{k}", v)
            else:
                scalars.setdefault(n, {})[k] = encode_value(v)
    for n, st in state.compressor_state.items():
        for k, v in st.items():
            add(f"compressor/{n}/{k}", v)
    for n, t in state.rng.items():
        add(f"rng/{n}", t)
    meta = {"step": state.step, "param_groups": state.param_groups, "optimizer_scalars": scalars,
            "compressor": state.compressor_name, "extra": state.extra}
    path = run_dir / SNAPSHOT_DIR / snapshot_name(state.step, shard)
    return write_container(path, KIND, meta, entries, codec)


def read_snapshot(files: FileSet | Path, manifest: Manifest, only: set[str] | None = None,
                  with_buffers: bool = True) -> SnapshotState:
    """Load a snapshot (all its shards), verifying every checksum and every shape against the manifest.

    ``only`` limits parameters, optimizer and compressor state to those parameter names (replay workers).
    """
    fileset = files if isinstance(files, FileSet) else FileSet((files,))
    state: SnapshotState | None = None
    for path in fileset.paths:
        state = _read_one(path, manifest, only, with_buffers, state)
    assert state is not None
    if only is None:
        missing = [p.name for p in manifest.params if p.name not in state.params]
    else:
        missing = [n for n in only if n not in state.params]
    if missing:
        raise CorruptFileError(f"{fileset}: parameter {missing[0]!r} is missing")
    return state


def _read_one(path: Path, manifest: Manifest, only: set[str] | None, with_buffers: bool,
              state: SnapshotState | None) -> SnapshotState:
    with ContainerReader(path, KIND) as r:
        meta = r.meta
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CorruptFileError(f"{path}: invalid step {step!r}")
        groups = meta.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(manifest.param_groups):
            raise CorruptFileError(f"{path}: has {len(groups) if isinstance(groups, list) else '?'} optimizer "
                                   f"groups, the manifest {len(manifest.param_groups)}")
        if state is None:
            state = SnapshotState(step=step, param_groups=groups, compressor_name=str(meta.get("compressor")),
                                  extra=meta.get("extra") or {})
        elif state.step != step:
            raise CorruptFileError(f"{path}: shard holds step {step}, its sibling step {state.step}")
        scalars = meta.get("optimizer_scalars") or {}
        if not isinstance(scalars, dict):
            raise CorruptFileError(f"{path}: invalid optimizer_scalars")
        for name, d in r.entries.items():
            kind, _, rest = name.partition("/")
            if kind == "param":
                if only is not None and rest not in only:
                    continue
                if not manifest.has_param(rest):
                    raise CorruptFileError(f"{path}: parameter {rest!r} is not in the manifest")
                spec = manifest.param(rest)
                state.params[rest] = _read(r, name, d, expect=(spec.shape, spec.dtype))
            elif kind == "buffer":
                if not with_buffers:
                    continue
                if not manifest.has_buffer(rest):
                    raise CorruptFileError(f"{path}: buffer {rest!r} is not in the manifest")
                spec = manifest.buffer(rest)
                state.buffers[rest] = _read(r, name, d, expect=(spec.shape, spec.dtype))
            elif kind == "rng":
                if with_buffers:
                    state.rng[rest] = _read(r, name, d, max_numel=RNG_MAX_NBYTES)
                    if state.rng[rest].dtype != torch.uint8 or state.rng[rest].dim() != 1:
                        raise CorruptFileError(f"{path}: RNG state {rest!r} is not a 1-D uint8 tensor")
            elif kind in ("optim", "compressor"):
                pname, _, key = rest.rpartition("/")
                if only is not None and pname not in only:
                    continue
                if not manifest.has_param(pname):
                    raise CorruptFileError(f"{path}: state for unknown parameter {pname!r}")
                t = _read(r, name, d, max_numel=max(manifest.param(pname).numel, 1))
                target = state.optimizer_state if kind == "optim" else state.compressor_state
                target.setdefault(pname, {})[key] = t
            else:
                raise CorruptFileError(f"{path}: unknown entry {name!r}")
        for pname, st in scalars.items():
            if only is not None and pname not in only:
                continue
            if not manifest.has_param(pname) or not isinstance(st, dict):
                raise CorruptFileError(f"{path}: scalar state for unknown parameter {pname!r}")
            state.optimizer_state.setdefault(pname, {}).update({k: decode_value(v) for k, v in st.items()})
    return state


def _read(r: ContainerReader, name: str, d: dict[str, Any], expect: tuple[tuple[int, ...], str] | None = None,
          max_numel: int | None = None) -> torch.Tensor:
    where = f"{r.path} [{name}]"
    dtype = parse_dtype(d.get("dtype"), where)
    shape = check_shape(d.get("shape"), where)
    if expect is not None and (shape, d.get("dtype")) != (expect[0], expect[1]):
        raise CorruptFileError(f"{where}: is {d.get('dtype')}{list(shape)}, the manifest says "
                               f"{expect[1]}{list(expect[0])}")
    numel = 1
    for s in shape:
        numel *= s
    if max_numel is not None and numel > max_numel:
        raise CorruptFileError(f"{where}: {numel} elements is more than its parameter has ({max_numel})")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return tensor_from_bytes(r.read(name, numel * itemsize), dtype, shape, where)
