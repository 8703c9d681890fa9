"""Exact replay: load a snapshot, then redo every logged step through the same optimizer class.

Element-wise optimizers update every element from its own history and the logged per-group scalars only. The
replay exploits that twice, never merging several steps into one: cache-sized chunks of every tensor
(lowdiff/_recovery/stepper.py), and worker processes that each replay a contiguous share of the chunks, reading and
decoding only their tensors' columns and stepping their own optimizer instance through every step in order, in
place in memory shared with the caller (lowdiff/_recovery/procs.py). ``tests/property/test_exactness.py`` checks the
result bit for bit against the uninterrupted run with tiny chunks, and workers=2 against workers=1.

This module plans one partition's replay (snapshot, pending segments, workers) and runs the log through the
:class:`~lowdiff._recovery.stepper.Stepper`; which chain to replay is :mod:`lowdiff._recovery.api`'s choice.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lowdiff._recovery import optimizers, procs
from lowdiff._recovery.options import DEFAULT_OPTIONS, ReplayOptions
from lowdiff._recovery.rebuild import build_optimizer
from lowdiff._recovery.stepper import Stepper
from lowdiff._storage.format import FileSet, decode_value
from lowdiff._storage.log_reader import Segment
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.segment import SegmentReader, StepData
from lowdiff._storage.snapshot import read_snapshot

ELEMENTWISE_OPTIMIZERS = optimizers.ELEMENTWISE_OPTIMIZERS


@dataclass
class PhaseTimes:
    load_snapshot_s: float = 0.0
    read_s: float = 0.0
    decode_s: float = 0.0
    apply_s: float = 0.0


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
    """Tracked state at the target step (partition with buffers only)."""
    end_groups: list[dict[str, Any]] | None = None
    """Encoded hyperparameters at the end of the target step's iteration, when logged (FORMAT.md sections 4, 5)."""
    bytes_read: int = 0
    steps: int = 0
    times: PhaseTimes = field(default_factory=PhaseTimes)
    workers: int = 1
    """Processes that replayed a share (1: this one alone)."""
    note: str = ""
    """Why fewer workers than asked for took part (empty: as asked)."""


@dataclass
class _Replay:
    """What every step of one process's replay needs (the same for the parent and each worker process)."""

    manifest: Manifest
    pending: list[Segment]
    """The segments holding steps after the snapshot, in order."""
    target: int
    device: str
    stepper: Stepper | None
    result: PartitionResult
    times: PhaseTimes
    progress: Any = None
    options: ReplayOptions = DEFAULT_OPTIONS


def replay_partition(manifest: Manifest, snapshot: FileSet, segments: list[Segment], target: int,
                     names: list[str] | None, with_buffers: bool, optimizer_class: type | None = None,
                     device: str = "cpu", progress: Any = None, workers: int = 1,
                     options: ReplayOptions = DEFAULT_OPTIONS) -> PartitionResult:
    """Replay parameters ``names`` (None: all) from the snapshot to ``target``; returns CPU tensors.

    ``workers`` > 1 replays disjoint shares of the tensors in that many processes (element-wise optimizers on
    the CPU only; the caller checks that, and that forking is safe: lowdiff._recovery.procs). The result is
    bit-identical to ``workers=1``; ``PartitionResult.workers`` says how many took part."""
    times = PhaseTimes()
    t0 = time.perf_counter()
    optimized = manifest.optimized_params
    # The partition that carries buffers also carries parameters no optimizer group holds (they never change).
    extra = [p.name for p in manifest.params if p.name not in set(optimized)] if with_buffers else []
    only = None if names is None else set(names) | set(extra)
    if options.before_read is not None:
        for path in snapshot.paths:
            options.before_read(path)
    snap = read_snapshot(snapshot, manifest, only=only, with_buffers=with_buffers)
    times.load_snapshot_s = time.perf_counter() - t0
    if callable(getattr(progress, "set_total", None)):
        # The steps this replay will report (a recovery that starts over around a damaged file says it again).
        progress.set_total(max(target - snap.step, 0))
    wanted = [n for n in optimized if names is None or n in set(names)]
    params = {n: torch.nn.Parameter(snap.params[n].to(device).contiguous(),
                                    requires_grad=manifest.param(n).requires_grad) for n in wanted}
    opt = build_optimizer(manifest, snap, params, wanted, optimizer_class, device) if wanted else None
    share = workers > 1 and device == "cpu"
    if share:
        # The state moves into memory shared with the worker processes: without the snapshot's references to
        # it, each private copy is freed as soon as its tensor has moved.
        snap.params = {n: t for n, t in snap.params.items() if n in set(extra)}
        snap.optimizer_state = {}
    stepper: Stepper | None = None
    if opt is not None:
        stepper = Stepper(manifest, opt, params, device, workers,
                          chunked=manifest.optimizer_class in ELEMENTWISE_OPTIMIZERS, share=share, options=options)
    # result.groups holds the encoded hyperparameters of the newest applied step until the end.
    result = PartitionResult(params={}, optimizer_state={}, groups=list(snap.param_groups), buffers=dict(snap.buffers),
                             compressor_state=snap.compressor_state, last_q={},
                             snapshot_extra=snap.extra, rng=dict(snap.rng),
                             data=dict(snap.extra.get("data") or {}), end_groups=snap.extra.get("end_groups"))
    ctx = _Replay(manifest, [seg for seg in segments if seg.last > snap.step], target, device, stepper, result, times,
                  progress, options)
    start = snap.step
    children: list[procs.Worker] = []
    try:
        own = wanted
        if stepper is not None and stepper.share and ctx.pending and not stepper.built:
            # A snapshot taken before the first step holds no optimizer state: that step runs here on whole
            # tensors, creating it; then the state is shared and cut into chunks.
            start = _replay_first_step(ctx, wanted, with_buffers, start)
        if stepper is not None and stepper.built and len(stepper.opts) > 1:
            shared = stepper.shared_keys()
            stepper.drop_grads()  # each process decodes into buffers of its own: none inherited to copy on write
            procs.trim_heap()
            for w in range(1, len(stepper.opts)):
                children.append(procs.start(w, functools.partial(_replay_share, ctx, w, shared, start)))
            result.workers = len(stepper.opts)
            stepper.own(0)
            own = stepper.own_names()
        elif share:
            result.note = ("sequential (no optimized tensors)" if stepper is None else
                           "sequential (a single chunk: nothing to share)" if stepper.built else
                           "sequential (the optimizer state is not per-element)")
        _replay_log(ctx, own, with_buffers, start)
        while children:
            states, child_q = procs.collect(children[0])
            children.pop(0)
            assert stepper is not None
            stepper.import_states(states)
            result.last_q.update(child_q)
        if stepper is not None:
            result.optimizer_state = stepper.finish()
    finally:
        procs.stop(children)
    result.params = {n: p.detach().cpu() for n, p in params.items()}
    result.params.update({n: snap.params[n] for n in extra})
    result.groups = [{k: v for k, v in decode_value(g).items() if k != "params"} for g in result.groups]
    result.times = times
    return result


def _read_segment(manifest: Manifest, seg: Segment, names: list[str], with_buffers: bool,
                  options: ReplayOptions = DEFAULT_OPTIONS) -> tuple[int, list[StepData]]:
    if options.before_read is not None:
        for path in seg.files.paths:
            options.before_read(path)
    with SegmentReader(seg.files, manifest, seg.first, seg.last) as reader:
        return reader.nbytes, reader.read_steps(names, with_buffers=with_buffers)


def _replay_first_step(ctx: _Replay, names: list[str], with_buffers: bool, start: int) -> int:
    """Replay the first step after ``start`` alone (all tensors, in this process), and the skipped iterations
    before it; returns its number."""
    t0 = time.perf_counter()
    seg = ctx.pending[0]
    _, steps = _read_segment(ctx.manifest, seg, names, with_buffers, ctx.options)
    ctx.times.read_s += time.perf_counter() - t0
    wanted = [sd for sd in steps if start < sd.step <= ctx.target]
    # Up to the first step that steps (iterations a GradScaler skipped before it create no optimizer state).
    first = wanted[: next((i + 1 for i, sd in enumerate(wanted) if not sd.skipped), len(wanted))]
    _replay_steps(ctx, first, seg, start)
    return first[-1].step if first else start


def _replay_log(ctx: _Replay, names: list[str], with_buffers: bool, start: int) -> None:
    """Replay steps ``start`` + 1 .. ``ctx.target`` of ``names`` from the pending segments (a worker's whole job)."""
    pending, manifest = ctx.pending, ctx.manifest
    # One segment is read (checksums, decompression) ahead while this one is applied; read_s counts only the
    # time apply had to wait for it.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowdiff-prefetch") as pool:
        ahead = pool.submit(_read_segment, manifest, pending[0], names, with_buffers, ctx.options) \
            if pending else None
        for i, seg in enumerate(pending):
            assert ahead is not None
            t0 = time.perf_counter()
            nbytes, steps = ahead.result()
            ctx.times.read_s += time.perf_counter() - t0
            ctx.result.bytes_read += nbytes
            ahead = pool.submit(_read_segment, manifest, pending[i + 1], names, with_buffers, ctx.options) \
                if i + 1 < len(pending) else None
            _replay_steps(ctx, steps, seg, start)
            del steps


def _replay_share(ctx: _Replay, index: int, shared: dict[str, frozenset[str]], start: int
                  ) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Body of worker process ``index``: replay its share in place (shared memory); return the rest."""
    if ctx.options.on_worker_start is not None:
        ctx.options.on_worker_start(index)
    stepper = ctx.stepper
    assert stepper is not None
    stepper.own(index)
    mine = PartitionResult(params={}, optimizer_state={}, groups=[], buffers={}, compressor_state={}, last_q={})
    _replay_log(dataclasses.replace(ctx, result=mine, times=PhaseTimes(), progress=None), stepper.own_names(),
                False, start)
    return stepper.export_states(shared), {n: q.clone() for n, q in mine.last_q.items()}


def _replay_steps(ctx: _Replay, steps: list[StepData], seg: Segment, snap_step: int) -> None:
    stepper, result, times = ctx.stepper, ctx.result, ctx.times
    for sd in steps:
        if sd.step <= snap_step or sd.step > ctx.target:
            continue
        t0 = time.perf_counter()
        if stepper is not None and not sd.skipped:  # an iteration the GradScaler skipped: no optimizer step
            stepper.set_grads(sd, seg)
        for n, payload in sd.grads.items():
            if "q" in payload:
                result.last_q[n] = payload["q"]
        t1 = time.perf_counter()
        times.decode_s += t1 - t0
        result.groups = sd.groups
        if stepper is not None and not sd.skipped:
            stepper.step(sd.groups)
        result.buffers.update(sd.buffers)
        result.rng.update(sd.rng)
        result.data = sd.data or result.data
        result.end_groups = sd.end_groups
        times.apply_s += time.perf_counter() - t1
        result.steps += 1
        if ctx.progress is not None:
            ctx.progress(1)
