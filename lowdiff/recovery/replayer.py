"""Exact replay: load a snapshot, then redo every logged step through the same optimizer class.

Element-wise optimizers update every element from its own history and the logged per-group scalars only. The
replayer exploits that twice, never merging several steps into one:

* cache blocking: every parameter (and its optimizer state) is cut into contiguous chunks of ``CHUNK_ELEMS``
  elements, each a *view* handed to its own optimizer entry, so the optimizer's ~8 passes per step run over
  a chunk that stays in cache instead of streaming the whole model through memory 8 times;
* workers: the chunks are cut into ``workers`` contiguous shares of about equal elements, each replayed by its
  own process (lowdiff/recovery/procs.py) that reads and decodes only its tensors' columns and steps its own
  optimizer instance through every step in order, in place in memory shared with the caller (no copies of the
  state, nothing pickled but each chunk's small scalar state at the end).

Chunk boundaries are multiples of 4096 elements from the start of the tensor, so every element goes through the
same (vectorized or scalar-tail) kernel path as in training. ``tests/property/test_exactness.py`` checks the
result bit for bit against the uninterrupted run with tiny chunks, and workers=2 against workers=1.
"""

from __future__ import annotations

import functools
import gc
import inspect
import math
import mmap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lowdiff.compressors import decode_payload, topk
from lowdiff.errors import CorruptFileError
from lowdiff.named_state import to_indexed, to_named
from lowdiff.recovery import optimizers, procs
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
    """The optimizer class named in a manifest. Only ``torch.optim`` classes are resolved from a run directory;
    pass ``allowed`` (the class itself) to replay with another optimizer (lowdiff.recovery.optimizers)."""
    return optimizers.resolve_optimizer_class(path, allowed)


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


def replay_partition(manifest: Manifest, snapshot: FileSet, segments: list[Segment], target: int,
                     names: list[str] | None, with_buffers: bool, optimizer_class: type | None = None,
                     device: str = "cpu", progress: Any = None, workers: int = 1) -> PartitionResult:
    """Replay parameters ``names`` (None: all) from the snapshot to ``target``; returns CPU tensors.

    ``workers`` > 1 replays disjoint shares of the tensors in that many processes (element-wise optimizers on
    the CPU only; the caller checks that, and that forking is safe: lowdiff.recovery.procs). The result is
    bit-identical to ``workers=1``; ``PartitionResult.workers`` says how many took part."""
    times = PhaseTimes()
    t0 = time.perf_counter()
    optimized = manifest.optimized_params
    # The partition that carries buffers also carries parameters no optimizer group holds (they never change).
    extra = [p.name for p in manifest.params if p.name not in set(optimized)] if with_buffers else []
    only = None if names is None else set(names) | set(extra)
    snap = read_snapshot(snapshot, manifest, only=only, with_buffers=with_buffers)
    times.load_snapshot_s = time.perf_counter() - t0
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
    stepper: _Stepper | None = None
    if opt is not None:
        stepper = _Stepper(manifest, opt, params, device, workers,
                           chunked=manifest.optimizer_class in ELEMENTWISE_OPTIMIZERS, share=share)
    buffers = dict(snap.buffers)
    last_q: dict[str, torch.Tensor] = {}
    # result.groups holds the encoded hyperparameters of the newest applied step until the end.
    result = PartitionResult(params={}, optimizer_state={}, groups=list(snap.param_groups), buffers=buffers,
                             compressor_state=snap.compressor_state, last_q=last_q,
                             snapshot_extra=snap.extra, rng=dict(snap.rng),
                             data=dict(snap.extra.get("data") or {}), end_groups=snap.extra.get("end_groups"))
    pending = [seg for seg in segments if seg.last > snap.step]
    start = snap.step
    children: list[procs.Worker] = []
    try:
        own = wanted
        if stepper is not None and stepper.share and pending and not stepper.built:
            # A snapshot taken before the first step holds no optimizer state: that step runs here on whole
            # tensors, creating it; then the state is shared and cut into chunks.
            start = _replay_first_step(manifest, pending[0], wanted, with_buffers, start, target, device, stepper,
                                       result, times, progress)
        if stepper is not None and stepper.built and len(stepper.opts) > 1:
            shared = stepper.shared_keys()
            stepper.drop_grads()  # each process decodes into buffers of its own: none inherited to copy on write
            procs.trim_heap()
            # Objects that exist now are left out of the children's garbage collections, which would otherwise
            # write to (and so copy) every page of the inherited Python heap.
            gc.freeze()
            try:
                for w in range(1, len(stepper.opts)):
                    children.append(procs.start(w, functools.partial(
                        _replay_share, manifest, pending, start, target, device, stepper, w, shared)))
            finally:
                gc.unfreeze()
            result.workers = len(stepper.opts)
            stepper.own(0)
            own = stepper.own_names()
        elif share:
            result.note = ("sequential (no optimized tensors)" if stepper is None else
                           "sequential (a single chunk: nothing to share)" if stepper.built else
                           "sequential (the optimizer state is not per-element)")
        _replay_log(manifest, pending, own, with_buffers, start, target, device, stepper, result, times, progress)
        while children:
            states, child_q = procs.collect(children[0])
            children.pop(0)
            assert stepper is not None
            stepper.import_states(states)
            last_q.update(child_q)
        if stepper is not None:
            result.optimizer_state = stepper.finish()
    finally:
        procs.stop(children)
    result.params = {n: p.detach().cpu() for n, p in params.items()}
    result.params.update({n: snap.params[n] for n in extra})
    result.groups = [{k: v for k, v in decode_value(g).items() if k != "params"} for g in result.groups]
    result.times = times
    return result


def _read_segment(manifest: Manifest, seg: Segment, names: list[str], with_buffers: bool
                  ) -> tuple[int, list[StepData]]:
    with SegmentReader(seg.files, manifest, seg.first, seg.last) as reader:
        return reader.nbytes, reader.read_steps(names, with_buffers=with_buffers)


def _replay_first_step(manifest: Manifest, seg: Segment, names: list[str], with_buffers: bool, start: int,
                       target: int, device: str, stepper: _Stepper, result: PartitionResult, times: PhaseTimes,
                       progress: Any) -> int:
    """Replay the first step after ``start`` alone (all tensors, in this process), and the skipped iterations
    before it; returns its number."""
    t0 = time.perf_counter()
    _, steps = _read_segment(manifest, seg, names, with_buffers)
    times.read_s += time.perf_counter() - t0
    wanted = [sd for sd in steps if start < sd.step <= target]
    # Up to the first step that steps (iterations a GradScaler skipped before it create no optimizer state).
    first = wanted[: next((i + 1 for i, sd in enumerate(wanted) if not sd.skipped), len(wanted))]
    _replay_steps(first, seg, start, target, manifest, device, stepper, result, times, progress)
    return first[-1].step if first else start


def _replay_log(manifest: Manifest, pending: list[Segment], names: list[str], with_buffers: bool, start: int,
                target: int, device: str, stepper: _Stepper | None, result: PartitionResult, times: PhaseTimes,
                progress: Any) -> None:
    """Replay steps ``start`` + 1 .. ``target`` of ``names`` from the segments (a worker's whole job)."""
    # One segment is read (checksums, decompression) ahead while this one is applied; read_s counts only the
    # time apply had to wait for it.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowdiff-prefetch") as pool:
        ahead = pool.submit(_read_segment, manifest, pending[0], names, with_buffers) if pending else None
        for i, seg in enumerate(pending):
            assert ahead is not None
            t0 = time.perf_counter()
            nbytes, steps = ahead.result()
            times.read_s += time.perf_counter() - t0
            result.bytes_read += nbytes
            ahead = pool.submit(_read_segment, manifest, pending[i + 1], names, with_buffers) \
                if i + 1 < len(pending) else None
            _replay_steps(steps, seg, start, target, manifest, device, stepper, result, times, progress)
            del steps


def _replay_share(manifest: Manifest, pending: list[Segment], start: int, target: int, device: str,
                  stepper: _Stepper, index: int, shared: dict[str, frozenset[str]]
                  ) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Body of worker process ``index``: replay its share in place (shared memory); return the rest."""
    stepper.own(index)
    mine = PartitionResult(params={}, optimizer_state={}, groups=[], buffers={}, compressor_state={}, last_q={})
    _replay_log(manifest, pending, stepper.own_names(), False, start, target, device, stepper, mine, PhaseTimes(),
                None)
    return stepper.export_states(shared), {n: q.clone() for n, q in mine.last_q.items()}


def _replay_steps(steps: list[StepData], seg: Segment, snap_step: int, target: int, manifest: Manifest,
                  device: str, stepper: _Stepper | None, result: PartitionResult, times: PhaseTimes,
                  progress: Any) -> None:
    for sd in steps:
        if sd.step <= snap_step or sd.step > target:
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
        if progress is not None:
            progress(1)


# --- exact, fast replay of element-wise optimizers -----------------------------------------------------------

CHUNK_ELEMS = 1 << 16
"""Elements per chunk (a multiple of 4096): 64 K float32 = 256 KB per tensor, so the optimizer's working set for
one chunk (parameter, gradient, two moments, temporaries) stays within L2/L3."""

_TRIM_EVERY_BYTES = 32 << 20  # moving state into shared memory: hand freed private pages back this often
_SQRT_MIN_ELEMS = 256  # below this, the checks cost more than the slow path
_TINY32 = torch.finfo(torch.float32).tiny
_TINY32_T = torch.tensor(_TINY32, dtype=torch.float32)
_POW2_75 = 2.0 ** 75


def exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``x.sqrt()`` bit for bit, without the slow path torch's CPU float32 sqrt (MKL VML) takes on exact zeros
    (4-20x slower on tensors with many zeros, as Adam's second moment has under sparse Top-k gradients).

    Only the zeros are swapped out: when ``x`` holds zeros (and no negative or NaN value), each zero is raised to
    the smallest normal float (``c = max(x, tiny - tiny * sign(x))``: every other element is unchanged), the same
    torch sqrt runs over the zero-free ``c``, and ``min(sqrt(c), x * 2**75)`` puts back the zeros with their sign
    while keeping every other element's sqrt (``x * 2**75 > sqrt(x)`` for all ``x >= 2**-149``). Elements do not
    influence each other's sqrt (tests/property/test_replay_chunks.py checks that), so every element gets the
    very bits ``x.sqrt()`` gives it. Other dtypes, devices and autograd take plain ``x.sqrt()``."""
    n = x.numel()
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad or n < _SQRT_MIN_ELEMS \
            or not x.is_contiguous():
        return x.sqrt()
    # The slow path costs per zero: with few zeros (a 1/64 sample says under 1/16) plain sqrt is faster.
    if n >= 4096 and int(torch.count_nonzero(x.view(-1)[::64])) * 16 > (n + 63) // 64 * 15:
        return x.sqrt()
    if x.amin().item() != 0:  # no zeros (or a negative / NaN, which the plain path handles)
        return x.sqrt()
    c = torch.sub(_TINY32_T, x.sign(), alpha=_TINY32)  # tiny where x is +-0, 0 where x > 0 (exact)
    torch.maximum(x, c, out=c)
    c.sqrt_()
    return torch.minimum(c, x.mul(_POW2_75), out=c)


class _FastSqrtState(torch.Tensor):
    """An optimizer state tensor whose ``.sqrt()`` is :func:`exact_sqrt`; every other op is plain torch (no
    ``__torch_function__`` overhead). Only the replayer's chunk views are wrapped, and unwrapped on return."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def sqrt(self) -> torch.Tensor:
        return exact_sqrt(self.as_subclass(torch.Tensor))


_SHARED = "\0lowdiff:shared"  # export_states: "this entry is a view of the shared full tensor"


def _plain(t: Any) -> Any:
    return t.as_subclass(torch.Tensor) if isinstance(t, _FastSqrtState) else t


class _Chunk:
    __slots__ = ("a", "b", "param", "opt", "whole")

    def __init__(self, a: int, b: int, param: torch.nn.Parameter, whole: bool) -> None:
        self.a, self.b, self.param, self.whole = a, b, param, whole
        self.opt: torch.optim.Optimizer | None = None

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This chunk of a tensor shaped like the parameter."""
        return t.view(t.shape) if self.whole else t.view(-1)[self.a:self.b]


class _Stepper:
    """Owns the replayed optimizer: decodes each step's gradients into ``.grad`` and runs the step.

    chunked (element-wise optimizers on CPU): the parameters are cut into ``CHUNK_ELEMS`` views, stepped by
    ``workers`` optimizer instances of the run's class, each over a contiguous share of the chunks (one per worker
    process), whose per-element state tensors are views of one full tensor per parameter and key. With ``share``
    those full tensors and the parameters live in one shared anonymous mapping, so forked workers step them in
    place. Otherwise the optimizer built from the snapshot steps whole tensors, exactly as :func:`apply_step`."""

    def __init__(self, manifest: Manifest, opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                 device: str, workers: int, chunked: bool, share: bool = False) -> None:
        self.manifest, self.opt, self.params, self.device = manifest, opt, params, device
        # Top-k: one dense gradient buffer per parameter, re-zeroed only where the previous step wrote.
        self.topk_buf: dict[str, torch.Tensor] = {}
        self.topk_prev: dict[str, torch.Tensor] = {}
        self.topk_version: dict[str, int] = {}
        self.grad_of: dict[str, torch.Tensor | None] = {}  # the tensor each parameter's chunk grads view
        d = opt.defaults
        self.chunked = chunked and device == "cpu" and not d.get("differentiable") and not d.get("fused") \
            and not d.get("capturable") and all(p.is_contiguous() and p.layout == torch.strided
                                                for p in params.values())
        self.share = share and self.chunked
        self.arena: mmap.mmap | None = None
        self.opts: list[torch.optim.Optimizer] = [opt]
        self.gmaps: list[list[int]] = []
        self.mine: torch.optim.Optimizer | None = None
        """After :meth:`own`: the one optimizer (share of the chunks) this process steps."""
        self.own_set: set[str] | None = None
        self.workers = workers
        self.wrap = not d.get("foreach")  # the foreach kernels are handed plain tensors only
        self.built = False
        self.missing: set[str] = set()
        self.full_state: dict[str, dict[str, torch.Tensor]] = {}
        # A snapshot taken before the first step has no optimizer state yet: that step runs on whole tensors, so
        # the optimizer creates full-size state, and the chunks are cut after it (no per-chunk copies to merge).
        if self.chunked and all(opt.state.get(p) for p in params.values()):
            self._build()

    def _build(self) -> None:
        opt, params, workers = self.opt, self.params, self.workers
        # Every state entry must be per-element (shaped like its parameter) or a scalar; else no chunking.
        for p in params.values():
            for k, v in list(opt.state.get(p, {}).items()):
                if not isinstance(v, torch.Tensor) or (v.dim() == 0 and p.dim() > 0):
                    continue
                if v.shape != p.shape or v.layout != torch.strided or v.device != p.device:
                    self.chunked = False
                    return
                if not v.is_contiguous():
                    opt.state[p][k] = v.contiguous()
        self.built = True
        if self.share:
            self.drop_grads()  # the step they fed is done; fewer bytes resident while the state moves
            self._move_to_shared()
        size = max(4096, CHUNK_ELEMS - CHUNK_ELEMS % 4096) if CHUNK_ELEMS >= 4096 else max(1, CHUNK_ELEMS)
        name_of = {id(p): n for n, p in params.items()}
        self.chunks: dict[str, list[_Chunk]] = {}
        order: list[tuple[int, _Chunk]] = []  # (group index, chunk) in parameter order
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                n = name_of[id(p)]
                numel = p.numel()
                if numel <= size:
                    cs = [_Chunk(0, numel, torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad), True)]
                else:
                    flat = p.detach().view(-1)
                    cs = [_Chunk(a, min(a + size, numel), torch.nn.Parameter(flat[a:a + size],
                                                                            requires_grad=p.requires_grad), False)
                          for a in range(0, numel, size)]
                self.chunks[n] = cs
                order += [(gi, c) for c in cs]
        # Cut the chunks (in parameter order) into ``workers`` contiguous runs of about equal elements: each worker
        # then reads and decodes whole tensors, except where a run boundary splits one.
        nworkers = max(1, min(workers, len(order)))
        sizes = [max(c.b - c.a, 1) for _, c in order]
        total = sum(sizes)
        mine: list[list[int]] = [[] for _ in range(nworkers)]
        acc = 0
        for i, n in enumerate(sizes):
            mine[min(nworkers - 1, (2 * acc + n) * nworkers // (2 * total))].append(i)
            acc += n
        self.opts, self.gmaps = [], []
        for idx in mine:
            groups, gmap = [], []
            for gi, group in enumerate(opt.param_groups):
                cps = [order[i][1] for i in idx if order[i][0] == gi]
                if cps:
                    groups.append({**{k: v for k, v in group.items() if k != "params"},
                                   "params": [c.param for c in cps]})
                    gmap.append(gi)
            if groups:
                copt = _construct_like(opt, groups)
                for gi in gmap:
                    for i in idx:
                        if order[i][0] == gi:
                            order[i][1].opt = copt
                self.opts.append(copt)
                self.gmaps.append(gmap)
        # Per-element state loaded from the snapshot: the chunks' entries are views of the full tensors.
        for n, p in params.items():
            st = opt.state.get(p)
            if not st:
                self.missing.add(n)
                continue
            full = {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and (v.dim() > 0 or p.dim() == 0)}
            self.full_state[n] = full
            for c in self.chunks[n]:
                assert c.opt is not None
                c.opt.state[c.param] = {k: self._chunk_state(c, full[k]) if k in full else
                                        (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}

    def _chunk_state(self, c: _Chunk, full: torch.Tensor) -> torch.Tensor:
        v = c.view(full)
        return v.as_subclass(_FastSqrtState) if self.wrap else v

    def _move_to_shared(self) -> None:
        """Move every parameter and per-element state tensor into one ``MAP_SHARED`` anonymous mapping (before the
        chunks view them): worker processes forked later update them in place for everyone."""
        opt = self.opt
        # (owner, key): a parameter (key None) or an entry of a state dict. Only these hold the private copies,
        # so each is freed as soon as its tensor has moved.
        slots: list[tuple[Any, Any]] = []
        for p in self.params.values():
            slots.append((p, None))
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape and (v.dim() > 0 or p.dim() == 0):
                    slots.append((opt.state[p], k))
        align = 64

        def get(owner: Any, key: Any) -> torch.Tensor:
            return owner.detach() if key is None else owner[key]

        total = sum((get(o, k).nbytes + align - 1) // align * align for o, k in slots)
        self.arena = mmap.mmap(-1, max(total, align))
        offset = freed = 0
        for owner, key in slots:
            if freed >= _TRIM_EVERY_BYTES:
                procs.trim_heap()  # hand the private copies already moved back, so they never all coexist
                freed = 0
            t = get(owner, key)
            freed += t.nbytes
            if t.numel():
                new = torch.frombuffer(self.arena, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
                new.copy_(t)
            else:
                new = torch.empty_like(t)
            offset += (t.nbytes + align - 1) // align * align
            del t
            if key is None:
                owner.data = new
            else:
                owner[key] = new
        procs.trim_heap()

    def drop_grads(self) -> None:
        """Forget every gradient and decode buffer (they are rebuilt at the next step)."""
        for cs in getattr(self, "chunks", {}).values():
            for c in cs:
                c.param.grad = None
        for p in self.params.values():
            p.grad = None
        for d in (self.grad_of, self.topk_buf, self.topk_prev, self.topk_version):
            d.clear()

    def shared_keys(self) -> dict[str, frozenset[str]]:
        """Per parameter, the state keys held in full shared tensors now (chunks' entries view them)."""
        return {n: frozenset(full) for n, full in self.full_state.items()}

    def own(self, index: int) -> None:
        """From now on this process steps only share ``index`` of the chunks (and decodes only its tensors)."""
        self.mine = self.opts[index]
        self.opts, self.gmaps = [self.opts[index]], [self.gmaps[index]]
        names = self.own_set = set(self.own_names())
        for d in (self.topk_buf, self.topk_prev, self.topk_version):
            for n in [n for n in d if n not in names]:
                del d[n]

    def own_names(self) -> list[str]:
        return [n for n, cs in self.chunks.items() if any(c.opt is self.mine for c in cs)]

    def export_states(self, shared: dict[str, frozenset[str]]) -> list[tuple[str, int, list[tuple[str, Any]]]]:
        """This process's chunks' optimizer state except what lives in the shared tensors (marked _SHARED)."""
        out = []
        for n, cs in self.chunks.items():
            keys = shared.get(n, frozenset())
            for i, c in enumerate(cs):
                st = c.opt.state.get(c.param) if c.opt is self.mine else None  # type: ignore[union-attr]
                if st:
                    out.append((n, i, [(k, _SHARED if k in keys else
                                        (_plain(v).clone() if isinstance(v, torch.Tensor) else v))
                                       for k, v in st.items()]))
        return out

    def import_states(self, states: list[tuple[str, int, list[tuple[str, Any]]]]) -> None:
        """Adopt a worker process's :meth:`export_states` for its chunks."""
        for n, i, items in states:
            c = self.chunks[n][i]
            assert c.opt is not None
            c.opt.state[c.param] = {k: self._chunk_state(c, self.full_state[n][k])
                                    if isinstance(v, str) and v == _SHARED else v for k, v in items}
        if self.missing:
            self._adopt_new_state()

    # -- gradients ---------------------------------------------------------------------------------------------
    def set_grads(self, sd: StepData, seg: Segment) -> None:
        for n in self.params:
            if self.own_set is not None and n not in self.own_set:
                continue  # another worker's tensor (not read here)
            payload = sd.grads.get(n)
            if payload is None:
                self._assign(n, None)
                continue
            spec = self.manifest.param(n)
            if self.chunked and set(payload) == {"values", "indices"}:
                g = self._dense_topk(n, payload, spec.shape, seg, sd.step)
            else:
                g = decode_payload({k: v.to(self.device) for k, v in payload.items()}, spec.shape)
                self.topk_buf.pop(n, None)
            if g.dtype != DTYPES[spec.dtype]:
                raise CorruptFileError(f"{seg.files}: step {sd.step} gradient of {n!r} is {g.dtype}, "
                                       f"parameter is {spec.dtype}")
            self._assign(n, g)

    def _dense_topk(self, n: str, payload: dict[str, torch.Tensor], shape: Any, seg: Segment,
                    step: int) -> torch.Tensor:
        """``topk.decode`` into a buffer reused across steps (only the previous step's indices are zeroed again)."""
        values, indices = payload["values"], payload["indices"]
        buf = self.topk_buf.get(n)
        previous = self.topk_prev.get(n)
        if buf is None or buf.dtype != values.dtype or buf._version != self.topk_version[n]:
            # First use, or the optimizer wrote into the old one.
            buf = torch.zeros(math.prod(int(s) for s in shape), dtype=values.dtype)
            self.topk_buf[n] = buf
            previous = torch.empty(0, dtype=torch.long)
        try:
            # The segment reader has checked the indices (integer, in range, strictly increasing).
            g = topk.decode(values, indices, shape, check_range=False, out=buf, previous=previous)
        except CorruptFileError as e:
            raise CorruptFileError(f"{seg.files}: step {step}: gradient of {n!r}: {e}") from e
        self.topk_prev[n] = indices.long()
        self.topk_version[n] = buf._version
        return g

    def _assign(self, n: str, g: torch.Tensor | None) -> None:
        if not self.built:
            self.params[n].grad = g
            return
        if n in self.grad_of and self.grad_of[n] is g is None:
            return
        buf = self.topk_buf.get(n)
        if g is not None and buf is not None and self.grad_of.get(n) is buf:
            return  # the chunks already view this (updated in place) buffer
        self.grad_of[n] = buf if (g is not None and buf is not None) else g
        for c in self.chunks[n]:
            if self.mine is None or c.opt is self.mine:
                c.param.grad = None if g is None else c.view(g)

    # -- step --------------------------------------------------------------------------------------------------
    def step(self, groups: list[dict[str, Any]]) -> None:
        hyper = [{k: v for k, v in decode_value(g, self.device).items() if k != "params"} for g in groups]
        if not self.built:
            for g_opt, h in zip(self.opt.param_groups, hyper):
                g_opt.update(h)
            self.opt.step()
            if self.chunked:
                for p in self.params.values():
                    p.grad = None
                self._build()
            return
        for o, gmap in zip(self.opts, self.gmaps):
            for g_opt, gi in zip(o.param_groups, gmap):
                g_opt.update(hyper[gi])
        for o in self.opts:
            o.step()
        if self.missing:
            self._adopt_new_state()

    def _adopt_new_state(self) -> None:
        """State the optimizer created lazily in its first step (none in the snapshot) is per chunk: copy it into
        full tensors once and make the chunks' entries views of those, as for state loaded from a snapshot."""
        for n in list(self.missing):
            cs = self.chunks[n]
            states = [c.opt.state.get(c.param) for c in cs]  # type: ignore[union-attr]
            if not all(states):
                continue
            p = self.params[n]
            full: dict[str, torch.Tensor] = {}
            for k, v in states[0].items():  # type: ignore[union-attr]
                if not all(isinstance(s[k], torch.Tensor) and s[k].shape == c.param.shape  # type: ignore[index]
                           and (s[k].dim() > 0 or p.dim() == 0) for s, c in zip(states, cs)):  # type: ignore[index]
                    continue
                if cs[0].whole:
                    full[k] = _plain(v).contiguous()
                else:
                    t = torch.empty(p.shape, dtype=v.dtype, device=v.device)
                    for s, c in zip(states, cs):
                        c.view(t).copy_(s[k])  # type: ignore[index]
                    full[k] = t
            for s, c in zip(states, cs):
                for k, t in full.items():
                    s[k] = self._chunk_state(c, t)  # type: ignore[index]
            self.full_state[n] = full
            self.missing.discard(n)

    def finish(self) -> dict[str, dict[str, Any]]:
        """Optimizer state per parameter name (plain CPU tensors); drops the gradients."""
        for p in self.params.values():
            p.grad = None
        self.topk_buf.clear()
        self.topk_prev.clear()
        if not self.built:
            name_of = {id(p): n for n, p in self.params.items()}
            order = [name_of[id(q)] for g in self.opt.param_groups for q in g["params"]]
            return {n: {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                    for n, st in to_named(self.opt.state_dict()["state"], order).items()}
        out: dict[str, dict[str, Any]] = {}
        for n, cs in self.chunks.items():
            for c in cs:
                c.param.grad = None
            states = [c.opt.state.get(c.param) for c in cs]  # type: ignore[union-attr]
            if not any(states):
                continue
            if not all(states) or n in self.missing:
                raise AssertionError(f"replay: the chunks of {n!r} disagree on having optimizer state")
            st: dict[str, Any] = {}
            for k, v in states[0].items():  # type: ignore[union-attr]
                if k in self.full_state[n]:
                    st[k] = _plain(self.full_state[n][k]).cpu()
                    continue
                for s in states[1:]:
                    w = s[k]  # type: ignore[index]
                    if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                        raise AssertionError(f"replay: the chunks of {n!r} disagree on optimizer state {k!r}")
                st[k] = _plain(v).cpu() if isinstance(v, torch.Tensor) else v
            out[n] = st
        return out


def _construct_like(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Another instance of ``opt``'s class over ``groups``, with exactly ``opt``'s defaults and group settings."""
    cls = type(opt)
    new = cls.__new__(cls)
    torch.optim.Optimizer.__init__(new, [{"params": g["params"]} for g in groups], dict(opt.defaults))
    for g_new, g in zip(new.param_groups, groups):
        g_new.clear()
        g_new.update(g)
    for k, v in vars(opt).items():  # class-specific attributes set by the constructor (e.g. flags)
        if k not in vars(new) and k not in ("state", "param_groups"):
            setattr(new, k, v)
    return new


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
    optimizers.check_snapshot_state(manifest, cls, snap)  # keys, shapes, dtypes: the class's own, or refused
    # Pass only the defaults the constructor takes (AdamW records `decoupled_weight_decay` but does not take
    # it); group hyperparameters are then set exactly by load_state_dict from the snapshot.
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in decode_value(manifest.optimizer_defaults, device).items() if k in accepted}
    group_specs = [[n for n in g if n in params] for g in manifest.param_groups]
    try:
        opt = cls([{"params": [params[n] for n in g]} for g in group_specs], **defaults)
    except (TypeError, ValueError) as e:
        raise CorruptFileError(f"cannot rebuild {manifest.optimizer_class} from the manifest's defaults: {e}") from e
    hyper = [decode_value(g, device) for g in snap.param_groups]
    opt.load_state_dict(to_indexed(snap.optimizer_state, group_specs, hyper))
    return opt
