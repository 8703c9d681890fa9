"""``opt.resume()``: which step to resume at, the recovered state loaded into the live model, optimizer, compressor,
tracked objects and RNG generators, which compressor memory a rank gets back, and what the log can and cannot
restore (said once in the log)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lowdiff import rng as rng_state
from lowdiff._compressors import Compressor
from lowdiff._recovery import Recovered, recover
from lowdiff._recovery.optimizers import allowed_optimizers
from lowdiff._storage.format import MANIFEST, list_snapshots
from lowdiff._training import fsdp
from lowdiff._training.iteration import AT_END, AT_STEP
from lowdiff._training.opening import Run
from lowdiff._training.step_zero import REWRITE
from lowdiff.errors import CorruptFileError, StepNotAvailableError

log = logging.getLogger(__name__)

RESUME_AT = ("latest", "snapshot")


def recover_for_resume(run_dir: Path, at: str, *, device: str, workers: int | None, rank: int | None,
                       shard: tuple[int, int] | None = None, optimizer_class: type | None = None) -> Recovered:
    """The state ``resume(at=...)`` continues from: the latest durable step, or the newest snapshot step whose
    compressor memory is exact (``at="snapshot"``: with Top-k or PowerSGD the only bit-exact continuation after a
    crash between snapshots; the loop redoes the steps after it). ``optimizer_class``: the wrapped optimizer's (the
    replay's, also when it is not one of torch.optim's: the trainer built it, so it is trusted)."""
    if at not in RESUME_AT:
        raise ValueError(f"resume(at={at!r}): expected one of {', '.join(RESUME_AT)}")
    if at == "latest":
        return recover(run_dir, device=device, workers=workers, rank=rank, shard=shard,
                       optimizer_class=optimizer_class, wait_for_writer=False)
    for step in sorted(list_snapshots(run_dir), reverse=True):
        try:
            rec = recover(run_dir, step=step, device=device, workers=workers, rank=rank, shard=shard,
                          optimizer_class=optimizer_class, wait_for_writer=False)
        except StepNotAvailableError:
            continue
        except CorruptFileError as e:
            # Nothing reaches this snapshot's step: it is damaged and no log leads to it, or it belongs to a
            # history a resume discarded (restored from a backup, FORMAT.md section 2). An older one may serve.
            if e.path is not None and Path(str(e.path)).name == MANIFEST:
                raise
            log.info("lowdiff: no state at the snapshot step %d can be used (%s); trying an older one", step, e)
            continue
        if rec.compressor_state_exact:
            return rec
        log.info("lowdiff: the snapshot at step %d holds no exact compressor memory (a compacted or damaged one); "
                 "trying an older one", step)
    log.warning("lowdiff: %s holds no snapshot with exact compressor memory; resuming at the latest step", run_dir)
    return recover(run_dir, device=device, workers=workers, rank=rank, shard=shard, optimizer_class=optimizer_class,
                   wait_for_writer=False)


def replay_class(optimizer: torch.optim.Optimizer) -> type | None:
    """The class recovery replays a resumed run with: the wrapped optimizer's own when it is not one of
    torch.optim's (the trainer built it, so it is trusted; its name was checked against the manifest's by
    ``wrap()``); None for torch.optim's, which recovery resolves and checks against the manifest itself."""
    cls = type(optimizer)
    return None if f"{cls.__module__}.{cls.__qualname__}" in allowed_optimizers() else cls


def compressor_state(rec: Recovered, compressor: Compressor, world_size: int,
                     params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The compressor memory this rank resumes with, on its parameters' devices. Exact at a snapshot step resumed
    on the world size that wrote it (each rank its own residuals, FORMAT.md section 4); otherwise what is the same
    on every rank (PowerSGD's Q) and residuals that restart at zero, said once."""
    state = _memory(rec, compressor, world_size)
    return {n: {k: v.to(params[n].device) if n in params else v for k, v in st.items()} for n, st in state.items()}


def _memory(rec: Recovered, compressor: Compressor, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    state = rec.compressor_state
    local = compressor.rank_local_keys
    has_memory = compressor.name != "none"
    exact = rec.compressor_state_exact and rec.compressor_name in (None, compressor.name)
    if rec.compressor_name not in (None, compressor.name):  # a clean stop's memory, of another compressor
        state = {}
    writers = rec.world_size if rec.compressor_world_size is None else rec.compressor_world_size
    if writers == 1 and world_size == 1:
        if not exact and has_memory:
            _residuals_restart(rec.step)
        return state
    shared = {n: {k: v for k, v in st.items() if k not in local} for n, st in state.items()}
    shared = {n: st for n, st in shared.items() if st}
    if not has_memory:
        return shared
    if not exact:
        _residuals_restart(rec.step)
    elif writers != world_size:
        log.warning("lowdiff: resumed on %d rank(s) the state at step %d, whose compressor memory %d rank(s) wrote: "
                    "each rank's error-feedback residuals restart at zero (they belong to the ranks that wrote them)",
                    world_size, rec.step, writers)
    elif rec.rank_compressor_state:
        for n, st in rec.rank_compressor_state.items():
            shared.setdefault(n, {}).update(st)
    elif any(k in local for st in state.values() for k in st):
        log.warning("lowdiff: the snapshot at step %d was written before lowdiff saved each rank's own residuals; "
                    "error-feedback residuals restart at zero", rec.step)
    return shared


def _residuals_restart(step: int) -> None:
    # A warning, not an INFO line: the loop goes on, but from here it no longer trains what the uninterrupted run
    # would have, and the quickstart's plain resume() is where a user meets it.
    log.warning("lowdiff: resumed at step %d between snapshots after a crash (no clean stop saved the compressor's "
                "memory there); error-feedback residuals restart at zero, so the run continues close to the "
                "uninterrupted one but not bit for bit (opt.resume(at='snapshot') continues bit for bit from the "
                "newest snapshot step instead)", step)


def apply_end_groups(groups: list[dict[str, Any]], end: list[dict[str, Any]] | None) -> None:
    """Put back the hyperparameters the loop left at the end of the resumed iteration (after its ``sched.step()``):
    what the next step starts from. ``end`` None: the log does not hold them (written by an older lowdiff, or the
    iteration ended at a crash), and the groups stay as the resumed step used them."""
    if end is None:
        return
    for g, e in zip(groups, end):
        g.update(e)


def resume_run(run: Run, at: str) -> int:
    """Restore ``run``'s model, optimizer, compressor, tracked objects and RNG state to the end of the logged
    iteration ``at`` picks (lowdiff._training.optimizer.LowDiffOptimizer.resume) and start its writer there."""
    assert run.checkpointer is not None and run.run_dir is not None
    inner, spec, coord, sharded, run_dir = run.inner, run.spec, run.coord, run.sharded, run.run_dir
    device = str(next(iter(spec.params.values())).device) if spec.params else "cpu"
    world = coord.world_size
    # Every rank resumes at once: parallel replay inside each rank would oversubscribe the node's cores.
    rec = recover_for_resume(run_dir.path, at, device=device, workers=1 if world > 1 else None,
                             rank=coord.rank if world > 1 else None,
                             shard=(coord.rank, world) if sharded is not None else None,
                             optimizer_class=replay_class(inner))
    if rec.step == 0:
        # Nothing was trained: the live state is where the run was, pretrained weights loaded after wrap()
        # included, which snapshot 0 may predate; it is written again at the first step (step_zero.py).
        run.loop.step0 = REWRITE
    elif sharded is not None:
        fsdp.load_state(rec, spec, sharded, inner)
    else:
        run.model.load_state_dict(rec.model)
        inner.load_state_dict(rec.optimizer)
    if rec.step > 0:
        apply_end_groups(inner.param_groups, rec.end_groups)
        run.compressor.load_state_dict(
            compressor_state(rec, run.compressor, world, spec.params) if sharded is None
            else fsdp.compressor_state(rec, spec, sharded, rec.world_size))
    for s in rec.report.skipped:
        log.warning("lowdiff: resume skipped %s", s)
    coord.barrier("recovered")
    if run.leader:
        run_dir.quarantine_beyond(rec.step)
    # Files from here on are of a new branch of the run's history: a file the resume moved aside and someone
    # puts back is refused (lowdiff._storage.history), even where no file of this branch holds its steps.
    run_dir.start_branch(rec.step, coord.broadcast_ints, commit=run.leader)
    coord.barrier("quarantined")
    run.loop.step = rec.step
    run.loop.stepped = False
    run.stager.remember_buffers()
    run.loop.needs_resume = False
    shadow = run.make_shadow(run.stager.snapshot(rec.step).wait()) if run.config.snapshot.shadow else None
    run.checkpointer.start(durable_step=rec.step, shadow=shadow)
    # Last, so nothing above draws from the restored generators: the next forward starts from them.
    run.tracker.restore(rec.data, rec.step, end_known=rec.end_groups is not None)
    rng_state.restore_at_resume(rec.rng, rng_state.current_rank(), rec.step)
    if fsdp.changes_layout(run_dir.read_manifest(), rec.world_size, sharded):
        data = {**run.tracker.state(AT_STEP)[0], **run.tracker.state(AT_END)[0]}
        fsdp.rebase(run.stager.snapshot(rec.step, data), run_dir, coord, inner.param_groups, run.codec)
    if run.writes is not None and rec.step > 0:
        run.writes.arm(rec.step)  # weights loaded after a resume at step 0: a fresh run's (step_zero.py)
    log.info("lowdiff: resumed %s at step %d (%s)", run_dir.path, rec.step, rec.report.summary().splitlines()[0])
    return rec.step
