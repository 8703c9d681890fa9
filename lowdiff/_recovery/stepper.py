"""Steps the replayed optimizer: each logged step's gradients into ``.grad``, then the optimizer's own step.

For element-wise optimizers on the CPU, every parameter (and its optimizer state) is cut into contiguous chunks
of ``ReplayOptions.chunk_elems`` elements, each a *view* handed to its own optimizer entry, so the optimizer's
~8 passes per step run over a chunk that stays in cache. The chunks are cut into ``workers`` contiguous shares,
one per optimizer instance; with ``share`` the full tensors live in one shared anonymous mapping, so worker
processes forked later (lowdiff/_recovery/procs.py) step them in place.

Chunk boundaries are multiples of 4096 elements from the start of the tensor, so every element goes through the
same (vectorized or scalar-tail) kernel path as in training.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import torch

from lowdiff._compressors import decode_payload, topk
from lowdiff._recovery import procs
from lowdiff._recovery.exact_sqrt import fast_sqrt_type, plain
from lowdiff._recovery.options import DEFAULT_OPTIONS, ReplayOptions
from lowdiff._recovery.rebuild import construct_like, unscale
from lowdiff._storage.format import DTYPES, decode_value
from lowdiff._storage.log_reader import Segment
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.named_state import to_named
from lowdiff._storage.segment import StepData
from lowdiff.errors import CorruptFileError

_TRIM_EVERY_BYTES = 32 << 20  # moving state into shared memory: hand freed private pages back this often
_SHARED = "\0lowdiff:shared"  # export_states: "this entry is a view of the shared full tensor"


class Chunk:
    __slots__ = ("a", "b", "param", "opt", "whole")

    def __init__(self, a: int, b: int, param: torch.nn.Parameter, whole: bool) -> None:
        self.a, self.b, self.param, self.whole = a, b, param, whole
        self.opt: torch.optim.Optimizer | None = None

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This chunk of a tensor shaped like the parameter."""
        return t.view(t.shape) if self.whole else t.view(-1)[self.a:self.b]


class Stepper:
    """Owns the replayed optimizer: decodes each step's gradients into ``.grad`` and runs the step.

    chunked (element-wise optimizers on CPU): the parameters are cut into ``options.chunk_elems`` views, stepped by
    ``workers`` optimizer instances of the run's class, each over a contiguous share of the chunks (one per worker
    process), whose per-element state tensors are views of one full tensor per parameter and key. With ``share``
    those full tensors and the parameters live in one shared anonymous mapping, so forked workers step them in
    place. Otherwise the optimizer built from the snapshot steps whole tensors, exactly as
    :func:`lowdiff._recovery.rebuild.apply_step`."""

    def __init__(self, manifest: Manifest, opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                 device: str, workers: int, chunked: bool, share: bool = False,
                 options: ReplayOptions = DEFAULT_OPTIONS) -> None:
        self.manifest, self.opt, self.params, self.device = manifest, opt, params, device
        self.chunk_elems = options.chunk_elems
        self.sqrt_type = fast_sqrt_type(options.sqrt_min_elems)
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
        ce = self.chunk_elems
        size = max(4096, ce - ce % 4096) if ce >= 4096 else max(1, ce)
        name_of = {id(p): n for n, p in params.items()}
        self.chunks: dict[str, list[Chunk]] = {}
        order: list[tuple[int, Chunk]] = []  # (group index, chunk) in parameter order
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                n = name_of[id(p)]
                numel = p.numel()
                if numel <= size:
                    cs = [Chunk(0, numel, torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad), True)]
                else:
                    flat = p.detach().view(-1)
                    cs = [Chunk(a, min(a + size, numel), torch.nn.Parameter(flat[a:a + size],
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
        for i, elems in enumerate(sizes):
            mine[min(nworkers - 1, (2 * acc + elems) * nworkers // (2 * total))].append(i)
            acc += elems
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
                copt = construct_like(opt, groups)
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

    def _chunk_state(self, c: Chunk, full: torch.Tensor) -> torch.Tensor:
        v = c.view(full)
        return v.as_subclass(self.sqrt_type) if self.wrap else v

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
                                        (plain(v).clone() if isinstance(v, torch.Tensor) else v))
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
        scaled: list[torch.Tensor] = []
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
            scaled.append(g)
        if sd.grad_scale is not None and scaled:
            unscale(scaled, sd.grad_scale)
            for n in self.topk_buf:  # scaled in place: not a write of the optimizer's
                self.topk_version[n] = self.topk_buf[n]._version

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
                    full[k] = plain(v).contiguous()
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
                    st[k] = plain(self.full_state[n][k]).cpu()
                    continue
                for s in states[1:]:
                    w = s[k]  # type: ignore[index]
                    if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                        raise AssertionError(f"replay: the chunks of {n!r} disagree on optimizer state {k!r}")
                st[k] = plain(v).cpu() if isinstance(v, torch.Tensor) else v
            out[n] = st
        return out

