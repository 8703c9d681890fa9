"""The optimizer wrapper: compress -> decode -> inner step -> hand the step's record to the checkpointer."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lowdiff import rng as rng_state
from lowdiff.capture import LayerwiseCapture
from lowdiff.checkpointer import Checkpointer, CheckpointStats, LayerwiseStats, make_policy
from lowdiff.compressors import make_compressor
from lowdiff.config import Config, load_config, resolve_codec
from lowdiff.data import restore_positions
from lowdiff.distributed import Coordinator, HookState, ProcessGroupComm, is_ddp, lowdiff_comm_hook
from lowdiff.errors import LowDiffError, UnsupportedError
from lowdiff.model_spec import describe, unwrap_model
from lowdiff.recovery import recover
from lowdiff.shadow import ShadowReplica
from lowdiff.stager import Stager, encode_groups
from lowdiff.staging import HostCopier
from lowdiff.storage.format import Shard, encode_value
from lowdiff.storage.run_dir import RunDir
from lowdiff.storage.sharding import partition_by_size
from lowdiff.storage.snapshot import SnapshotState

log = logging.getLogger(__name__)

class LowDiffOptimizer:
    """Drop-in for the wrapped optimizer: ``step``, ``zero_grad``, ``param_groups`` and ``state`` behave as the
    inner optimizer's; every ``step`` is also logged. Build it with :func:`lowdiff.wrap`."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, config: Config) -> None:
        if isinstance(optimizer, LowDiffOptimizer):
            raise LowDiffError("this optimizer is already wrapped by lowdiff")
        self.inner = optimizer
        self.model = unwrap_model(model)
        self.config = config
        self._spec = describe(self.model, optimizer, config)
        cc = config.compressor
        self.compressor = make_compressor(cc.name, ratio=cc.ratio, rank=cc.rank, error_feedback=cc.error_feedback)
        self._coord = Coordinator(is_ddp(model))
        self._hook: HookState | None = None
        if is_ddp(model):
            names = {id(p): n for n, p in self._spec.params.items()}
            self._hook = HookState(self.compressor, names, ProcessGroupComm())
            try:
                model.register_comm_hook(self._hook, lowdiff_comm_hook)  # type: ignore[operator]
            except RuntimeError as e:
                raise LowDiffError(f"cannot install lowdiff's DDP communication hook ({e}); lowdiff brings its own "
                                   "compression hook: do not register another one") from e
        self._owned = self._owned_names(self._state_nbytes)
        self._owned_log = self._owned_names(self._payload_nbytes)
        self._leader = self._coord.rank == 0
        self._step = 0
        self._closed = False
        self._needs_resume = False
        self._tracked: dict[str, Any] = {}
        self._blocked_reported = 0.0  # back-pressure already reported, seconds
        copier = HostCopier(self._spec.params.values())
        layerwise: LayerwiseCapture | None = None
        if config.enabled and cc.name == "none" and self._hook is None and _wants_layerwise(config):
            layerwise = LayerwiseCapture([(n, p) for n, p in self._spec.optimized if n in self._owned_log], copier,
                                         bucket_bytes=config.log.capture_bucket_bytes)
        self._stager = Stager(self._spec, optimizer, self.compressor, copier=copier, owned=self._owned,
                              leader=self._leader, tracked=self._tracked, layerwise=layerwise)
        self._run_dir: RunDir | None = None
        self._checkpointer: Checkpointer | None = None
        if config.enabled:
            run_dir = RunDir(config.run_dir, Shard(self._coord.rank, self._coord.world_size),
                             compressor_params={"ratio": cc.ratio, "rank": cc.rank})
            self._run_dir = run_dir
            try:
                policy = make_policy(config, run_dir, self._coord,
                                     _record_bytes_bound(self._spec.optimized, cc))
                self._checkpointer = Checkpointer(config, run_dir, policy)
                self._open_run_dir(run_dir)
            except BaseException:
                run_dir.release()  # a failed wrap must not keep the run directory locked
                if layerwise is not None:
                    layerwise.remove()  # nor its hooks on the model's parameters
                raise
            # close() at interpreter exit, or when the wrapper is garbage-collected unclosed: a script that ends
            # without close() would otherwise lose the steps of its last partial segment, and the writer thread
            # (a daemon) could be torn down in the middle of a write ("terminate called without an active
            # exception", exit status 134). Holds the checkpointer and the hooks, never the wrapper itself.
            self._release = weakref.finalize(self, _release, self._checkpointer, layerwise)
            self._release.atexit = False  # _close_at_exit runs it, before h5py's own exit handler
            _OPEN.add(self)

    # -- the torch.optim.Optimizer surface -----------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise UnsupportedError("load optimizer state before lowdiff.wrap(), or restore a lowdiff run with "
                               "opt.resume(); changing it under the log would make replay wrong")

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise UnsupportedError("add parameter groups before lowdiff.wrap(): the run directory records the groups")

    @property
    def step_count(self) -> int:
        """Optimizer steps taken: the state now is step ``step_count``."""
        return self._step

    def track(self, obj: Any, name: str = "data") -> Any:
        """Log ``obj.state_dict()`` (a small JSON dict, e.g. a :class:`lowdiff.data.ResumableLoader`'s
        ``{"epoch", "seed", "offset"}``) with every step, and restore it with ``load_state_dict`` in
        :meth:`resume`. Call before ``resume()``; returns ``obj``. Under DDP every rank must track the same
        names with the same state (lowdiff.data's distributed sampler counts samples of all ranks)."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"opt.track() needs an object with state_dict() and load_state_dict(), got "
                            f"{type(obj).__name__}")
        if self._step > 0 or name in self._tracked:
            raise LowDiffError(f"opt.track({name!r}) must come before opt.resume() and the first step, once per name")
        try:
            encode_value(obj.state_dict())
        except TypeError as e:
            raise UnsupportedError(f"the state of tracked {name!r} cannot be logged as JSON: {e}") from e
        self._tracked[name] = obj
        return obj

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def _open_run_dir(self, run_dir: RunDir) -> None:
        assert self._checkpointer is not None
        if self._leader:
            run_dir.open()
        self._coord.barrier("open run directory")
        if run_dir.has_run():
            run_dir.check_compatible(self._spec.manifest)
            self._needs_resume = True
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

    def resume(self) -> int:
        """Restore model, optimizer and compressor to the run's latest durable step and return it (0 when the
        run directory is new). Call once, before the first ``step``."""
        if not self._needs_resume:
            return self._step
        assert self._checkpointer is not None and self._run_dir is not None
        run_dir = self._run_dir.path
        device = str(next(iter(self._spec.params.values())).device) if self._spec.params else "cpu"
        # Every rank resumes at once: parallel replay inside each rank would oversubscribe the node's cores.
        rec = recover(run_dir, device=device, workers=1 if self._coord.world_size > 1 else None)
        self.model.load_state_dict(rec.model)
        self.inner.load_state_dict(rec.optimizer)
        if rec.compressor_state_exact:
            self.compressor.load_state_dict(self._on_param_devices(rec.compressor_state))
        else:
            # Residuals cannot be rebuilt from the log: they restart at zero. PowerSGD's warm-start Q is in
            # the log, so it continues exactly. (docs/reference/FORMAT.md, "Resuming between snapshots")
            self.compressor.load_state_dict(self._on_param_devices(rec.compressor_state))
            log.info("lowdiff: resumed at step %d between snapshots; error-feedback residuals restart at zero",
                     rec.step)
        for s in rec.report.skipped:
            log.warning("lowdiff: resume skipped %s", s)
        self._coord.barrier("recovered")
        if self._leader:
            self._run_dir.quarantine_beyond(rec.step)
        self._coord.barrier("quarantined")
        self._step = rec.step
        self._stager.remember_buffers()
        self._needs_resume = False
        shadow = self._make_shadow(self._stager.snapshot(rec.step).wait()) if self.config.snapshot.shadow else None
        self._checkpointer.start(durable_step=rec.step, shadow=shadow)
        # Last, so nothing above draws from the restored generators: the next forward starts from them.
        restore_positions(self._tracked, rec.data, rec.step)
        rng_state.restore_at_resume(rec.rng, rng_state.current_rank(), rec.step)
        log.info("lowdiff: resumed %s at step %d (%s)", run_dir, rec.step, rec.report.summary().splitlines()[0])
        return rec.step

    def flush(self) -> int:
        """Commit every logged step; returns the newest durable step."""
        return self._checkpointer.flush() if self._checkpointer else self._step

    @property
    def durable_step(self) -> int:
        """The newest step guaranteed to be on disk."""
        return self._checkpointer.durable_step if self._checkpointer else 0

    @property
    def stats(self) -> CheckpointStats | None:
        """A reading of the checkpointer's counters: steps and bytes committed, time written and blocked, queue
        depth, the snapshot interval and batch size in force, the tuner's decisions (None with
        ``enabled: false``).

        >>> st = opt.stats                                              # doctest: +SKIP
        >>> st.durable_step, st.steps_committed, st.blocked_s          # doctest: +SKIP
        """
        if self._checkpointer is None:
            return None
        lw = self._stager.layerwise
        return dataclasses.replace(
            self._checkpointer.stats(), host_buffers_reused=self._stager.reused,
            snapshot_buffers_reused=self._stager.snapshots_reused,
            layerwise=LayerwiseStats(lw.hits, lw.misses, lw.active) if lw is not None else None)

    def close(self) -> None:
        """Flush and release the run directory; everything logged is durable when it returns."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if self._checkpointer is not None:
            # detach(), not self._release(): a finalizer called after weakref's own exit hook (registered when
            # the process's first finalize was made, possibly after ours) does nothing.
            if self._release.detach() is not None:
                _release(self._checkpointer, self._stager.layerwise)
        elif self._stager.layerwise is not None:
            self._stager.layerwise.remove()

    def __enter__(self) -> LowDiffOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step ------------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Compress (if configured) -> decode into ``.grad`` -> inner step -> log the step."""
        if closure is not None:
            raise UnsupportedError("closure-based optimizers (e.g. LBFGS) re-evaluate the loss inside step and "
                                   "cannot be replayed from a gradient log")
        if self._closed:
            raise LowDiffError("step() after close(): wrap the optimizer again to continue")
        if self._needs_resume:
            raise LowDiffError(f"{self.config.run_dir} already holds a run; call opt.resume() before training, "
                               "or use a new run_dir")
        if self._checkpointer is not None:
            self._checkpointer.check()
        t_apply = time.perf_counter()
        aggregated = self._hook.take() if self._hook is not None else None
        grads: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for name, p in self._spec.optimized:
                g = p.grad
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
                    if not _same_tensor(decoded, g):
                        p.grad = decoded
                if name in self._owned_log:
                    grads[name] = payload
        ckpt = self._checkpointer
        copies, stage_s = None, 0.0
        if ckpt is not None:
            # Queued before the inner step, so on a GPU the copies to host memory overlap the optimizer's kernels.
            t_stage = time.perf_counter()
            copies = self._stager.copy_step(grads)
            stage_s = time.perf_counter() - t_stage
        groups = encode_groups(self.inner.param_groups)
        out = self.inner.step()
        # compress + decode + inner step, staging excluded: the tuner's estimate of one replayed step.
        apply_s = time.perf_counter() - t_apply - stage_s
        step = self._step + 1
        self._step = step
        if ckpt is not None and copies is not None:
            record = self._stager.finish_step(copies, step, groups)
            snapshot, block_s = None, 0.0
            if ckpt.needs_capture(step):
                t_snap = time.perf_counter()
                snapshot = self._stager.snapshot(step)
                block_s = time.perf_counter() - t_snap
            ckpt.on_step(record, snapshot=snapshot, snapshot_block_s=block_s, apply_s=apply_s)
            self._report_backpressure(step)
        return out

    def _report_backpressure(self, step: int) -> None:
        """Warn when training has waited for the writer (the disk is slower than the log grows), at most once
        per ``log.backpressure_warn_s`` of added waiting."""
        assert self._checkpointer is not None
        st = self._checkpointer.writer_stats
        if st.blocked_s - self._blocked_reported < self.config.log.backpressure_warn_s:
            return
        self._blocked_reported = st.blocked_s
        mb_s = st.log_bytes / st.write_s / 1e6 if st.write_s > 0 else 0.0
        log.warning("lowdiff: training has waited %.1f s in all for the checkpoint writer by step %d: the log grows "
                    "faster than the disk takes it (writer: %.0f MB/s). Use a compressor, a faster disk, or larger "
                    "steps (more tokens per step); nothing is lost meanwhile", st.blocked_s, step, mb_s)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _make_shadow(self, state: SnapshotState) -> ShadowReplica | None:
        if not self.config.snapshot.shadow:
            return None
        if self._coord.world_size > 1:
            raise UnsupportedError("snapshot.shadow is not supported with DDP yet; use the default snapshots")
        if any(p.device.type != "cpu" for p in self._spec.params.values()):
            raise UnsupportedError("snapshot.shadow is bit-exact only when training on the CPU (a CPU replica of "
                                   "GPU training drifts in the last bits); turn it off on GPUs")
        return ShadowReplica(self._spec.manifest, state, type(self.inner))

    def _on_param_devices(self, state: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Compressor state moved to the device of the parameter it belongs to (under DDP, each rank's own)."""
        params = self._spec.params
        return {n: {k: v.to(params[n].device) if n in params else v for k, v in st.items()}
                for n, st in state.items()}

    def _state_nbytes(self, p: torch.Tensor) -> int:
        return p.numel() * p.element_size()

    def _payload_nbytes(self, p: torch.Tensor) -> int:
        return self.compressor.payload_nbytes(tuple(p.shape), p.element_size())

    def _owned_names(self, size_of: Callable[[torch.Tensor], int]) -> set[str]:
        """Parameter names this rank persists, a share balanced by ``size_of`` (snapshots: tensor bytes; log:
        the compressor's payload bytes, which are not proportional to them); rank 0 also keeps the parameters
        no optimizer group holds (buffers are rank 0's too)."""
        all_names = set(self._spec.params)
        if self._coord.world_size == 1:
            return all_names
        sizes = {n: size_of(p) for n, p in self._spec.optimized}
        owned = set(partition_by_size(sizes, self._coord.world_size)[self._coord.rank])
        if self._coord.rank == 0:
            owned |= all_names - set(sizes)
        return owned

_OPEN: weakref.WeakSet[LowDiffOptimizer] = weakref.WeakSet()
"""Wrappers with a run directory, not closed yet."""


@atexit.register  # after h5py's import (lowdiff.storage), so it runs before h5py's exit handler
def _close_at_exit() -> None:
    for opt in list(_OPEN):
        try:
            opt.close()
        except Exception as e:  # one failure must not keep the others open
            log.error("lowdiff: closing %s at interpreter exit failed: %s", opt.config.run_dir, e)


def _release(checkpointer: Checkpointer, layerwise: LayerwiseCapture | None) -> None:
    """What close() does: remove the capture hooks, flush the log and release the run directory."""
    if checkpointer.on_writer_thread():
        # A garbage collection the writer thread happened to run: a flush there would wait for that very thread.
        threading.Thread(target=_close, args=(checkpointer, layerwise), name="lowdiff-close").start()
        return
    _close(checkpointer, layerwise)


def _close(checkpointer: Checkpointer, layerwise: LayerwiseCapture | None) -> None:
    if layerwise is not None:
        layerwise.remove()
    checkpointer.close()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b`` or a same-shaped view of the same memory (the identity compressor's decode)."""
    return a is b or (a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def _record_bytes_bound(optimized: Any, cc: Any) -> float | None:
    """An upper bound on one step's record before any is seen, the same on every rank (the tuner caps its
    bootstrap batch with it): the dense gradient for compressor none, values plus indices (int64 at most) of the
    kept fraction for Top-k; None for PowerSGD (small factors: the bootstrap batch stands)."""
    dense = sum(p.numel() * p.element_size() for _, p in optimized)
    if cc.name == "none":
        return float(dense)
    if cc.name == "topk":
        return dense * float(cc.ratio) * 3.0  # 4-byte value + up to 8-byte index per kept element of 4 bytes
    return None


def _wants_layerwise(config: Config) -> bool:
    # auto = step: on the CPU a hook's copy overlaps nothing, and on an H100 the step-time staging (itself
    # overlapping inner.step) measured as fast or faster (docs/reference/design.md).
    return config.log.capture == "layerwise"


def wrap(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
         config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> LowDiffOptimizer:
    """Wrap ``optimizer`` so every step is logged as a differential checkpoint.

    >>> opt = lowdiff.wrap(torch.optim.AdamW(model.parameters()), model, "lowdiff.yaml")  # doctest: +SKIP
    >>> start = opt.resume()                                                              # doctest: +SKIP
    """
    return LowDiffOptimizer(optimizer, model, load_config(config))
