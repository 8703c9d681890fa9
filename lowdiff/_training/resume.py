"""What ``opt.resume()`` decides from a recovered step: which step to resume at, which compressor memory a rank gets
back, and what the log can and cannot restore (said once in the log). The loading itself is the wrapper's."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lowdiff._compressors import Compressor
from lowdiff._recovery import Recovered, recover
from lowdiff._recovery.optimizers import allowed_optimizers
from lowdiff._storage.format import MANIFEST, list_snapshots
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
        return recover(run_dir, device=device, workers=workers, rank=rank, shard=shard, optimizer_class=optimizer_class)
    for step in sorted(list_snapshots(run_dir), reverse=True):
        try:
            rec = recover(run_dir, step=step, device=device, workers=workers, rank=rank, shard=shard,
                          optimizer_class=optimizer_class)
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
    return recover(run_dir, device=device, workers=workers, rank=rank, shard=shard, optimizer_class=optimizer_class)


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
    if rec.world_size == 1 and world_size == 1:
        if not rec.compressor_state_exact and has_memory:
            _residuals_restart(rec.step)
        return state
    shared = {n: {k: v for k, v in st.items() if k not in local} for n, st in state.items()}
    shared = {n: st for n, st in shared.items() if st}
    if not has_memory:
        return shared
    if not rec.compressor_state_exact:
        _residuals_restart(rec.step)
    elif rec.world_size != world_size:
        log.warning("lowdiff: resumed on %d rank(s) the snapshot at step %d, which %d rank(s) wrote: each rank's "
                    "error-feedback residuals restart at zero (they belong to the ranks that wrote them)",
                    world_size, rec.step, rec.world_size)
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
    log.warning("lowdiff: resumed at step %d between snapshots; error-feedback residuals restart at zero, so the run "
                "continues close to the uninterrupted one but not bit for bit (opt.resume(at='snapshot') continues "
                "bit for bit from the newest snapshot step instead)", step)


def apply_end_groups(groups: list[dict[str, Any]], end: list[dict[str, Any]] | None) -> None:
    """Put back the hyperparameters the loop left at the end of the resumed iteration (after its ``sched.step()``):
    what the next step starts from. ``end`` None: the log does not hold them (written by an older lowdiff, or the
    iteration ended at a crash), and the groups stay as the resumed step used them."""
    if end is None:
        return
    for g, e in zip(groups, end):
        g.update(e)
