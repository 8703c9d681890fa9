"""FSDP2 (``fully_shard``) support: each rank logs and snapshots its own shards of every parameter.

Under ``fully_shard`` a parameter is a ``DTensor`` sharded along dimension 0 over a 1-D mesh of every rank; its
gradient, after FSDP's reduce-scatter, is the same, and each rank's optimizer steps its local shard as a tensor of
its own. lowdiff names rank r's shard of parameter ``w`` on N ranks ``w#r-of-N`` (lowdiff._storage.layout) and
handles it like any parameter: the compressor runs on the local gradient (error feedback per shard), the record
holds the local payload, the snapshot the local parameter and optimizer state, in rank r's file. Nothing is
gathered. The manifest records the layout, so recovery in one process joins the shards, and a resume on any
number of ranks cuts its own (docs/guide/fsdp.md, docs/reference/FORMAT.md section 9).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from lowdiff._recovery.optimizers import ELEMENTWISE_OPTIMIZERS
from lowdiff._storage import layout
from lowdiff._storage.format import encode_groups
from lowdiff._storage.manifest import Manifest, update_manifest
from lowdiff._training.model_spec import ModelSpec
from lowdiff.errors import UnsupportedError

log = logging.getLogger(__name__)


@functools.cache
def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return None
    return DTensor


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds parameters sharded by ``fully_shard`` (DTensors)."""
    dt = _dtensor_type()
    return dt is not None and any(isinstance(p, dt) for p in model.parameters())


def local(t: Any) -> Any:
    """The local shard of a DTensor (a view, no copy); any other tensor (or None) as it is."""
    if t is None or type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # per parameter per step: fast path
        return t
    dt = _dtensor_type()
    return t.to_local() if dt is not None and isinstance(t, dt) else t


@dataclasses.dataclass(frozen=True)
class Sharded:
    """This rank's place in the sharded layout: ``names`` maps its stored tensor names to the model's."""

    rank: int
    world: int
    names: dict[str, str]

    def bounds(self, spec: Any) -> tuple[int, int]:
        """(offset, length) of this rank's rows of a parameter described by ``spec`` (global shape)."""
        return layout.chunk_bounds(spec.shape[0], self.world)[self.rank]


def shard_spec(spec: ModelSpec, optimizer: torch.optim.Optimizer, rank: int, world: int
               ) -> tuple[ModelSpec, Sharded]:
    """The spec of what this rank logs and snapshots: its shard of every parameter, under its stored name; refuses
    what lowdiff cannot log exactly, naming it."""
    dt = _dtensor_type()
    from torch.distributed.tensor import Shard

    cls = spec.manifest.optimizer_class
    if cls not in ELEMENTWISE_OPTIMIZERS:
        raise UnsupportedError(f"{cls} under fully_shard: lowdiff replays each rank's shard on its own, which is exact "
                               "only for element-wise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, "
                               "RAdam, Adadelta); use one of them, or DDP")
    for name, p in spec.params.items():
        if not isinstance(p, dt):
            raise UnsupportedError(f"parameter {name!r} is not sharded by fully_shard while others are: apply "
                                   "fully_shard to the root module too (lowdiff logs each rank's shard of every "
                                   "parameter)")
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise UnsupportedError(f"parameter {name!r} is on a {mesh.ndim}-D device mesh (HSDP or tensor "
                                   "parallel): lowdiff supports fully_shard over a 1-D mesh of every rank only")
        if tuple(p.placements) != (Shard(0),):
            raise UnsupportedError(f"parameter {name!r} has placements {tuple(p.placements)} (tensor parallel, or "
                                   "shard_placement_fn): lowdiff supports fully_shard's Shard(0) only")
        if mesh.size() != world:
            raise UnsupportedError(f"parameter {name!r} is sharded over {mesh.size()} of {world} ranks: lowdiff "
                                   "supports fully_shard over a mesh of every rank only")
        if p.dim() == 0 or layout.SEP in name:
            raise UnsupportedError(f"parameter {name!r}: lowdiff shards parameters with at least one dimension "
                                   f"and without {layout.SEP!r} in their name")
        off, length = layout.chunk_bounds(p.shape[0], world)[rank]
        if tuple(p.to_local().shape) != (length, *p.shape[1:]):
            raise UnsupportedError(f"parameter {name!r}: rank {rank} holds {tuple(p.to_local().shape)} of "
                                   f"{tuple(p.shape)}, not the rows {off}:{off + length} torch.chunk gives it")
    sharded = Sharded(rank, world, {layout.shard_name(n, rank, world): n for n in spec.params})
    if world == 1:
        return spec, sharded
    manifest = dataclasses.replace(spec.manifest, sharding={
        "dim": 0, "layouts": [layout.layout_json({p.name: p.shape for p in spec.manifest.params}, world)]})
    out = dataclasses.replace(
        spec, manifest=manifest, stored=layout.view(manifest, world),
        params={layout.shard_name(n, rank, world): p for n, p in spec.params.items()},
        optimized=[(layout.shard_name(n, rank, world), p) for n, p in spec.optimized])
    return out, sharded


def adopt_layout(recorded: Manifest, current: Manifest, world: int, fsdp: bool, snapshot_counts: set[int]
                 ) -> Manifest | None:
    """The manifest to commit again when resuming ``recorded`` adds a sharded layout (None: nothing to add), or a
    refusal when the run and the model disagree on sharding."""
    known = layout.layouts(recorded.sharding)
    if not fsdp:
        if known and world > 1:
            raise UnsupportedError("this run was trained with fully_shard; resume it with fully_shard, or on one rank")
        return None
    if world == 1 or world in known:
        return None
    if not known and any(c > 1 for c in snapshot_counts):
        raise UnsupportedError("this run was trained under DDP on several ranks; resume it under DDP, or on one "
                               "rank, or start a new run_dir for fully_shard")
    assert current.sharding is not None
    lays = list((recorded.sharding or {"layouts": []})["layouts"]) + list(current.sharding["layouts"])
    return dataclasses.replace(recorded, sharding={"dim": 0, "layouts": lays}, layout=1)


def load_state(rec: Any, spec: ModelSpec, sharded: Sharded, optimizer: torch.optim.Optimizer) -> None:
    """Put this rank's rows of the recovered model and optimizer state into its live shards: ``rec`` holds either
    the whole model, or (``rec.shard``) this rank's shards under their stored names."""
    dt = _dtensor_type()
    own = rec.shard is not None
    with torch.no_grad():
        for stored, name in sharded.names.items():
            p = spec.params[stored]
            off, length = sharded.bounds(p)
            local(p).copy_(rec.model[stored] if own else rec.model[name][off:off + length])
        for slot in spec.buffers:
            slot.get().copy_(rec.model[slot.name])
    order = [p for _, p in spec.optimized]
    state: dict[int, dict[str, Any]] = {}
    for i, st in rec.optimizer["state"].items():
        p = order[i]
        off, length = (0, p.to_local().shape[0]) if own else sharded.bounds(p)
        whole = p.to_local().shape if own else p.shape
        state[i] = {k: dt.from_local(v[off:off + length].clone(), p.device_mesh, p.placements, run_check=False,
                                     shape=p.shape, stride=p.stride())
                    if isinstance(v, torch.Tensor) and v.shape == whole else v
                    for k, v in st.items()}
    optimizer.load_state_dict({"state": state, "param_groups": rec.optimizer["param_groups"]})


def compressor_state(rec: Any, spec: ModelSpec, sharded: Sharded, rec_layout: int
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's compressor memory: its rows of the joined error-feedback residuals when ``rec.step`` is a
    snapshot step written in this layout (exact), and PowerSGD's warm-start Q of its shard in the same layout;
    residuals restart at zero otherwise (said once)."""
    if rec.shard is not None:  # this rank's shards' own memory, as recovery selected it
        return {n: {k: v.to(spec.params[n].device) for k, v in st.items()} for n, st in rec.compressor_state.items()
                if n in spec.params}
    same = rec_layout == (sharded.world if sharded.world > 1 else 1)
    out: dict[str, dict[str, torch.Tensor]] = {}
    dropped = False
    for stored, name in sharded.names.items():
        p = spec.params[stored]
        off, length = sharded.bounds(p)
        st: dict[str, torch.Tensor] = {}
        for k, v in rec.compressor_state.get(name, {}).items():
            if same and rec.compressor_state_exact:
                st[k] = layout.rows(v, tuple(p.shape), off, length).clone().to(p.device)
            else:
                dropped = True
        if same:
            st.update({k: v.to(p.device) for k, v in rec.compressor_state.get(stored, {}).items()})
        if st:
            out[stored] = st
    if dropped:
        log.warning("lowdiff: resumed at step %d %s; error-feedback residuals restart at zero", rec.step,
                    "between snapshots" if same else "on another number of ranks than wrote it")
    return out


def check_config(config: Any) -> None:
    if config.log.capture == "layerwise":
        raise UnsupportedError("log.capture: layerwise under fully_shard: FSDP reduce-scatters gradients after the "
                               "hooks run; use log.capture: step (the default)")
    if config.snapshot.shadow:
        raise UnsupportedError("snapshot.shadow under fully_shard: the replica would hold only this rank's shards; "
                               "set snapshot.shadow: false")


def set_grad(p: torch.Tensor, g: torch.Tensor, decoded: torch.Tensor) -> None:
    """Make ``decoded`` the gradient the optimizer consumes: in the DTensor's local shard, or as ``p.grad``."""
    if g is p.grad:
        p.grad = decoded
    else:
        g.copy_(decoded)


def adopt(run_dir: Any, spec: ModelSpec, coord: Any, sharded: Sharded | None, leader: bool) -> None:
    """Resuming on another number of fully_shard ranks: the manifest learns the new layout first (one rank
    commits it again; the run id and everything else stay)."""
    from lowdiff._storage.format import list_snapshots

    counts = {len(f.paths) for f in list_snapshots(run_dir.path).values()}
    new = adopt_layout(run_dir.read_manifest(), spec.manifest, coord.world_size, sharded is not None, counts)
    if new is not None and leader:
        update_manifest(run_dir.path, sharding=new.sharding)
    coord.barrier("sharded layout")


def changes_layout(recorded: Manifest, rec_world: int, sharded: Sharded | None) -> bool:
    """Whether this process writes in another layout than the chain it resumed from (then :func:`rebase`): a
    fully_shard run resumed on another number of ranks, or in one process without fully_shard."""
    known = layout.layouts(recorded.sharding)
    mine = sharded.world if sharded is not None and sharded.world > 1 else 1
    return (rec_world if rec_world in known else 1) != mine


def rebase(staged: Any, run_dir: Any, coord: Any, groups: list[dict[str, Any]], codec: str) -> None:
    """Write the state a resume on another number of ranks starts from as a snapshot in the new layout: a chain
    never replays across two layouts (FORMAT.md section 9). Another layout's snapshot of the same step is moved to
    quarantine/, so that listing finds this one."""
    state = staged.wait()
    state.extra["end_groups"] = encode_groups(groups)
    run_dir.write_snapshot(state, codec)
    staged.release()
    coord.barrier("rebase snapshot")
    if coord.rank == 0:
        run_dir.quarantine_snapshot_sets(state.step, keep_count=coord.world_size)
    coord.barrier("rebased")
