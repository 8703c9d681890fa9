"""The optimizer wrapper: compress -> decode -> inner step -> hand the step's record to the checkpointer."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lowdiff import rng as rng_state
from lowdiff._compressors import Payload, make_compressor
from lowdiff._compressors.base import StepPayloads
from lowdiff._persist.checkpointer import Checkpointer, CheckpointStats, LayerwiseStats, make_policy
from lowdiff._persist.coordinator import Coordinator, owned_names
from lowdiff._persist.shadow import ShadowReplica, make_shadow
from lowdiff._storage.format import Shard, encode_groups
from lowdiff._storage.run_dir import RunDir
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._training import fsdp, lifecycle
from lowdiff._training.capture import LayerwiseCapture
from lowdiff._training.ddp import HookState, ProcessGroupComm, lowdiff_comm_hook
from lowdiff._training.iteration import AT_END, AT_STEP, IterationEnd, Pending, Tracker, is_grad_scaler
from lowdiff._training.lifecycle import (
    OPEN,
    hook_scaler_update,
    init_hook_dicts,
    record_bytes_bound,
    refuse_reevaluating,
    refuse_wrapper,
    release,
    same_state,
    same_tensor,
    wants_layerwise,
)
from lowdiff._training.model_spec import describe, wrapper_chain
from lowdiff._training.param_writes import HookWatch, WriteWatch
from lowdiff._training.resume import apply_end_groups, compressor_state, recover_for_resume, replay_class
from lowdiff._training.stager import Stager
from lowdiff._training.step_zero import REWRITE, fingerprint
from lowdiff._transfer.host_copies import HostCopier
from lowdiff.config import Config, load_config, resolve_codec
from lowdiff.errors import LowDiffError, UnsupportedError

log = logging.getLogger(__name__)

@dataclasses.dataclass
class _LoopState:
    """The wrapper's mutable state, in one object: shallow copies of the wrapper (Lightning's LightningOptimizer
    copies its ``__dict__``) then see the same values."""

    step: int = 0
    """The last logged iteration: optimizer steps plus iterations a tracked GradScaler skipped."""
    closed: bool = False
    needs_resume: bool = False
    stepped: bool = False
    """Whether the current iteration has run its optimizer step (reset by a tracked GradScaler's update())."""
    blocked_reported: float = 0.0
    """Back-pressure already reported, seconds."""


class LowDiffOptimizer(torch.optim.Optimizer):
    """Drop-in for the wrapped optimizer: ``step``, ``zero_grad``, ``param_groups`` and ``state`` behave as the
    inner optimizer's; every ``step`` is also logged. Build it with :func:`lowdiff.wrap`.

    A ``torch.optim.Optimizer`` (LR schedulers, GradScaler, Lightning and accelerate accept it), whose parameter
    groups, state and defaults are the inner optimizer's own objects."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, config: Config) -> None:
        init_hook_dicts(self)  # not Optimizer.__init__: param_groups, state and defaults are the inner optimizer's
        if isinstance(optimizer, LowDiffOptimizer):
            raise LowDiffError("this optimizer is already wrapped by lowdiff")
        refuse_wrapper(optimizer)
        refuse_reevaluating(optimizer)
        self.inner = optimizer
        chain = wrapper_chain(model)
        self.model = chain[-1]
        # Also inside torch.compile(DDP(model)).
        ddp = next((m for m in chain if isinstance(m, torch.nn.parallel.DistributedDataParallel)), None)
        self.config = config
        self._spec = describe(self.model, optimizer, config)
        cc = config.compressor
        self.compressor = make_compressor(cc.name, ratio=cc.ratio, rank=cc.rank, error_feedback=cc.error_feedback)
        self.compressor.check_params(self._spec.params)
        self._sharded: fsdp.Sharded | None = None
        self._coord = Coordinator(ddp is not None or fsdp.is_fsdp(self.model))
        if fsdp.is_fsdp(self.model):  # each rank logs and snapshots its own shards (lowdiff/_training/fsdp.py)
            fsdp.check_config(config)
            self._spec, self._sharded = fsdp.shard_spec(self._spec, optimizer, self._coord.rank,
                                                        self._coord.world_size)
        self._hook: HookState | None = None
        if ddp is not None:
            names = {id(p): n for n, p in self._spec.params.items()}
            self._hook = HookState(self.compressor, names, ProcessGroupComm())
            try:
                ddp.register_comm_hook(self._hook, lowdiff_comm_hook)
            except RuntimeError as e:
                raise LowDiffError(f"cannot install lowdiff's DDP communication hook ({e}); lowdiff brings its own "
                                   "compression hook: do not register another one") from e
        # This rank's share of what is persisted: snapshots balanced by tensor bytes, the log by payload bytes.
        self._owned = owned_names(self._spec, self._coord, lambda p: p.numel() * p.element_size(), self._sharded)
        self._owned_log = owned_names(self._spec, self._coord, lambda p: self.compressor.payload_nbytes(
            tuple(p.shape), p.element_size()), self._sharded)
        self._leader = self._coord.rank == 0
        self._loop = _LoopState()
        self._tracker = Tracker()
        copier = HostCopier(self._spec.params.values())
        layerwise: LayerwiseCapture | None = None
        if config.enabled and cc.name == "none" and self._hook is None and wants_layerwise(config):
            layerwise = LayerwiseCapture([(n, p) for n, p in self._spec.optimized if n in self._owned_log], copier,
                                         bucket_bytes=config.log.capture_bucket_bytes)
        self._stager = Stager(self._spec, optimizer, self.compressor, copier=copier, owned=self._owned,
                              leader=self._leader, per_rank=self._coord.world_size > 1 and self._sharded is None,
                              layerwise=layerwise,
                              copy_thread=config.snapshot.background_copy and self._hook is None)
        # Writes to parameters and their optimizer state between steps, which no replay repeats
        # (lowdiff._training.param_writes). Not under fully_shard: its sharded parameters are DTensors, whose own
        # version counter does not follow their local shards.
        watched = config.enabled and self._sharded is None
        self._writes = WriteWatch(self._spec.params, optimizer) if watched else None
        self._hooks = HookWatch(optimizer) if config.enabled else None
        self._run_dir: RunDir | None = None
        self._checkpointer: Checkpointer | None = None
        self._iteration: IterationEnd | None = None
        self._step0: Any = None
        """Until the first step: what snapshot 0 holds (lowdiff._training.step_zero), or REWRITE."""
        if config.enabled:
            run_dir = RunDir(config.run_dir, Shard(self._coord.rank, self._coord.world_size),
                             compressor_params={"ratio": cc.ratio, "rank": cc.rank})
            self._run_dir = run_dir
            try:
                policy = make_policy(config, run_dir, self._coord,
                                     record_bytes_bound([(n, fsdp.local(p)) for n, p in self._spec.optimized], cc))
                self._checkpointer = Checkpointer(config, run_dir, policy)
                self._iteration = IterationEnd(self._tracker, optimizer, self._checkpointer)
                self._open_run_dir(run_dir)
            except BaseException:
                run_dir.release()  # a failed wrap must not keep the run directory locked
                if layerwise is not None:
                    layerwise.remove()  # nor its hooks on the model's parameters
                raise
            # close() at interpreter exit or when collected unclosed: else a script without close() loses its last
            # partial segment, and the daemon writer may die mid-write (exit status 134). Never holds the wrapper.
            self._release = weakref.finalize(self, release, self._checkpointer, layerwise, self._iteration)
            self._release.atexit = False  # _close_at_exit runs it, before h5py's own exit handler
            lifecycle.opened(self)

    # -- the torch.optim.Optimizer surface -----------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refused, except for the state the optimizer already has (accelerate reloads it to place it on its
        device): a different state under the log would make replay wrong."""
        if same_state(self.inner.state_dict(), state_dict):
            self._stager.settle_snapshot()
            self.inner.load_state_dict(state_dict)
            return
        raise UnsupportedError("load optimizer state before lowdiff.wrap(), or restore a lowdiff run with "
                               "opt.resume(); changing it under the log would make replay wrong")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UnsupportedError("add parameter groups before lowdiff.wrap(): the run directory records the groups")

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a LowDiffOptimizer cannot be pickled or copied: it owns a run directory")

    def __repr__(self) -> str:
        return f"LowDiffOptimizer({self.inner!r}, run_dir={str(self.config.run_dir)!r})"

    @property
    def iteration(self) -> int:
        """The last logged iteration: the state now is the one after iteration ``iteration`` (what ``resume()``
        returned, plus one per ``step()``, plus one per iteration a tracked GradScaler skipped)."""
        return self._loop.step

    @property
    def step_count(self) -> int:
        """The same as :attr:`iteration` (optimizer steps, when no tracked GradScaler skips any)."""
        return self._loop.step

    @property
    def needs_resume(self) -> bool:
        """Whether the run directory holds a run that :meth:`resume` has not restored yet."""
        return self._loop.needs_resume

    def track(self, obj: Any, name: str = "data", *, at: str = "auto") -> Any:
        """Log ``obj.state_dict()`` with every step and restore it with ``load_state_dict`` in :meth:`resume`, as
        it was at the END of the resumed iteration (after the loop's ``sched.step()`` / ``scaler.update()``).

        Anything with ``state_dict()`` / ``load_state_dict()``: LR schedulers, a ``torch.amp.GradScaler`` (whose
        skipped steps then count as iterations), a :class:`lowdiff.data.ResumableLoader`, counters. The state may
        hold numbers, strings, lists, tuples, dicts, Counters and one-element tensors (``UnsupportedError``
        otherwise, saying what to do). ``at``: when the state is taken, ``"end"`` (when the iteration ends) or
        ``"step"`` (inside ``opt.step()``: right for data loaders, which hand out the next batch before the next
        step); ``"auto"`` picks ``"step"`` for iterables, else ``"end"``. Call before ``resume()``, once per name;
        returns ``obj``. Under DDP every rank must track the same names with the same state."""
        if self._loop.step > 0:
            raise LowDiffError(f"opt.track({name!r}) must come before opt.resume() and the first step")
        self._tracker.add(obj, name, at)
        if is_grad_scaler(obj):
            hook_scaler_update(self._scaler_update, obj)
        return obj

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def _open_run_dir(self, run_dir: RunDir) -> None:
        assert self._checkpointer is not None
        run_dir.wait_for_persistence(leader=self._leader)  # an earlier trainer's persistence processes, committing
        if self._leader:
            run_dir.open()
        self._coord.barrier("open run directory")  # no rank starts persistence processes before every rank waited
        if run_dir.has_run():
            run_dir.check_compatible(self._spec.manifest)
            fsdp.adopt(run_dir, self._spec, self._coord, self._sharded, self._leader)
            self._loop.needs_resume = True
            return
        # A new run: the step-0 snapshot (every rank's shard) first, the manifest last: it commits the run. Every
        # file names the run: rank 0 draws the id, every rank stamps it (docs/reference/FORMAT.md section 2).
        run_dir.new_run(self._spec.manifest, self._coord.broadcast_ints)
        self._stager.remember_buffers()
        state0 = self._stager.snapshot(0).wait()
        run_dir.write_snapshot(state0, resolve_codec(self.config.log.codec, self.config.compressor.name))
        self._coord.barrier("snapshot 0")
        if self._leader:
            run_dir.commit_manifest(self._spec.manifest)
        self._coord.barrier("manifest")
        self._checkpointer.start(durable_step=0, shadow=self._make_shadow(state0))
        self._step0 = self._fingerprint()

    def _fingerprint(self) -> tuple[Any, ...]:
        """What snapshot 0 holds, cheaply (lowdiff._training.step_zero): this rank's parameters, the optimizer's state
        and groups."""
        owned = self._stager.owned
        tensors = [fsdp.local(p) for n, p in self._spec.params.items() if n in owned]
        tensors += [v for st in self.inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return fingerprint(tensors, encode_groups(self.inner.param_groups))

    def _settle_step0(self) -> None:
        """The first step of this run in this process: write snapshot 0 again if what it holds has changed since
        (weights or an optimizer state loaded after wrap(), a scheduler created on the wrapper;
        lowdiff._training.step_zero)."""
        before, self._step0 = self._step0, None
        if before is not REWRITE and before == self._fingerprint():
            return
        assert self._checkpointer is not None and self._run_dir is not None
        state = self._stager.snapshot(0).wait()
        if state.buffers:
            # This step's forward pass may have changed them already; snapshot 0 keeps the values the changed
            # buffers of step 1's record are found against (a buffer set after wrap() is in that record).
            state.buffers = self._stager.buffer_baseline()
        self._run_dir.write_snapshot(state, resolve_codec(self.config.log.codec, self.config.compressor.name))
        if before is REWRITE:  # every rank resumed at step 0, so every rank is here
            self._coord.barrier("snapshot 0 written again")
            if self._leader:
                # Written by another number of ranks, the old snapshot 0 is a set of its own, which recovery would
                # list first (fewer files) and then refuse (the branch owns step 0 from here): moved aside.
                self._run_dir.quarantine_snapshot_sets(0, keep_count=self._coord.world_size)
                self._run_dir.own_step_zero()
        log.info("lowdiff: %s; snapshot 0 of %s written again with the state the first step starts from",
                 "resumed at step 0" if before is REWRITE else "parameters, optimizer state or groups changed "
                 "between wrap() and the first step", self._run_dir.path)
        if self.config.snapshot.shadow:
            self._checkpointer.restart(self._make_shadow(state))

    def resume(self, at: str = "latest") -> int:
        """Restore model, optimizer, compressor, tracked objects and RNG state to the end of a logged iteration and
        return its number (0 when the run directory is new): the next ``step()`` belongs to iteration
        ``start + 1``. ``at="latest"``: the latest durable iteration; ``at="snapshot"``: the newest snapshot
        step, where Top-k's and PowerSGD's error-feedback memory is exact too (the loop then redoes the iterations
        after it, bit for bit). Call once, before the first ``step``."""
        if not self._loop.needs_resume:
            return self._loop.step
        assert self._checkpointer is not None and self._run_dir is not None
        run_dir = self._run_dir.path
        device = str(next(iter(self._spec.params.values())).device) if self._spec.params else "cpu"
        world = self._coord.world_size
        # Every rank resumes at once: parallel replay inside each rank would oversubscribe the node's cores.
        rec = recover_for_resume(run_dir, at, device=device, workers=1 if world > 1 else None,
                                 rank=self._coord.rank if world > 1 else None,
                                 shard=(self._coord.rank, world) if self._sharded is not None else None,
                                 optimizer_class=replay_class(self.inner))
        if rec.step == 0:
            # Nothing was trained: the live state is where the run was, pretrained weights loaded after wrap()
            # included, which snapshot 0 may predate; it is written again at the first step (step_zero.py).
            self._step0 = REWRITE
        elif self._sharded is not None:
            fsdp.load_state(rec, self._spec, self._sharded, self.inner)
        else:
            self.model.load_state_dict(rec.model)
            self.inner.load_state_dict(rec.optimizer)
        if rec.step > 0:
            apply_end_groups(self.inner.param_groups, rec.end_groups)
            self.compressor.load_state_dict(
                compressor_state(rec, self.compressor, world, self._spec.params) if self._sharded is None
                else fsdp.compressor_state(rec, self._spec, self._sharded, rec.world_size))
        for s in rec.report.skipped:
            log.warning("lowdiff: resume skipped %s", s)
        self._coord.barrier("recovered")
        if self._leader:
            self._run_dir.quarantine_beyond(rec.step)
        # Files from here on are of a new branch of the run's history: a file the resume moved aside and someone
        # puts back is refused (lowdiff._storage.history), even where no file of this branch holds its steps.
        self._run_dir.start_branch(rec.step, self._coord.broadcast_ints, commit=self._leader)
        self._coord.barrier("quarantined")
        self._loop.step = rec.step
        self._loop.stepped = False
        self._stager.remember_buffers()
        self._loop.needs_resume = False
        shadow = self._make_shadow(self._stager.snapshot(rec.step).wait()) if self.config.snapshot.shadow else None
        self._checkpointer.start(durable_step=rec.step, shadow=shadow)
        # Last, so nothing above draws from the restored generators: the next forward starts from them.
        self._tracker.restore(rec.data, rec.step, end_known=rec.end_groups is not None)
        rng_state.restore_at_resume(rec.rng, rng_state.current_rank(), rec.step)
        lifecycle.several_at_resume(self)
        if fsdp.changes_layout(self._run_dir.read_manifest(), rec.world_size, self._sharded):
            data = {**self._tracker.state(AT_STEP)[0], **self._tracker.state(AT_END)[0]}
            fsdp.rebase(self._stager.snapshot(rec.step, data), self._run_dir, self._coord, self.inner.param_groups,
                        resolve_codec(self.config.log.codec, self.config.compressor.name))
        if self._writes is not None and rec.step > 0:
            self._writes.arm(rec.step)  # weights loaded after a resume at step 0: a fresh run's (step_zero.py)
        log.info("lowdiff: resumed %s at step %d (%s)", run_dir, rec.step, rec.report.summary().splitlines()[0])
        return rec.step

    def flush(self) -> int:
        """End the iteration in progress (call it after the loop's last change to tracked objects) and commit
        every logged step; returns the newest durable step."""
        if self._iteration is not None:
            self._iteration.seal()
        return self._checkpointer.flush() if self._checkpointer else self._loop.step

    def capture_rng(self) -> None:
        """Take the RNG state for the iteration in progress again, now: call it after random draws that come
        between ``opt.step()`` and the next iteration's forward pass and that a resumed run does not repeat (an
        evaluation between two steps: iterating a DataLoader draws its seed from torch's generator). A resume then
        continues from the state after them, as the uninterrupted run did. ``LowDiffCallback`` calls it after each
        validation inside a Lightning fit. No effect before the first step or after ``flush()``."""
        if self._iteration is not None and self._checkpointer is not None:
            self._iteration.retake_rng(self._stager.rng())

    @property
    def durable_step(self) -> int:
        """The newest step guaranteed to be on disk."""
        return self._checkpointer.durable_step if self._checkpointer else 0

    @property
    def stats(self) -> CheckpointStats | None:
        """A reading of the checkpointer's counters: steps and bytes committed, time written and blocked, queue
        depth, the snapshot interval and batch size in force, the tuner's decisions (None with
        ``enabled: false``): ``opt.stats.durable_step``, ``.steps_committed``, ``.blocked_s``."""
        if self._checkpointer is None:
            return None
        lw = self._stager.layerwise
        return dataclasses.replace(
            self._checkpointer.stats(), host_buffers_reused=self._stager.reused,
            snapshot_buffers_reused=self._stager.snapshots_reused,
            layerwise=LayerwiseStats(lw.hits, lw.misses, lw.active) if lw is not None else None)

    def close(self, interrupted: bool = False) -> None:
        """End the iteration in progress, flush and release the run directory; everything logged is durable when it
        returns. ``interrupted=True`` (an exception stopped the loop mid-iteration): that iteration is not logged,
        since what it left in tracked objects is unknown; a resume redoes it."""
        if self._loop.closed:
            return
        self._loop.closed = True
        OPEN.discard(self)
        if self._checkpointer is not None:
            self._stager.settle_snapshot()  # a copy still running must not outlive the buffers close gives back
            # detach(), not self._release(): a finalizer called after weakref's own exit hook (registered when
            # the process's first finalize was made, possibly after ours) does nothing.
            if self._release.detach() is not None:
                release(self._checkpointer, self._stager.layerwise, self._iteration, interrupted)
            self._stager.copier.close()
        elif self._stager.layerwise is not None:
            self._stager.layerwise.remove()

    def __enter__(self) -> LowDiffOptimizer:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(interrupted=exc_type is not None)

    # -- the step ------------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Compress (if configured) -> decode into ``.grad`` -> inner step -> log the step.

        ``closure`` (Lightning passes one): run once, with gradients enabled, before the step (it computes the loss
        and the gradients); its value is returned."""
        self._check_usable()
        lifecycle.guard_sigint()
        if self._writes is not None:
            self._writes.check(self._loop.step + 1)
        if self._hooks is not None:
            self._hooks.check(self._loop.step + 1)
        if self._step0 is not None:
            self._settle_step0()
        if self._iteration is not None:
            self._iteration.seal()  # the previous iteration ended: this one has reached its step
            self._report_backpressure(self._loop.step)
        # Pre-hooks run where torch runs them, before the closure, and before the gradient is compressed and logged:
        # what a hook leaves in .grad is what the log holds.
        for pre in list(self._optimizer_step_pre_hooks.values()):
            pre(self, (), {})
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._checkpointer is not None:
            self._checkpointer.check()
            # The last snapshot's copy ran beside the forward and backward passes; the compressor and the inner
            # step change what it reads. Time spent waiting for it here is reported as waiting for the writer.
            self._checkpointer.waited(self._stager.settle_snapshot())
        t_apply = time.perf_counter()
        aggregated = self._hook.take() if self._hook is not None else None
        grads, payloads = self._payloads(aggregated)
        ckpt = self._checkpointer
        copies, stage_s, data = None, 0.0, {}
        if ckpt is not None:
            data = self._step_state()  # before anything changes: a state that cannot be logged stops the step here
            # Queued before the inner step, so on a GPU the copies to host memory overlap the optimizer's kernels.
            t_stage = time.perf_counter()
            copies = self._stager.copy_step(grads, ckpt.slots, payloads)
            stage_s = time.perf_counter() - t_stage
        groups = encode_groups(self.inner.param_groups)
        out = self.inner.step()
        # compress + decode + inner step, staging excluded: the tuner's estimate of one replayed step.
        apply_s = time.perf_counter() - t_apply - stage_s
        step = self._loop.step + 1
        self._loop.step = step
        self._loop.stepped = True
        if ckpt is not None and copies is not None:
            self._hold(self._stager.finish_step(copies, step, groups, data), apply_s)
        if self._writes is not None:
            self._writes.arm(step)
        # After the watch is armed: a post-hook that writes parameters (a weight constraint) is reported at the next
        # step, since no replay runs it.
        for post in list(self._optimizer_step_post_hooks.values()):
            post(self, (), {})
        lifecycle.raise_deferred_interrupt()  # a Ctrl-C that came during this step: raised now that it is logged
        return loss if closure is not None else out

    def _payloads(self, aggregated: dict[str, Payload] | None
                  ) -> tuple[dict[str, dict[str, torch.Tensor]], StepPayloads | None]:
        """Every gradient's payload, compressed here (or by DDP's communication hook: ``aggregated``) and decoded
        into ``.grad``. Returns the payloads of the parameters this rank logs, and where the compressor wrote them
        if it wrote them all into its reused buffers (lowdiff._compressors.base.StepPayloads)."""
        grads: dict[str, dict[str, torch.Tensor]] = {}
        if aggregated is None:
            self.compressor.begin_step()
        try:
            with torch.no_grad():
                for name, p in self._spec.optimized:
                    g = fsdp.local(p.grad)
                    if g is None:
                        continue
                    if g.is_sparse:
                        raise UnsupportedError(f"parameter {name!r} has a sparse gradient; lowdiff logs dense ones")
                    if aggregated is not None:
                        payload = aggregated.get(name)
                        if payload is None:
                            raise LowDiffError(f"parameter {name!r} has a gradient DDP's communication hook did not "
                                               "aggregate this step (accumulating outside no_sync()?)")
                    else:
                        payload, decoded = self.compressor.compress_decode(name, g)
                        if not same_tensor(decoded, g):
                            fsdp.set_grad(p, g, decoded)
                    if name in self._owned_log:
                        grads[name] = payload
        finally:
            payloads = self.compressor.end_step() if aggregated is None else None
        return grads, payloads

    def _check_usable(self) -> None:
        if self._loop.closed:
            raise LowDiffError("step() after close(): wrap the optimizer again to continue")
        if self._loop.needs_resume:
            raise LowDiffError(f"{self.config.run_dir} already holds a run; call opt.resume() before training, "
                               "or use a new run_dir")

    def _step_state(self) -> dict[str, Any]:
        data, errors = self._tracker.state(AT_STEP)
        if errors:
            raise UnsupportedError(errors[0])
        return data

    def _hold(self, record: Any, apply_s: float | None) -> None:
        """Keep ``record`` (and the snapshot, at a snapshot step) until its iteration ends (iteration.py)."""
        assert self._checkpointer is not None and self._iteration is not None
        step = record.item.step
        snapshot, block_s = None, 0.0
        if self._checkpointer.needs_capture(step):
            t_snap = time.perf_counter()
            try:
                snapshot = self._stager.snapshot(step, record.item.data, self._checkpointer.slots)
            except BaseException:
                # Ctrl-C while it waited for the previous snapshot, a state_dict() that raised: the inner step is
                # applied, so its record is still held and logged (without this snapshot), then the error goes on.
                self._iteration.hold(Pending(record, None, 0.0, apply_s))
                raise
            block_s = time.perf_counter() - t_snap
        self._iteration.hold(Pending(record, snapshot, block_s, apply_s))

    def _scaler_update(self, update: Callable[[Any], Any], new_scale: Any) -> Any:
        """A tracked GradScaler's ``update()``. In an iteration without an optimizer step (the scaler found inf or
        NaN gradients) the previous iteration has ended before it, and this one is logged as a step without
        gradients, so step numbers count iterations."""
        if self._loop.stepped:
            out = update(new_scale)
            self._loop.stepped = False
            return out
        self._check_usable()
        if self._step0 is not None:
            self._settle_step0()
        if self._iteration is not None:
            self._iteration.seal()
        data = self._step_state() if self._checkpointer is not None else {}
        out = update(new_scale)
        if self._hook is not None:
            self._hook.take()  # the skipped iteration's payloads: never consumed
        step = self._loop.step + 1
        if self._checkpointer is not None:
            copies = self._stager.copy_step({})  # only the buffers its forward pass changed
            groups = encode_groups(self.inner.param_groups)
            self._hold(self._stager.finish_step(copies, step, groups, data, skipped=True), None)
        self._loop.step = step
        return out

    def _report_backpressure(self, step: int) -> None:
        assert self._checkpointer is not None
        self._loop.blocked_reported = self._checkpointer.report_backpressure(
            step, self._loop.blocked_reported, self.config.log.backpressure_warn_s)

    def _make_shadow(self, state: SnapshotState) -> ShadowReplica | None:
        if not self.config.snapshot.shadow:
            return None
        return make_shadow(self._spec, state, type(self.inner), world_size=self._coord.world_size)


def wrap(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
         config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> LowDiffOptimizer:
    """Wrap ``optimizer`` so every step is logged as a differential checkpoint.

    >>> opt = lowdiff.wrap(torch.optim.AdamW(model.parameters()), model, "lowdiff.yaml")  # doctest: +SKIP
    >>> start = opt.resume()                                                              # doctest: +SKIP
    """
    return LowDiffOptimizer(optimizer, model, load_config(config))
