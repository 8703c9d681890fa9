"""The stager: turns the live training state into complete, owned step records and snapshots.

The role DCP's ``AsyncStager`` plays: one call produces a :class:`lowdiff._transfer.host_copies.Staged` item (host
tensors, the CUDA event their copies complete at, and the release of pooled buffers) that the writer can persist while
training goes on. A step is staged in two calls because its copies must be queued before the inner optimizer
step (on a GPU they overlap its kernels) while its RNG state exists only after it:

    copies = stager.copy_step(payloads, slots)       # before inner.step(): packed into a writer's slot (in flight)
    inner.step()
    record = stager.finish_step(copies, step, groups, data)  # after it: a Staged[StepRecord]

A snapshot is one call, :meth:`Stager.snapshot`. What the loop changes after ``opt.step()`` (the tracked state at the
end of the iteration) is added to the record when the iteration ends (lowdiff._training.iteration).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lowdiff import rng as rng_state
from lowdiff._compressors.base import Compressor, StepPayloads
from lowdiff._storage import packed as packed_buffers
from lowdiff._storage.format import encode_group
from lowdiff._storage.named_state import to_named
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._storage.stop import StopState
from lowdiff._training.capture import LayerwiseCapture
from lowdiff._training.flat_steps import FlatSteps, keyed
from lowdiff._training.fsdp import local as local_tensor
from lowdiff._training.model_spec import ModelSpec
from lowdiff._transfer.host_copies import CopyInFlight, HostCopier, HostPool, Slot, Staged
from lowdiff._transfer.packing import PackedStep, StepPacker
from lowdiff._transfer.scalars import read_later


@dataclass
class StepCopies:
    """A step's payloads and changed buffers on their way to host memory (not yet a record): as tensors, or
    ``packed`` into one host buffer (lowdiff._transfer.packing; then ``grads`` and ``buffers`` are empty)."""

    grads: dict[str, dict[str, torch.Tensor]]
    buffers: dict[str, torch.Tensor]
    ready: Any
    release: Any
    packed: PackedStep | None = None


class Slots(Protocol):
    """Where packed steps and snapshots go: the writer's host buffers (lowdiff._transfer.host_copies.HostSlots) or a
    persistence process's ring and snapshot arena (lowdiff._persist.process_writer.ProcessWriter). None: the writer is
    gone (its error reaches the caller at the next step)."""

    def alloc(self, nbytes: int, pinned: bool) -> Slot | None: ...

    def alloc_snapshot(self, nbytes: int, pinned: bool) -> Slot | None: ...


SNAPSHOT_SECTIONS = ("params", "buffers", "optimizer_state", "compressor_state", "rank_compressor_state")
"""The fields of a SnapshotState whose tensors are live state, packed together by :meth:`Stager.snapshot`."""


@dataclass
class PackedSnapshot:
    """A snapshot's live-state tensors packed into one writer slot: ``skel`` is the SNAPSHOT_SECTIONS of the state
    with each tensor replaced by a :class:`lowdiff._storage.packed.Ref` to its place in ``packed``."""

    packed: PackedStep
    skel: dict[str, Any]


class Stager:
    """Stages the state of one model + optimizer + compressor. ``owned``: the parameters whose state this rank
    snapshots; ``leader``: whether this rank stages the buffers; ``per_rank``: training under torch.distributed
    with several ranks, whose compressor memory differs per rank (each rank snapshots all of its own)."""

    def __init__(self, spec: ModelSpec, optimizer: torch.optim.Optimizer, compressor: Compressor, *,
                 copier: HostCopier, owned: set[str], leader: bool, per_rank: bool = False,
                 layerwise: LayerwiseCapture | None = None, copy_thread: bool = False) -> None:
        self.spec = spec
        self.optimizer = optimizer
        self.compressor = compressor
        self.owned = owned
        self.leader = leader
        self.per_rank = per_rank
        self.layerwise = layerwise
        self.copier = copier
        self._pool = HostPool()
        # Snapshots' host copies on the CPU: reused from one snapshot to the next (a fresh 595 MB copy of a 50M
        # model's state faulted its pages in on the training thread, ~1 s per snapshot here); held between them.
        self._snapshot_pool = HostPool()
        self._buffer_last: dict[str, torch.Tensor] = {}
        # Each buffer's module's dict of buffers and its key there (a reassigned buffer is found too), read in one
        # comprehension a step: no Python call per buffer.
        self._buffers_at = [(b.name, b.module._buffers, b.attr) for b in spec.buffers]
        self._packer = StepPacker()
        self._flat = FlatSteps()
        self._snapshot_packer = StepPacker()
        self._slots: Slots | None = None
        self._unfinished: StepCopies | None = None  # packed by copy_step, not yet a record (finish_step)
        self.copy_thread = copy_thread
        """CPU snapshots are copied on the copier's thread (:meth:`settle_snapshot`); set when nothing but the
        optimizer step changes parameters, optimizer state and compressor state between two steps (no DDP
        communication hook compressing during backward)."""
        self._copying: Any = None  # the CPU snapshot copy in flight on the copy thread
        # Each rank has its own generators: under DDP its RNG entries are keyed by rank (docs/reference/FORMAT.md §7).
        self._rng_rank = rng_state.current_rank()
        self._cuda_devices = sorted({p.device.index or 0 for p in spec.params.values() if p.is_cuda})

    @property
    def reused(self) -> int:
        """Step records staged into reused host buffers so far."""
        return self._pool.reused + getattr(self._slots, "reused", 0)

    @property
    def snapshots_reused(self) -> int:
        """Snapshots staged into the host buffers of an earlier one so far."""
        return self._snapshot_pool.reused + getattr(self._slots, "snapshots_reused", 0)

    def remember_buffers(self) -> None:
        """Take the buffers' values now as the baseline the next records' changed buffers are found against."""
        self._buffer_last = {s.name: s.get().detach().clone() for s in self.spec.buffers}

    def buffer_baseline(self) -> dict[str, torch.Tensor]:
        """Host copies of the values the next record's changed buffers are found against."""
        return {n: t.cpu() for n, t in self._buffer_last.items()}

    def copy_step(self, grads: dict[str, dict[str, torch.Tensor]], slots: Slots | None = None,
                  payloads: StepPayloads | None = None) -> StepCopies:
        """Start the host copies of a step's payloads (by parameter name, then field) and changed buffers; with
        ``slots``, packed into one of its buffers (one copy per dtype) unless layer-wise capture has copies.
        ``payloads``: where the compressor wrote the payloads, in buffers it writes again at the next step."""
        abandoned, self._unfinished = self._unfinished, None
        if abandoned is not None and abandoned.release is not None:
            abandoned.release()  # the step staged last never became a record (its inner step raised): its slot back
        buffers = self._changed_buffers() if self.leader else {}
        if slots is not None and self.layerwise is None:
            packed = self._pack_step(grads, buffers, slots, payloads)
            if packed is not None:
                self._unfinished = packed
                return packed
        reused = {f.untyped_storage().data_ptr() for f in payloads.flats.values()} if payloads is not None else ()
        captured = self.layerwise.take() if self.layerwise is not None else {}
        names: list[tuple[str, str]] = []
        tensors: list[torch.Tensor] = []
        live: list[bool] = []
        staged: dict[str, dict[str, torch.Tensor]] = {n: {} for n in grads}
        for n, payload in grads.items():
            grad = local_tensor(self.spec.params[n].grad)
            for f, t in payload.items():
                hit = captured.get(n)
                if hit is not None and hit[0] is t:
                    staged[n][f] = hit[1]  # copied by the hook during backward, unchanged since
                    continue
                names.append((n, f))
                tensors.append(t)
                # A payload sharing memory with .grad (compressor none, PowerSGD's 1-D tensors) is live: the user
                # may zero that gradient in place (zero_grad(set_to_none=False)) before the writer reads it.
                # So is a payload in the compressor's reused buffers, which its next step writes again.
                ptr = t.untyped_storage().data_ptr()
                live.append(grad is not None and ptr == grad.untyped_storage().data_ptr() or ptr in reused)
        for n, t in buffers.items():
            names.append(("", n))
            tensors.append(t)
            live.append(True)  # the module's own buffer: the next forward pass changes it
        hooked = self.layerwise.ready() if self.layerwise is not None else None
        host, ready, release = self.copier.stage(tensors, live, pool=self._pool)
        out_buffers = {}
        for (n, f), t in zip(names, host):
            if n:
                staged[n][f] = t
            else:
                out_buffers[f] = t
        # One side stream: a later event also covers the copies the hooks queued before it.
        return StepCopies(staged, out_buffers, ready if ready is not None else hooked, release)

    def step_targets(self, slots: Slots | None) -> dict[torch.dtype, torch.Tensor] | None:
        """Where the compressor may write this step's payloads (``Compressor.begin_step``): on the CPU, a writer slot
        laid out as the last step packed from its flats was (lowdiff._training.flat_steps). None: where it keeps
        them."""
        if self.layerwise is not None:
            return None
        return self._flat.targets(slots)

    def drop_targets(self) -> None:
        """Give back the slot :meth:`step_targets` handed out for a step that never got packed (it raised)."""
        self._flat.drop()

    def _pack_step(self, grads: dict[str, dict[str, torch.Tensor]], buffers: dict[str, torch.Tensor],
                   slots: Slots, payloads: StepPayloads | None) -> StepCopies | None:
        planned = self._flat.plan(grads, buffers, payloads) if payloads is not None else None
        slot, planned, grads, in_place = self._flat.take_slot(planned, grads)
        if planned is None:
            keys, tensors = keyed(grads, buffers)
            found, _ = self._packer.plan(keys, tensors)
            if found is None:
                return None
            planned = found, tensors
        layout, tensors = planned
        self._slots = slots
        if slot is None:  # else the flats lie in it already: pack_host leaves them in place
            slot = slots.alloc(layout.nbytes, pinned=layout.device.type == "cuda" and self.copier.asynchronous)
        if slot is None:  # the persistence process is gone (its error reaches the caller at the next step)
            return None
        ready = self.copier.pack(layout, tensors if not in_place else None, slot.buf)
        return StepCopies({}, {}, ready, slot.release, PackedStep(slot.buf, layout, slot.handle))

    def finish_step(self, copies: StepCopies, step: int, groups: list[dict[str, Any]],
                    data: dict[str, Any] | None = None, *, skipped: bool = False,
                    grad_scale: torch.Tensor | None = None) -> Staged[StepRecord]:
        """The record of ``step``: call right after the inner step (the RNG state it logs is what the next forward
        pass starts from). ``data``: the encoded state of the objects tracked ``at="step"``; ``skipped``: an
        iteration without an optimizer step (no gradients); ``grad_scale``: StepRecord.grad_scale."""
        self._unfinished = None
        record = StepRecord(step=step, groups=groups, grads=copies.grads, buffers=copies.buffers,
                            rng=self.rng(), data=dict(data or {}), skipped=skipped, packed=copies.packed,
                            grad_scale=grad_scale)
        return Staged(record, copies.ready, copies.release)

    def snapshot(self, step: int, data: dict[str, Any] | None = None,
                 slots: Slots | None = None) -> Staged[SnapshotState]:
        """Copy the full state this rank owns off the live tensors (the snapshot phase; persisting happens in the
        background). On a GPU the copies are in flight when this returns. With ``slots`` (the writer's), they are
        packed into one of its buffers (lowdiff._transfer.packing: one copy per region), which the snapshot's tensors
        are then views of; ``state.packed`` says where (a :class:`PackedSnapshot`)."""
        sd = self.optimizer.state_dict()
        order = [n for n, _ in self.spec.optimized]
        owned = self.owned
        opt_state = {n: {k: local_tensor(v) for k, v in st.items()} for n, st in to_named(sd["state"], order).items()
                     if n in owned}
        groups = [encode_group(g, read_later) | {"params": names}  # a GPU lr: copied, not waited for
                  for names, g in zip(self.spec.stored_manifest.param_groups, self.optimizer.param_groups)]
        shared, mine = self._compressor_memory()
        state = SnapshotState(
            step=step,
            params={n: local_tensor(p.detach()) for n, p in self.spec.params.items() if n in owned},
            buffers={s.name: s.get().detach() for s in self.spec.buffers} if self.leader else {},
            optimizer_state=opt_state,
            param_groups=groups,
            compressor_name=self.compressor.name,
            compressor_state=shared,
            rank_compressor_state=mine,
            rng=self.rng(),
            extra={"data": dict(data or {})},
        )
        # Every tensor above is live state (the next step changes it in place): staged as owned host copies.
        if slots is not None:
            packed = self._pack_snapshot(state, slots)
            if packed is not None:
                return packed
        live: list[tuple[dict[str, Any], str]] = [(state.params, n) for n in state.params]
        live += [(state.buffers, n) for n in state.buffers]
        for d in (*state.optimizer_state.values(), *state.compressor_state.values(),
                  *state.rank_compressor_state.values()):
            live += [(d, k) for k, v in d.items() if isinstance(v, torch.Tensor)]
        host, ready, release = self.copier.stage([d[k] for d, k in live], [True] * len(live),
                                                 pool=self._snapshot_pool)
        for (d, k), t in zip(live, host):
            d[k] = t
        return Staged(state, ready, release)

    def _compressor_memory(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """The compressor's memory this rank persists, as (the same on every rank, this rank's own). Under DDP every
        rank's error-feedback residuals differ: each rank keeps all of its own (FORMAT.md §4); state that is the
        same on every rank (PowerSGD's Q) is kept once, by the rank that owns the parameter."""
        comp = self.compressor.state_dict()
        local = self.compressor.rank_local_keys if self.per_rank else frozenset()
        shared = {n: {k: v for k, v in st.items() if k not in local} for n, st in comp.items() if n in self.owned}
        mine = {n: {k: v for k, v in st.items() if k in local} for n, st in comp.items()}
        return {n: st for n, st in shared.items() if st}, {n: st for n, st in mine.items() if st}

    def stop_state(self, step: int) -> StopState:
        """The compressor's memory at a clean stop after ``step`` (lowdiff._storage.stop), copied to host memory
        now: a close may wait for the device."""
        shared, mine = self._compressor_memory()

        def host(d: dict[str, dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
            return {n: {k: local_tensor(v).detach().to("cpu", copy=True) for k, v in st.items()} for n, st in d.items()}

        return StopState(step=step, compressor_name=self.compressor.name, compressor_state=host(shared),
                         rank_compressor_state=host(mine))

    def _pack_snapshot(self, state: SnapshotState, slots: Slots) -> Staged[SnapshotState] | None:
        """``state``'s live tensors packed into a writer slot (None: the writer is gone). One copy per region
        instead of a host copy per tensor and, in a persistence process, a second copy into its snapshot arena."""
        device = torch.device("cuda", self._cuda_devices[0]) if self._cuda_devices else torch.device("cpu")
        later = self.copy_thread and device.type == "cpu"
        if later:
            # The next forward pass changes buffers (BatchNorm's running statistics) before anything could wait for
            # the copy: they are copied now. The rest changes only inside opt.step(), which waits first.
            state.buffers = {n: t.clone() for n, t in state.buffers.items()}
        tensors: list[torch.Tensor] = []
        skel = _skeleton({k: getattr(state, k) for k in SNAPSHOT_SECTIONS}, tensors, device)
        layout, _ = self._snapshot_packer.plan([("", "")] * len(tensors), tensors)
        if layout is None:
            return None
        # In a persistence process this waits until the previous snapshot is written (one in flight, CheckFreq).
        slot = slots.alloc_snapshot(layout.nbytes, pinned=layout.device.type == "cuda" and self.copier.asynchronous)
        if slot is None:
            return None
        try:
            with torch.no_grad():
                if later and layout.device.type == "cpu":
                    ready = self._copying = self.copier.pack_later(layout, tensors, slot.buf)
                else:
                    ready = self.copier.pack(layout, tensors, slot.buf, kind="snapshot")
        except BaseException:
            if slot.release is not None:
                slot.release()  # a persistence process's arena would otherwise stay taken for good
            raise
        self._slots = slots
        for k, v in packed_buffers.unpack_skeleton(skel, layout.regions, layout.places, slot.buf).items():
            setattr(state, k, v)
        state.packed = PackedSnapshot(PackedStep(slot.buf, layout, slot.handle), skel)
        release = slot.release
        if isinstance(ready, CopyInFlight) and release is not None:
            release = _after(ready, release)  # the slot goes back only once the copy thread is done with it
        return Staged(state, ready, release)

    def settle_snapshot(self) -> float:
        """Wait for the snapshot copy still running on the copy thread, if any (call before anything changes
        parameters, optimizer or compressor state); returns the seconds waited. A copy that failed is reported by
        the writer, which does not write that snapshot."""
        copying = self._copying
        if copying is None or copying.query():
            self._copying = None
            return 0.0
        t0 = time.perf_counter()
        try:
            copying.synchronize()  # an interrupt here leaves it to wait for at the next call
        except Exception:
            pass
        self._copying = None
        return time.perf_counter() - t0

    def rng(self) -> dict[str, torch.Tensor]:
        """This rank's RNG state now (the generators of the CUDA devices the model is on included)."""
        return rng_state.capture_raw(self._rng_rank, rng_state.cuda_devices_in_use(self._cuda_devices))

    def _changed_buffers(self) -> dict[str, torch.Tensor]:
        # Every buffer, every step: whether one changed cannot be told without reading it (kernels such as
        # batch_norm update running stats in place without bumping the tensor's version counter), and a comparison
        # on the device (torch.equal) makes the host wait for the device, once per buffer. The copies are part of
        # the step's one packed copy; the writer leaves out of the segment what did not change (lowdiff._storage.
        # segment), off the training thread.
        return {name: where[attr].detach() for name, where, attr in self._buffers_at}  # type: ignore[union-attr]


def _skeleton(obj: Any, tensors: list[torch.Tensor], device: torch.device) -> Any:
    """``obj`` with every tensor on ``device`` replaced by a :class:`lowdiff._storage.packed.Ref` (the tensor appended
    to ``tensors``) and every other one by a host copy: Adam keeps its step counts on the CPU beside GPU parameters,
    and a model spread over several GPUs has its tensors off the first one copied one by one."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            tensors.append(obj)
            return packed_buffers.Ref(len(tensors) - 1)
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v, tensors, device) for v in obj)
    return obj


def _after(copying: CopyInFlight, release: Callable[[], None]) -> Callable[[], None]:
    """``release``, once ``copying`` is over (whether or not it failed)."""

    def wait_then_release() -> None:
        try:
            copying.synchronize()
        except Exception:
            pass
        release()

    return wait_then_release
