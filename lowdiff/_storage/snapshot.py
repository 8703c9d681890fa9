"""Full snapshots: parameters, buffers, optimizer state and compressor memory at one step."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowdiff._storage.container import ContainerReader, EntryIn, write_container
from lowdiff._storage.format import (
    SNAPSHOT_DIR,
    UNSHARDED,
    FileSet,
    Shard,
    check_shape,
    dtype_name,
    encode_value,
    parse_dtype,
    parse_snapshot_name,
    snapshot_name,
    tensor_from_bytes,
)
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.segment import RNG_MAX_NBYTES
from lowdiff._storage.tensors import (
    COMPRESSOR_NAMES,
    MAX_RNG_SOURCES,
    MAX_STATE_PER_ELEMENT,
    RNG_SOURCE_RE,
    STATE_KEY_RE,
    check_compressor_tensor,
    check_state_tensor,
    rng_nbytes,
)
from lowdiff._storage.validate import (
    as_int,
    check_belongs,
    check_groups,
    check_json_object,
    check_scalar_state,
    check_shard,
    check_tracked_state,
)
from lowdiff.errors import CorruptFileError, ForeignFileError

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
    """Compressor memory that is the same on every rank (PowerSGD's Q; everything in a single process)."""
    rank_compressor_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Under torch.distributed (N > 1 shards): one rank's own compressor memory (error-feedback residuals), by
    parameter name: the writing rank's, or read back with :func:`read_rank_state` for the rank asked for."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON: "data" (tracked state by name; encoded when written, decoded when read), "end_groups" (encoded
    hyperparameters at the end of the iteration), "compacted", ..."""
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """RNG state at ``step`` (lowdiff.rng.capture), 1-D uint8 tensors by source name."""
    source: Any = None
    """The FileSet it was read from (None: captured from a live model); names the file in later checks."""
    packed: Any = None
    """Staged by the training side into one writer slot (a :class:`lowdiff._training.stager.PackedSnapshot`): the
    tensors are views of it; a persistence process hands the slot over instead of copying them
    (lowdiff._persist.process_writer)."""


def write_snapshot(run_dir: Path, state: SnapshotState, codec: str, shard: Shard = UNSHARDED, *,
                   run_id: str | None = None, branch: str | None = None, direct: bool = True) -> int:
    """Commit ``snapshots/step-N.h5`` (or this rank's shard of it); tensors must be CPU tensors the caller no
    longer mutates. With several shards each file holds part of the tensors and the same metadata. ``run_id``:
    the manifest's (None only in a run written before run ids existed); ``branch``: the history the run is in
    (lowdiff._storage.history; None: its first); ``direct``: write_container's."""
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
    if state.rank_compressor_state and shard.count < 2:
        raise ValueError("per-rank compressor state belongs in a sharded snapshot (one shard per rank)")
    for n, st in state.rank_compressor_state.items():
        for k, v in st.items():
            add(f"{rank_prefix(shard.index)}compressor/{n}/{k}", v)
    for n, t in state.rng.items():
        add(f"rng/{n}", t)
    meta = {"step": state.step, "param_groups": state.param_groups, "optimizer_scalars": scalars,
            "compressor": state.compressor_name, "extra": state.extra, "shard": [shard.index, shard.count]}
    if run_id is not None:
        meta["run_id"] = run_id
    if branch is not None:
        meta["branch"] = branch
    path = run_dir / SNAPSHOT_DIR / snapshot_name(state.step, shard)
    return write_container(path, KIND, meta, entries, codec, direct=direct)


def rank_prefix(rank: int) -> str:
    """Entry-name prefix of one rank's own state in its shard (FORMAT.md section 4)."""
    return f"rank/{rank:05d}/"


def read_rank_state(files: FileSet, manifest: Manifest, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Rank ``rank``'s own compressor memory from its shard of a sharded snapshot (empty when it saved none, or when
    the snapshot is not sharded). Reads that one file's ``rank/`` entries, verifying them as :func:`read_snapshot`."""
    if len(files.paths) < 2 or not 0 <= rank < len(files.paths):
        return {}
    state = _read_one(files.paths[rank], manifest, set(), False, None, {}, rank_state=rank)
    return state.rank_compressor_state


def read_snapshot(files: FileSet | Path, manifest: Manifest, only: set[str] | None = None,
                  with_buffers: bool = True) -> SnapshotState:
    """Load a snapshot (all its shards), verifying every checksum, that it belongs to this run and to the step its
    name says, and every shape, dtype and value against the manifest (docs/reference/FORMAT.md sections 4, 8).

    ``only`` limits parameters, optimizer and compressor state to those parameter names (replay workers).
    """
    fileset = files if isinstance(files, FileSet) else FileSet((files,))
    state: SnapshotState | None = None
    seen: dict[str, Path] = {}
    for path in fileset.paths:
        state = _read_one(path, manifest, only, with_buffers, state, seen)
    assert state is not None
    wanted = [p.name for p in manifest.params] if only is None else [n for n in only if manifest.has_param(n)]
    missing = [n for n in wanted if n not in state.params]
    if with_buffers:
        missing += [b.name for b in manifest.buffers if b.name not in state.buffers]
    if missing:
        raise CorruptFileError(f"{fileset}: tensor {missing[0]!r} is missing", path=fileset.paths[0],
                               step=state.step)
    state.source = fileset
    return state


def _read_one(path: Path, manifest: Manifest, only: set[str] | None, with_buffers: bool,
              state: SnapshotState | None, seen: dict[str, Path], rank_state: int | None = None) -> SnapshotState:
    try:
        with ContainerReader(path, KIND, confined=True) as r:
            return _read_entries(r, manifest, only, with_buffers, state, seen, rank_state)
    except CorruptFileError as e:
        e.path = e.path or path
        raise
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as e:
        # Anything the checks above did not anticipate is still this file's fault, and still a lowdiff error.
        raise CorruptFileError(f"{path}: invalid snapshot content ({e!r})", path=path) from e


def _check_meta(r: ContainerReader, manifest: Manifest, state: SnapshotState | None) -> SnapshotState:
    meta, path = r.meta, r.path
    step = as_int(meta.get("step"), str(path), "step")
    named = parse_snapshot_name(path.name)
    if named is not None:
        if named[0] != step:
            raise ForeignFileError(f"{path}: holds the state after step {step}, its name says step {named[0]} (a "
                                   "snapshot copied or renamed; remove it)", path=path, step=named[0])
        check_shard(meta, named[1].index, named[1].count, path)
    check_belongs(meta, manifest.run_id, path, manifest.history, (step, step))
    where = f"{path} (step {step})"
    if meta.get("compressor") not in COMPRESSOR_NAMES:
        raise CorruptFileError(f"{where}: unknown compressor {str(meta.get('compressor'))[:40]!r}")
    groups = meta.get("param_groups")
    check_groups(groups, manifest, where, with_names=True)
    extra = dict(check_json_object(meta.get("extra") or {}, where, "extra"))
    extra["data"] = check_tracked_state(extra.get("data") or {}, where)
    if extra.get("end_groups") is not None:
        check_groups(extra["end_groups"], manifest, f"{where} end of iteration", with_names=False)
    if not isinstance(extra.get("compressor_state_exact", True), bool):
        raise CorruptFileError(f"{where}: invalid compressor_state_exact")
    assert isinstance(groups, list)  # check_groups made sure
    if state is None:
        return SnapshotState(step=step, param_groups=groups, compressor_name=meta["compressor"], extra=extra)
    if state.step != step or state.param_groups != groups:
        raise CorruptFileError(f"{path}: shard holds step {step}, its sibling step {state.step} (or other groups)")
    return state


def _read_entries(r: ContainerReader, manifest: Manifest, only: set[str] | None, with_buffers: bool,
                  state: SnapshotState | None, seen: dict[str, Path], rank_state: int | None = None) -> SnapshotState:
    path = r.path
    state = _check_meta(r, manifest, state)
    shard = r.meta.get("shard") or [0, 1]
    where = f"{path} (step {state.step})"
    scalars = check_json_object(r.meta.get("optimizer_scalars") or {}, where, "optimizer_scalars")
    optimized = set(manifest.optimized_params)
    state_numel: dict[str, int] = {}
    nrng = 0
    for name, d in r.entries.items():
        if name in seen:
            raise CorruptFileError(f"{path}: entry {name!r} is also in {seen[name]}")
        seen[name] = path
        kind, _, rest = name.partition("/")
        if kind == "param":
            if not manifest.has_param(rest):
                raise CorruptFileError(f"{where}: parameter {rest!r} is not in the manifest")
            if only is not None and rest not in only:
                continue
            spec = manifest.param(rest)
            state.params[rest] = read_entry(r, name, d, expect=(spec.shape, spec.dtype))
        elif kind == "buffer":
            if not manifest.has_buffer(rest):
                raise CorruptFileError(f"{where}: buffer {rest!r} is not in the manifest")
            if with_buffers:
                spec = manifest.buffer(rest)
                state.buffers[rest] = read_entry(r, name, d, expect=(spec.shape, spec.dtype))
        elif kind == "rng":
            nrng += 1
            if nrng > MAX_RNG_SOURCES or not RNG_SOURCE_RE.match(rest) or d.get("dtype") != "uint8" \
                    or not isinstance(d.get("shape"), list) or len(d["shape"]) != 1:
                raise CorruptFileError(f"{where}: RNG state {rest[:60]!r} is not a 1-D uint8 tensor of a known "
                                       "source")
            size = rng_nbytes(rest)
            if size is not None and d["shape"] != [size]:
                raise CorruptFileError(f"{where}: RNG state {rest!r} of {str(d['shape'])[:20]} bytes; its layout has "
                                       f"{size}")
            if with_buffers:
                state.rng[rest] = read_entry(r, name, d, max_numel=RNG_MAX_NBYTES)
        elif kind == "rank":
            # One rank's own state, in that rank's shard (2.2): read only for the rank asked for.
            rank = rank_entry(rest, shard, where)
            pname, key, spec = compressor_entry(rest.split("/", 1)[1], optimized, manifest, where)
            if rank == rank_state:
                t = read_entry(r, name, d, max_numel=max(spec.numel, 1))
                check_compressor_tensor(t, spec, key, f"{where} [{name}]")
                state.rank_compressor_state.setdefault(pname, {})[key] = t
        elif kind in ("optim", "compressor"):
            pname, _, key = rest.rpartition("/")
            if pname not in optimized or not STATE_KEY_RE.match(key):
                raise CorruptFileError(f"{where}: {kind} state {key[:40]!r} of {pname[:80]!r}, which is not an "
                                       "optimized parameter")
            if only is not None and pname not in only:
                continue
            spec = manifest.param(pname)
            if kind == "optim":
                t = read_entry(r, name, d, max_numel=max(spec.numel, 1))
                state_numel[pname] = state_numel.get(pname, 0) + t.numel()
                if state_numel[pname] > MAX_STATE_PER_ELEMENT * max(spec.numel, 1) + 64:
                    raise CorruptFileError(f"{where}: more optimizer state for {pname!r} than any torch.optim "
                                           "optimizer keeps")
                check_state_tensor(t, spec, key, f"{where} [{name}]")
            else:
                t = read_entry(r, name, d, max_numel=max(spec.numel, 1))
                check_compressor_tensor(t, spec, key, f"{where} [{name}]")
            target = state.optimizer_state if kind == "optim" else state.compressor_state
            target.setdefault(pname, {})[key] = t
        else:
            raise CorruptFileError(f"{where}: unknown entry {name[:80]!r}")
    for pname, st in scalars.items():
        if pname not in optimized:
            raise CorruptFileError(f"{where}: scalar state for unknown parameter {pname[:80]!r}")
        decoded = check_scalar_state(st, f"{where} [{pname}]")
        if only is not None and pname not in only:
            continue
        state.optimizer_state.setdefault(pname, {}).update(decoded)
    return state


def rank_entry(rest: str, shard: Any, where: str) -> int:
    """The rank of a ``rank/RRRRR/compressor/NAME/KEY`` entry, which only that rank's shard of a set may hold."""
    parts = rest.split("/", 1)
    if len(parts) != 2 or not re.fullmatch(r"\d{5}", parts[0]) or not parts[1].startswith("compressor/"):
        raise CorruptFileError(f"{where}: unknown per-rank entry {rest[:80]!r}")
    rank = int(parts[0])
    if not (isinstance(shard, list) and len(shard) == 2 and shard[1] > 1 and shard[0] == rank):
        raise CorruptFileError(f"{where}: per-rank state of rank {rank} in shard {str(shard)[:20]} (each rank's "
                               "own state is in its own shard of a sharded snapshot)")
    return rank


def compressor_entry(rest: str, optimized: set[str], manifest: Manifest, where: str) -> tuple[str, str, Any]:
    pname, _, key = rest.removeprefix("compressor/").rpartition("/")
    if pname not in optimized or not STATE_KEY_RE.match(key):
        raise CorruptFileError(f"{where}: compressor state {key[:40]!r} of {pname[:80]!r}, which is not an "
                               "optimized parameter")
    return pname, key, manifest.param(pname)


def read_entry(r: ContainerReader, name: str, d: dict[str, Any], expect: tuple[tuple[int, ...], str] | None = None,
          max_numel: int | None = None) -> torch.Tensor:
    where = f"{r.path} [{name}]"
    dtype = parse_dtype(d.get("dtype"), where)
    shape = check_shape(d.get("shape"), where)
    if expect is not None and (shape, d.get("dtype")) != (expect[0], expect[1]):
        raise CorruptFileError(f"{where}: is {d.get('dtype')}{list(shape)[:8]}, the manifest says "
                               f"{expect[1]}{list(expect[0])}")
    if len(shape) > 64:
        raise CorruptFileError(f"{where}: {len(shape)} dimensions")
    numel = 1
    for s in shape:
        numel *= s
    if max_numel is not None and numel > max_numel:
        raise CorruptFileError(f"{where}: {numel} elements is more than its parameter has ({max_numel})")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return tensor_from_bytes(r.read(name, numel * itemsize), dtype, shape, where)
