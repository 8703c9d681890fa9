"""What ``lowdiff.wrap()`` builds and opens: the collaborators of one wrapped optimizer (:class:`Run`), the run
directory opened or created (a new run: snapshot 0, then the manifest), and snapshot 0 kept true until the first
step (lowdiff/_training/step_zero.py). The step itself is lowdiff/_training/optimizer.py; resuming is resume.py.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from lowdiff._compressors import make_compressor
from lowdiff._persist.checkpointer import Checkpointer, make_policy
from lowdiff._persist.coordinator import Coordinator, owned_names
from lowdiff._persist.shadow import ShadowReplica, make_shadow
from lowdiff._storage.format import Shard, encode_groups, list_snapshots
from lowdiff._storage.run_dir import RunDir
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._training import fsdp, lifecycle
from lowdiff._training.capture import LayerwiseCapture
from lowdiff._training.ddp import HookState, ProcessGroupComm, lowdiff_comm_hook
from lowdiff._training.iteration import IterationEnd, Tracker
from lowdiff._training.lifecycle import record_bytes_bound, wants_layerwise
from lowdiff._training.model_spec import describe, wrapper_chain
from lowdiff._training.param_writes import HookWatch, WriteWatch
from lowdiff._training.stager import Stager
from lowdiff._training.step_zero import REWRITE, fingerprint
from lowdiff._transfer.host_copies import HostCopier
from lowdiff.config import Config, resolve_codec
from lowdiff.errors import LowDiffError

log = logging.getLogger("lowdiff._training.optimizer")


@dataclasses.dataclass
class LoopState:
    """The wrapper's mutable state, in one object: shallow copies of the wrapper (Lightning's LightningOptimizer
    copies its ``__dict__``) then see the same values."""

    step: int = 0
    """The last logged iteration: optimizer steps plus iterations a tracked GradScaler skipped."""
    closed: bool = False
    needs_resume: bool = False
    stepped: bool = False
    """Whether the current iteration has run its optimizer step (reset by a tracked GradScaler's update())."""
    step0: Any = None
    """Until the first step: what snapshot 0 holds (lowdiff._training.step_zero), or REWRITE."""
    memory_step: int | None = None
    """The step the compressor's memory is the memory after (None: it has moved since a logged step, or nothing
    was trained in this process)."""


class Run:
    """One wrapped optimizer's collaborators: the model's description, the compressor, the distributed glue, the
    stager, the guards, and (``enabled: true``) the locked run directory, its checkpointer and the iteration's end.
    Building it opens the run directory; a failure releases it again."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, config: Config) -> None:
        self.inner = optimizer
        self.config = config
        self.loop = LoopState()
        chain = wrapper_chain(model)
        self.model = chain[-1]
        # Also inside torch.compile(DDP(model)).
        ddp = next((m for m in chain if isinstance(m, torch.nn.parallel.DistributedDataParallel)), None)
        self.spec = describe(self.model, optimizer, config)
        cc = config.compressor
        self.compressor = make_compressor(cc.name, ratio=cc.ratio, rank=cc.rank, error_feedback=cc.error_feedback)
        self.compressor.check_params(self.spec.params)
        self.sharded: fsdp.Sharded | None = None
        self.coord = Coordinator(ddp is not None or fsdp.is_fsdp(self.model))
        if fsdp.is_fsdp(self.model):  # each rank logs and snapshots its own shards (lowdiff/_training/fsdp.py)
            fsdp.check_config(config)
            self.spec, self.sharded = fsdp.shard_spec(self.spec, optimizer, self.coord.rank, self.coord.world_size)
        self.hook: HookState | None = None
        if ddp is not None:
            names = {id(p): n for n, p in self.spec.params.items()}
            self.hook = HookState(self.compressor, names, ProcessGroupComm())
            try:
                ddp.register_comm_hook(self.hook, lowdiff_comm_hook)
            except RuntimeError as e:
                raise LowDiffError(f"cannot install lowdiff's DDP communication hook ({e}); lowdiff brings its own "
                                   "compression hook: do not register another one") from e
        # This rank's share of what is persisted: snapshots balanced by tensor bytes, the log by payload bytes.
        owned = owned_names(self.spec, self.coord, lambda p: p.numel() * p.element_size(), self.sharded)
        self.owned_log = owned_names(self.spec, self.coord, lambda p: self.compressor.payload_nbytes(
            tuple(p.shape), p.element_size()), self.sharded)
        self.leader = self.coord.rank == 0
        self.tracker = Tracker()
        copier = HostCopier(self.spec.params.values())
        layerwise: LayerwiseCapture | None = None
        if config.enabled and cc.name == "none" and self.hook is None and wants_layerwise(config):
            layerwise = LayerwiseCapture([(n, p) for n, p in self.spec.optimized if n in self.owned_log], copier,
                                         bucket_bytes=config.log.capture_bucket_bytes)
        self.stager = Stager(self.spec, optimizer, self.compressor, copier=copier, owned=owned,
                             leader=self.leader, per_rank=self.coord.world_size > 1 and self.sharded is None,
                             layerwise=layerwise, copy_thread=config.snapshot.background_copy and self.hook is None)
        # Writes to parameters and their optimizer state between steps, which no replay repeats
        # (lowdiff._training.param_writes). Not under fully_shard: its sharded parameters are DTensors, whose own
        # version counter does not follow their local shards.
        self.writes = WriteWatch(self.spec.params, optimizer) if config.enabled and self.sharded is None else None
        self.hooks = HookWatch(optimizer) if config.enabled else None
        self.run_dir: RunDir | None = None
        self.checkpointer: Checkpointer | None = None
        self.iteration: IterationEnd | None = None
        if not config.enabled:
            return
        lifecycle.close_earlier(config.run_dir)
        run_dir = RunDir(config.run_dir, Shard(self.coord.rank, self.coord.world_size),
                         compressor_params={"ratio": cc.ratio, "rank": cc.rank})
        run_dir.direct_io = config.log.direct_io
        self.run_dir = run_dir
        try:
            policy = make_policy(config, run_dir, self.coord,
                                 record_bytes_bound([(n, fsdp.local(p)) for n, p in self.spec.optimized], cc))
            self.checkpointer = Checkpointer(config, run_dir, policy)
            self.checkpointer.on_stop = self.write_stop
            self.iteration = IterationEnd(self.tracker, optimizer, self.checkpointer)
            self._open(run_dir, self.checkpointer)
        except BaseException:
            run_dir.release()  # a failed wrap must not keep the run directory locked
            if layerwise is not None:
                layerwise.remove()  # nor its hooks on the model's parameters
            raise

    @property
    def codec(self) -> str:
        return resolve_codec(self.config.log.codec, self.config.compressor.name)

    def _open(self, run_dir: RunDir, checkpointer: Checkpointer) -> None:
        run_dir.wait_for_persistence(leader=self.leader)  # an earlier trainer's persistence processes, committing
        failed: BaseException | None = None
        if self.leader:
            try:
                run_dir.open()
                if self.config.remote.url is not None:
                    self._reconcile(run_dir)
            except BaseException as e:
                failed = e
        # Told to every rank at once: the others would otherwise wait at the barrier below until its timeout.
        if not self.coord.broadcast_ints([int(failed is None)], "open run directory")[0]:
            if failed is not None:
                raise failed
            raise LowDiffError(f"rank {self.coord.rank}: rank 0 could not open the run directory {run_dir.path} "
                               f"(its error says why); fix that and start the job again")
        self.coord.barrier("open run directory")  # no rank starts persistence processes before every rank waited
        if run_dir.has_run():
            run_dir.check_compatible(self.spec.manifest)
            fsdp.adopt(run_dir, self.spec, self.coord, self.sharded, self.leader)
            self.loop.needs_resume = True
            return
        # A new run: the step-0 snapshot (every rank's shard) first, the manifest last: it commits the run. Every
        # file names the run: rank 0 draws the id, every rank stamps it (docs/reference/FORMAT.md section 2).
        run_dir.new_run(self.spec.manifest, self.coord.broadcast_ints)
        self.stager.remember_buffers()
        state0 = self.stager.snapshot(0).wait()
        run_dir.write_snapshot(state0, self.codec)
        self.coord.barrier("snapshot 0")
        if self.leader:
            run_dir.commit_manifest(self.spec.manifest)
        self.coord.barrier("manifest")
        checkpointer.start(durable_step=0, shadow=self.make_shadow(state0))
        self.loop.step0 = self.fingerprint()

    def _reconcile(self, run_dir: RunDir) -> None:
        """With ``remote.url``: an empty run directory (a new machine) gets the remote run; where both hold it, the
        newer wins (lowdiff._storage.reconcile)."""
        from lowdiff._storage.reconcile import reconcile
        from lowdiff._storage.remote import Store

        rc = self.config.remote
        assert rc.url is not None
        both, what = reconcile(run_dir.path, Store(rc.url, rc.storage_options))
        (log.warning if both else log.info)("lowdiff: %s", what)

    def fingerprint(self) -> tuple[Any, ...]:
        """What snapshot 0 holds, cheaply (lowdiff._training.step_zero): this rank's parameters, the optimizer's
        state and groups."""
        owned = self.stager.owned
        tensors = [fsdp.local(p) for n, p in self.spec.params.items() if n in owned]
        tensors += [v for st in self.inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return fingerprint(tensors, encode_groups(self.inner.param_groups))

    def settle_step0(self) -> None:
        """The first step of this run in this process: write snapshot 0 again if what it holds has changed since
        (weights or an optimizer state loaded after wrap(), a scheduler created on the wrapper;
        lowdiff._training.step_zero)."""
        before, self.loop.step0 = self.loop.step0, None
        if before is not REWRITE and before == self.fingerprint():
            return
        assert self.checkpointer is not None and self.run_dir is not None
        state = self.stager.snapshot(0).wait()
        if state.buffers:
            # This step's forward pass may have changed them already; snapshot 0 keeps the values the changed
            # buffers of step 1's record are found against (a buffer set after wrap() is in that record).
            state.buffers = self.stager.buffer_baseline()
        self.run_dir.write_snapshot(state, self.codec)
        if before is REWRITE:  # every rank resumed at step 0, so every rank is here
            self.coord.barrier("snapshot 0 written again")
            if self.leader:
                # Written by another number of ranks, the old snapshot 0 is a set of its own, which recovery would
                # list first (fewer files) and then refuse (the branch owns step 0 from here): moved aside.
                self.run_dir.quarantine_snapshot_sets(0, keep_count=self.coord.world_size)
                self.run_dir.own_step_zero()
        log.info("lowdiff: %s; snapshot 0 of %s written again with the state the first step starts from",
                 "resumed at step 0" if before is REWRITE else "parameters, optimizer state or groups changed "
                 "between wrap() and the first step", self.run_dir.path)
        if self.config.snapshot.shadow:
            self.checkpointer.restart(self.make_shadow(state))

    def make_shadow(self, state: SnapshotState) -> ShadowReplica | None:
        if not self.config.snapshot.shadow:
            return None
        return make_shadow(self.spec, state, type(self.inner), world_size=self.coord.world_size)

    def write_stop(self, durable_step: int) -> None:
        """At a clean stop, the log whole up to ``durable_step``: save the compressor's memory of that step, which the
        log cannot rebuild (lowdiff._storage.stop), so a resume there continues bit for bit. Only when the memory is
        that step's (no compression since: a backward pass under DDP, an interrupted step) and no snapshot there
        holds it already."""
        loop, run_dir = self.loop, self.run_dir
        if run_dir is None or self.compressor.name == "none" or loop.step == 0:
            return
        moved = loop.memory_step != loop.step or durable_step != loop.step or bool(self.hook and self.hook.payloads)
        if moved:
            log.info("lowdiff: the compressor's memory is not that of step %d, the last logged one: no stop file "
                     "(a resume there restarts error-feedback residuals at zero)", durable_step)
            return
        if loop.step in list_snapshots(run_dir.path):
            return
        try:
            nbytes = run_dir.write_stop(self.stager.stop_state(loop.step), self.codec)
            run_dir.prune_stops(loop.step)
        except (OSError, LowDiffError) as e:
            log.warning("lowdiff: could not save the compressor's memory at step %d in %s (%s); a resume there "
                        "restarts error-feedback residuals at zero", loop.step, run_dir.path, e)
            return
        log.info("lowdiff: saved the compressor's memory at step %d (%d bytes): a resume there is exact", loop.step,
                 nbytes)
