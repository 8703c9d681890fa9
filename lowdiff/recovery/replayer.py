"""Exact replay: load a snapshot, then redo every logged step through the same optimizer class.

A partition is a subset of the parameters. Element-wise optimizers update each tensor from its own history
and the logged per-group scalars only, so partitions replay independently (one per worker process) and the
union equals a sequential replay bit for bit. Several steps are never merged into one.
"""

from __future__ import annotations

import importlib
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lowdiff.compressors import decode_payload
from lowdiff.errors import CorruptFileError, UnsupportedError
from lowdiff.storage.format import DTYPES, FileSet, decode_value
from lowdiff.storage.log_reader import Segment
from lowdiff.storage.manifest import Manifest
from lowdiff.storage.segment import SegmentReader, StepData
from lowdiff.storage.snapshot import SnapshotState, read_snapshot

# Optimizers whose update of a tensor reads only that tensor's gradient and state, plus group scalars.
ELEMENTWISE_OPTIMIZERS = frozenset(
    f"torch.optim.{m}.{c}" for m, c in [
        ("sgd", "SGD"), ("adam", "Adam"), ("adamw", "AdamW"), ("adagrad", "Adagrad"), ("rmsprop", "RMSprop"),
        ("adamax", "Adamax"), ("nadam", "NAdam"), ("radam", "RAdam"), ("adadelta", "Adadelta"),
    ]
)


def resolve_optimizer_class(path: str, allowed: type | None = None) -> type[torch.optim.Optimizer]:
    """The optimizer class named in a manifest. Only ``torch.optim`` classes are imported from a run directory;
    pass ``allowed`` (the class itself) to replay with another optimizer."""
    if allowed is not None:
        if f"{allowed.__module__}.{allowed.__qualname__}" != path:
            raise UnsupportedError(f"the run used optimizer {path}, not {allowed.__module__}.{allowed.__qualname__}")
        return allowed
    module, _, name = path.rpartition(".")
    if not (module == "torch.optim" or module.startswith("torch.optim.")) or "." in name:
        raise UnsupportedError(f"the run used optimizer {path}; lowdiff only imports torch.optim classes named in a "
                               "run directory. Pass optimizer_class=<the class> to recover() to allow it")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise CorruptFileError(f"manifest names {path}, which is not an optimizer class")
    return cls


@dataclass
class PhaseTimes:
    load_snapshot_s: float = 0.0
    read_s: float = 0.0
    decode_s: float = 0.0
    apply_s: float = 0.0

    def add(self, other: PhaseTimes) -> None:
        for k in vars(self):
            setattr(self, k, max(getattr(self, k), getattr(other, k)))


@dataclass
class PartitionResult:
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]
    """Decoded hyperparameters of each group after the last replayed step (without "params")."""
    buffers: dict[str, torch.Tensor]
    compressor_state: dict[str, dict[str, torch.Tensor]]
    last_q: dict[str, torch.Tensor]
    """PowerSGD: the newest logged Q per parameter (the warm start a resumed run continues from)."""
    snapshot_extra: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """RNG state at the target step (partition with buffers only)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Data positions at the target step (partition with buffers only)."""
    bytes_read: int = 0
    steps: int = 0
    times: PhaseTimes = field(default_factory=PhaseTimes)


def replay_partition(manifest: Manifest, snapshot: FileSet, segments: list[Segment], target: int,
                     names: list[str] | None, with_buffers: bool, optimizer_class: type | None = None,
                     device: str = "cpu", progress: Any = None) -> PartitionResult:
    """Replay parameters ``names`` (None: all) from the snapshot to ``target``; returns CPU tensors."""
    times = PhaseTimes()
    t0 = time.perf_counter()
    optimized = manifest.optimized_params
    # The partition that carries buffers also carries parameters no optimizer group holds (they never change).
    extra = [p.name for p in manifest.params if p.name not in set(optimized)] if with_buffers else []
    only = None if names is None else set(names) | set(extra)
    snap = read_snapshot(snapshot, manifest, only=only, with_buffers=with_buffers)
    times.load_snapshot_s = time.perf_counter() - t0
    wanted = [n for n in optimized if names is None or n in set(names)]
    params = {n: torch.nn.Parameter(snap.params[n].to(device), requires_grad=manifest.param(n).requires_grad)
              for n in wanted}
    opt = build_optimizer(manifest, snap, params, wanted, optimizer_class, device) if wanted else None
    buffers = dict(snap.buffers)
    last_q: dict[str, torch.Tensor] = {}
    # result.groups holds the encoded hyperparameters of the newest applied step until the end.
    result = PartitionResult(params={}, optimizer_state={}, groups=list(snap.param_groups), buffers=buffers,
                             compressor_state=snap.compressor_state, last_q=last_q,
                             snapshot_extra=snap.extra, rng=dict(snap.rng),
                             data=dict(snap.extra.get("data") or {}))
    def read(seg: Segment) -> tuple[int, list[StepData]]:
        with SegmentReader(seg.files, manifest, seg.first, seg.last) as reader:
            return reader.nbytes, reader.read_steps(wanted, with_buffers=with_buffers)

    pending = [seg for seg in segments if seg.last > snap.step]
    # One segment is read (checksums, decompression) ahead while this one is applied; read_s counts only the
    # time apply had to wait for it.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowdiff-prefetch") as pool:
        ahead = pool.submit(read, pending[0]) if pending else None
        for i, seg in enumerate(pending):
            assert ahead is not None
            t0 = time.perf_counter()
            nbytes, steps = ahead.result()
            times.read_s += time.perf_counter() - t0
            result.bytes_read += nbytes
            ahead = pool.submit(read, pending[i + 1]) if i + 1 < len(pending) else None
            _replay_steps(steps, seg, snap.step, target, manifest, device, opt, params, result, times, progress)
    for p in params.values():
        p.grad = None
    result.params = {n: p.detach().cpu() for n, p in params.items()}
    result.params.update({n: snap.params[n] for n in extra})
    if opt is not None:
        state = opt.state_dict()["state"]
        result.optimizer_state = {wanted[i]: {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                              for k, v in st.items()} for i, st in state.items()}
    result.groups = [{k: v for k, v in decode_value(g).items() if k != "params"} for g in result.groups]
    result.times = times
    return result


def _replay_steps(steps: list[StepData], seg: Segment, snap_step: int, target: int, manifest: Manifest,
                  device: str, opt: torch.optim.Optimizer | None, params: dict[str, torch.nn.Parameter],
                  result: PartitionResult, times: PhaseTimes, progress: Any) -> None:
    for sd in steps:
        if sd.step <= snap_step or sd.step > target:
            continue
        t0 = time.perf_counter()
        grads = {}
        for n, payload in sd.grads.items():
            spec = manifest.param(n)
            g = decode_payload({k: v.to(device) for k, v in payload.items()}, spec.shape)
            if g.dtype != DTYPES[spec.dtype]:
                raise CorruptFileError(f"{seg.files}: step {sd.step} gradient of {n!r} is {g.dtype}, "
                                       f"parameter is {spec.dtype}")
            grads[n] = g
            if "q" in payload:
                result.last_q[n] = payload["q"]
        t1 = time.perf_counter()
        times.decode_s += t1 - t0
        result.groups = sd.groups
        if opt is not None:
            apply_step(opt, params, sd.groups, grads, device)
        result.buffers.update(sd.buffers)
        result.rng.update(sd.rng)
        result.data = sd.data or result.data
        times.apply_s += time.perf_counter() - t1
        result.steps += 1
        if progress is not None:
            progress(1)


def apply_step(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], groups: list[dict[str, Any]],
               grads: dict[str, torch.Tensor], device: str) -> None:
    """Redo one optimizer step: the logged hyperparameters of every group, the decoded gradients (None for
    parameters without one that step), then the optimizer's own ``step()``. Shared by recovery and the shadow
    replica, so both follow training the same way."""
    for g_opt, g_log in zip(opt.param_groups, groups):
        for k, v in decode_value(g_log, device).items():
            if k != "params":
                g_opt[k] = v
    for n, p in params.items():
        p.grad = grads.get(n)
    opt.step()


def build_optimizer(manifest: Manifest, snap: SnapshotState, params: dict[str, torch.nn.Parameter],
                     wanted: list[str], optimizer_class: type | None, device: str) -> torch.optim.Optimizer:
    cls = resolve_optimizer_class(manifest.optimizer_class, optimizer_class)
    # Pass only the defaults the constructor takes (AdamW records `decoupled_weight_decay` but does not take
    # it); group hyperparameters are then set exactly by load_state_dict from the snapshot.
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in decode_value(manifest.optimizer_defaults, device).items() if k in accepted}
    group_specs = [[n for n in g if n in params] for g in manifest.param_groups]
    try:
        opt = cls([{"params": [params[n] for n in g]} for g in group_specs], **defaults)
    except (TypeError, ValueError) as e:
        raise CorruptFileError(f"cannot rebuild {manifest.optimizer_class} from the manifest's defaults: {e}") from e
    index = {n: i for i, n in enumerate(wanted)}
    groups_sd = []
    for spec, g in zip(group_specs, snap.param_groups):
        hyper = {k: v for k, v in decode_value(g, device).items() if k != "params"}
        groups_sd.append({**hyper, "params": [index[n] for n in spec]})
    opt.load_state_dict({"state": {index[n]: st for n, st in snap.optimizer_state.items() if n in index},
                         "param_groups": groups_sd})
    return opt
