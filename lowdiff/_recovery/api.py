"""``lowdiff.recover``: the read-only entry point that rebuilds a step's model and optimizer state."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowdiff._recovery import procs
from lowdiff._recovery.optimizers import check_manifest_optimizer, resolve_optimizer_class
from lowdiff._recovery.options import DEFAULT_OPTIONS, ReplayOptions
from lowdiff._recovery.replayer import (
    ELEMENTWISE_OPTIMIZERS,
    PartitionResult,
    PhaseTimes,
    replay_partition,
)
from lowdiff._recovery.stop_memory import stop_at
from lowdiff._storage import layout
from lowdiff._storage.format import MANIFEST, decode_value
from lowdiff._storage.lock import wait_for_orphans
from lowdiff._storage.log_reader import Chain, candidates_for, contested, contested_note
from lowdiff._storage.manifest import Manifest, read_manifest
from lowdiff._storage.named_state import to_indexed
from lowdiff._storage.remote import fetched, is_url, needed
from lowdiff._storage.remote_names import listing, missing_shards, naming_remote
from lowdiff._storage.segment import SegmentReader
from lowdiff._storage.snapshot import read_rank_state
from lowdiff.errors import (
    CorruptFileError,
    FileVanishedError,
    LowDiffError,
    StepNotAvailableError,
    UnsupportedError,
)

log = logging.getLogger(__name__)

ORPHAN_WAIT_S = 120.0
"""How long recovery waits for a dead trainer's persistence process to commit what it holds."""


@dataclass
class RecoveryReport:
    step: int
    snapshot_step: int
    steps_replayed: int
    bytes_read: int
    workers: int
    mode: str
    """"sequential" or "parallel" (and why sequential, when workers > 1 was asked for)."""
    times: PhaseTimes = field(default_factory=PhaseTimes)
    total_s: float = 0.0
    skipped: list[str] = field(default_factory=list)
    """Damaged files that recovery stepped around, with the reason (from a bucket, also missing shards of a set)."""

    def summary(self) -> str:
        t = self.times
        lines = [
            f"recovered step {self.step} from snapshot {self.snapshot_step} + {self.steps_replayed} replayed steps",
            f"  mode {self.mode}, workers {self.workers}, read {self.bytes_read / 1e6:.2f} MB, "
            f"total {self.total_s:.2f} s",
            f"  load snapshot {t.load_snapshot_s:.2f} s, read {t.read_s:.2f} s, decode {t.decode_s:.2f} s, "
            f"apply {t.apply_s:.2f} s",
        ]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


@dataclass
class Recovered:
    """State at ``step``: ``model.load_state_dict(rec.model)``, ``optimizer.load_state_dict(rec.optimizer)``."""

    step: int
    model: OrderedDict[str, torch.Tensor]
    optimizer: dict[str, Any]
    compressor_state: dict[str, dict[str, torch.Tensor]]
    """Compressor memory at ``step``; complete only when ``compressor_state_exact`` (a snapshot step)."""
    compressor_state_exact: bool
    report: RecoveryReport
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """RNG state right after ``step`` by source name (``lowdiff.rng.restore(rec.rng)``); empty if not logged."""
    data: dict[str, Any] = field(default_factory=dict)
    """The state of every object ``opt.track`` registered, by its name, at the end of iteration ``step`` (a
    ``ResumableLoader``'s ``{"epoch", "seed", "offset"}``, a scheduler's ``state_dict()``)."""
    end_groups: list[dict[str, Any]] | None = None
    """Each optimizer group's hyperparameters at the end of iteration ``step``, after the loop's ``sched.step()``:
    what the next step starts from (``optimizer`` holds those step ``step`` used). None when the log does not hold
    them (a run written before format 2.2)."""
    world_size: int = 1
    """Ranks that wrote the snapshot recovery started from (its shards)."""
    rank_compressor_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Rank ``rank``'s own compressor memory (error-feedback residuals) when ``recover(..., rank=...)`` was asked
    for it and ``step`` is a snapshot step of a sharded run (FORMAT.md section 4); else empty."""
    shard: tuple[int, int] | None = None
    """(rank, ranks) when ``recover(..., shard=...)`` replayed only that rank's shards of a fully_shard run: then
    ``model``, ``optimizer`` and ``compressor_state`` hold them under their stored names (``NAME#I-of-N``,
    FORMAT.md section 9) and the buffers; None: the whole model under its own names."""
    compressor_world_size: int | None = None
    """Ranks that wrote the compressor memory returned: the stop file's (FORMAT.md section 4a) when ``step`` is a
    clean stop's step between snapshots, else None (the snapshot's, ``world_size``)."""
    compressor_name: str | None = None
    """The compressor that left that memory, when it came from a stop file (a resume with another compressor does
    not take it)."""


def recover(run_dir: str | os.PathLike[str], step: int | None = None, workers: int | None = None, *,
            device: str = "cpu", optimizer_class: type | None = None, progress: Any = None,
            rank: int | None = None, options: ReplayOptions = DEFAULT_OPTIONS,
            shard: tuple[int, int] | None = None, storage_options: dict[str, Any] | None = None,
            wait_for_writer: bool = True) -> Recovered:
    """Rebuild model and optimizer state at ``step`` (None: the latest durable step). Never writes.

    ``rank``: also return that rank's own compressor memory (``rank_compressor_state``) when ``step`` is a snapshot
    step of a run trained on several ranks (``opt.resume()`` under DDP asks for its own).

    ``workers``: replay processes (None: one per CPU this process may use, at most 8, and one for a replay of
    fewer than 16 steps, which forking workers would slow down; docs/measurements/recovery-short.md).
    Element-wise optimizers replay disjoint shares of the tensors in parallel, bit-identical to one worker; other
    optimizers, devices other than the CPU, and a process running other threads replay in one process
    (``report.mode`` says why). ``options``: replay's block sizes and test seam (:class:`ReplayOptions`; the
    defaults are what users want, and no option changes a recovered bit). ``shard=(rank, ranks)``: a fully_shard
    run whose chain was written by ``ranks`` ranks replays and returns only ``rank``'s shards (``Recovered.shard``
    says whether it did); ``opt.resume()`` on the same number of ranks asks for its own. ``wait_for_writer``: if
    the persistence process of a trainer that died is still committing what it was handed, wait for it (up to
    ``ORPHAN_WAIT_S``, saying so), so the latest step it commits is recovered; a live trainer's is never waited for.

    >>> rec = lowdiff.recover("runs/exp1")          # doctest: +SKIP
    >>> model.load_state_dict(rec.model); optimizer.load_state_dict(rec.optimizer)  # doctest: +SKIP

    ``run_dir`` may be a URL (``s3://bucket/prefix``: a run mirrored with ``remote.url``): the run is fetched into
    a temporary directory first (``storage_options``: the fsspec filesystem's; credentials and endpoint come from
    the store's environment) and read there with every check of a local run.
    """
    if is_url(run_dir):
        return _recover_remote(str(run_dir), storage_options, step, progress, lambda local: recover(
            local, step, workers, device=device, optimizer_class=optimizer_class, progress=progress, rank=rank,
            options=options, shard=shard, wait_for_writer=False))
    t_start = time.perf_counter()
    root = Path(run_dir)
    if wait_for_writer and not wait_for_orphans(root, ORPHAN_WAIT_S, lambda: log.warning(
            "lowdiff: the persistence process of a trainer that died is still committing %s; waiting for it", root)):
        log.warning("lowdiff: %s: a dead trainer's persistence process may still be committing; recovering from "
                    "what is on disk now (the latest steps may be missing: run again once it has exited)", root)
    manifest = read_manifest(root)
    check_optimizer(root, manifest, optimizer_class)
    skipped: list[str] = []
    damaged: set[Path] = set()
    relists = 0
    contested_notes = _screen_contested(root, manifest, damaged, skipped)
    while True:
        # Each damaged file found is treated as missing and the plan redone: an older snapshot can stand in
        # for a damaged one; a damaged segment moves the latest durable step back to the step before it.
        try:
            target, chains = candidates_for(root, step, frozenset(damaged))
        except StepNotAvailableError as e:
            if skipped:
                raise CorruptFileError(f"{root}: no undamaged snapshot and log reach "
                                       f"{'any step' if step is None else f'step {step}'}: {'; '.join(skipped)}") from e
            if contested_notes:
                raise StepNotAvailableError(f"{e}; {'; '.join(contested_notes)}") from e
            raise
        chains = [c for c in chains if _one_layout(manifest, c, target)]
        if not chains:
            raise StepNotAvailableError(f"{root}: step {target} is reached only by a chain that changes its sharded "
                                        "layout (fully_shard on another number of ranks) without a snapshot between")
        chain = chains[0]
        stored = layout.for_files(manifest, chain.snapshot)
        own = None
        if shard is not None and stored.layout == shard[1] > 1:
            own = [layout.shard_name(p.name, shard[0], shard[1]) for p in manifest.params]
        try:
            result, nworkers, mode = _replay_chain(stored, chain, target, workers, device, optimizer_class, progress,
                                                   options, own)
        except FileVanishedError as e:
            # Retention (a live trainer's, or compaction) deleted a file after it was listed: list again.
            relists += 1
            if relists > MAX_RELISTS:
                raise StepNotAvailableError(f"{root}: files keep disappearing while recovery reads them ({e}); "
                                            "stop the process deleting them (a trainer's snapshot.keep retention, "
                                            "lowdiff compact) or retry") from e
            log.info("recovery: %s; listing the run directory again", e)
            continue
        except CorruptFileError as e:
            bad = e.path if isinstance(e.path, Path) else None
            if bad is None or bad in damaged:
                raise
            log.warning("recovery: %s; stepping around it", e)
            skipped.append(str(e))
            damaged.add(bad)
            continue
        except LowDiffError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
            # Every file was checked before use, so this is content the checks did not anticipate: still a
            # LowDiffError naming what was being replayed, never a bare exception from deep inside torch.
            raise CorruptFileError(f"{root}: replaying to step {target} from {chain.snapshot} and "
                                   f"{len(chain.segments_to(target))} segment(s) failed ({e!r}); a file of the run is "
                                   "invalid in a way lowdiff does not check (please report it)") from e
        report = RecoveryReport(step=target, snapshot_step=chain.snapshot_step, steps_replayed=result.steps,
                                bytes_read=result.bytes_read, workers=nworkers, mode=mode, times=result.times,
                                total_s=time.perf_counter() - t_start, skipped=skipped + contested_notes)
        if own is not None:
            return _assemble_own(root, manifest, stored, own, shard, result, target, chain, report, device)  # type: ignore[arg-type]
        return _assemble(root, manifest, result, target, chain, report, device, rank)


def _recover_remote(url: str, storage_options: dict[str, Any] | None, step: int | None, progress: Any,
                    recover_at: Callable[[Path], Recovered]) -> Recovered:
    """Recovery of a remote run: fetch what the step needs when nothing is damaged (lowdiff._storage.remote.needed)
    and recover from it; where that skipped or refused anything, fetch the whole run and recover from that, so an
    older snapshot can stand in for a damaged one exactly as on a local disk."""
    said: set[str] = set()  # by both reads, under the files' URLs (lowdiff._storage.remote_names)
    listed: list[str] = []
    for select in (lambda names: needed(names, step), None):
        with fetched(url, storage_options, progress=progress is not None, select=listing(select, listed)) as local, \
                naming_remote(local, url, log, said) as rename:
            try:
                rec = recover_at(local)
            except LowDiffError as e:
                if select is not None:
                    log.info("recovery: %s: %s; fetching the whole run", url, e)
                    continue
                raise
            rec.report.skipped = [rename(s) for s in rec.report.skipped]
            if select is None or not rec.report.skipped:
                rec.report.skipped += missing_shards(listed, url, rec.report.snapshot_step, step, log)
                return rec
            log.info("recovery: %s: a file the step needs is damaged; fetching the whole run", url)
    raise AssertionError("unreachable")


def _screen_contested(root: Path, manifest: Manifest, damaged: set[Path], skipped: list[str]) -> list[str]:
    """Segments holding the same steps (log_reader.chains stops before those). Each is opened first: one that
    does not belong where it lies (damaged, misnamed, another run's) is treated as damaged, like any such file,
    and contests nothing. The notes for the pairs left, also logged."""
    pairs = contested(root, frozenset(damaged))
    for seg in {s.files.name: s for pair in pairs for s in pair}.values():
        try:
            SegmentReader(seg.files, layout.for_files(manifest, seg.files), seg.first, seg.last).close()
        except FileVanishedError:
            continue  # listed again by the caller's loop
        except CorruptFileError as e:
            log.warning("recovery: %s; stepping around it", e)
            skipped.append(str(e))
            damaged.update(seg.files.paths)
    notes = [contested_note(a, b) for a, b in contested(root, frozenset(damaged))]
    for note in notes:
        log.warning("recovery: %s", note)
    return notes


def _one_layout(manifest: Manifest, chain: Chain, target: int) -> bool:
    """A chain replays in one layout: a resume on another number of fully_shard ranks starts a new snapshot."""
    want = layout.layout_of(manifest, chain.snapshot)
    return all(layout.layout_of(manifest, s.files) == want for s in chain.segments_to(target))


MAX_RELISTS = 20
"""Times recovery lists the run directory again because a listed file vanished (retention running alongside)."""


def check_optimizer(root: Path, manifest: Manifest, optimizer_class: type | None) -> type:
    """The run's optimizer class, resolved and checked against the manifest's defaults (a refusal names the
    manifest: it is the file at fault, and no other file can stand in for it)."""
    where = root / MANIFEST
    if manifest.sharding is not None and manifest.optimizer_class not in ELEMENTWISE_OPTIMIZERS:
        raise UnsupportedError(f"{where}: a fully_shard run with {manifest.optimizer_class[:80]}: each shard replays "
                               "on its own, which is exact only for element-wise optimizers (FORMAT.md section 9)")
    cls = resolve_optimizer_class(manifest.optimizer_class, optimizer_class, where=str(where))
    if optimizer_class is None:
        check_manifest_optimizer(manifest, cls, where)
    return cls


def _replay_chain(manifest: Manifest, chain: Chain, target: int, workers: int | None, device: str,
                  optimizer_class: type | None, progress: Any,
                  options: ReplayOptions = DEFAULT_OPTIONS, own: list[str] | None = None
                  ) -> tuple[PartitionResult, int, str]:
    segments = chain.segments_to(target)
    nsteps = target - chain.snapshot_step
    names = manifest.optimized_params
    auto = workers is None
    if workers is None:
        workers = procs.default_workers()
    workers = max(1, min(workers, max(len(names), 1)))
    mode = "sequential"
    if auto and workers > 1 and 0 < nsteps < procs.PARALLEL_MIN_STEPS:
        mode = (f"sequential ({nsteps} step(s) to replay: below {procs.PARALLEL_MIN_STEPS}, starting worker "
                "processes costs more than they save)")
        workers = 1
    if workers > 1 and manifest.optimizer_class not in ELEMENTWISE_OPTIMIZERS:
        mode = f"sequential ({manifest.optimizer_class} is not known to be element-wise)"
        workers = 1
    if workers > 1 and device != "cpu":
        mode = f"sequential (parallel replay runs on cpu, not {device})"
        workers = 1
    if workers > 1 and nsteps > 0:
        unsafe = procs.fork_unsafe_reason()
        if unsafe is not None:
            mode, workers = f"sequential ({unsafe})", 1
    if own is not None:  # one rank's shards of a fully_shard run (its resume: one process per rank already)
        return replay_partition(manifest, chain.snapshot, segments, target, own, True, optimizer_class, device,
                                progress, options=options), 1, "sequential (this rank's shards)"
    if workers == 1 or nsteps == 0:
        return replay_partition(manifest, chain.snapshot, segments, target, None, True, optimizer_class,
                                device, progress, options=options), 1, mode
    # Processes, not threads: threads stepping disjoint chunks were slower than one (the optimizer's per-chunk
    # Python serializes on the GIL; docs/reference/design.md). One intra-op thread each.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = replay_partition(manifest, chain.snapshot, segments, target, None, True, optimizer_class,
                                  device, progress, workers=workers, options=options)
    finally:
        torch.set_num_threads(threads)
    if result.workers == 1:
        return result, 1, result.note or "sequential"
    return result, result.workers, "parallel"


def _assemble_own(root: Path, manifest: Manifest, stored: Manifest, own: list[str], shard: tuple[int, int],
                  r: PartitionResult, target: int, chain: Chain, report: RecoveryReport, device: str) -> Recovered:
    """One rank's shards, under their stored names (``recover(..., shard=...)``)."""
    mine = set(own)
    model: OrderedDict[str, torch.Tensor] = OrderedDict(r.buffers)
    model.update((n, r.params[n]) for n in own if n in r.params)
    optimizer = to_indexed({n: st for n, st in r.optimizer_state.items() if n in mine},
                           [[n for n in g if n in mine] for g in stored.param_groups], r.groups)
    exact = target == chain.snapshot_step and bool(r.snapshot_extra.get("compressor_state_exact", True))
    comp = {n: st if exact else {"q": st["q"]} for n, st in r.compressor_state.items()
            if n in mine and (exact or "q" in st)}
    comp.update({n: {"q": q} for n, q in r.last_q.items() if n in mine and not exact})
    stopped = None if exact else stop_at(root, manifest, target, None, shard[1], report.skipped)
    if stopped is not None:
        comp, exact = {n: st for n, st in stopped[0].compressor_state.items() if n in mine}, True
    end = None if r.end_groups is None else [{k: v for k, v in decode_value(g, device).items() if k != "params"}
                                             for g in r.end_groups]
    return Recovered(step=target, model=model, optimizer=optimizer, compressor_state=comp,
                     compressor_state_exact=exact, report=report, rng=r.rng, data=r.data, end_groups=end,
                     world_size=len(chain.snapshot.paths), shard=shard,
                     compressor_world_size=None if stopped is None else stopped[0].ranks,
                     compressor_name=None if stopped is None else stopped[0].compressor_name)


def _assemble(root: Path, manifest: Manifest, r: PartitionResult, target: int, chain: Chain, report: RecoveryReport,
              device: str = "cpu", rank: int | None = None) -> Recovered:
    count = layout.layout_of(manifest, chain.snapshot)
    stored = layout.view(manifest, count)
    params, opt_state, comp_state = layout.unshard(manifest, count, r.params, r.optimizer_state,
                                                   r.compressor_state)
    tensors: dict[str, torch.Tensor] = {}
    tensors.update(r.buffers)
    tensors.update(params)
    model: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, canonical in manifest.state_dict_keys:
        if canonical not in tensors:
            raise CorruptFileError(f"{chain.snapshot}: no value for {canonical!r}")
        model[key] = tensors[canonical]
    optimizer = to_indexed({n: opt_state[n] for n in manifest.optimized_params if n in opt_state},
                           manifest.param_groups, r.groups)
    # A compacted snapshot was itself rebuilt from the log, so its compressor memory is partial too.
    exact = target == chain.snapshot_step and bool(r.snapshot_extra.get("compressor_state_exact", True))
    if exact:
        comp = comp_state
    else:
        comp = {n: {"q": st["q"]} for n, st in comp_state.items() if "q" in st}
        comp.update({n: {"q": q} for n, q in r.last_q.items()})
    rank_state: dict[str, dict[str, torch.Tensor]] = {}
    stopped = None if exact else stop_at(root, manifest, target, rank, count, report.skipped)
    if stopped is not None:
        stop = stopped[0]
        _, _, comp = layout.unshard(manifest, count, r.params, {}, stop.compressor_state)
        rank_state, exact = stop.rank_compressor_state, True
    elif exact and rank is not None:
        try:
            rank_state = read_rank_state(chain.snapshot, stored, rank)
        except CorruptFileError as e:  # only compression's memory is lost: parameters and optimizer are exact
            log.warning("recovery: rank %d's compressor memory in %s is unreadable (%s); it restarts at zero",
                        rank, chain.snapshot, e)
            report.skipped.append(str(e))
    end = None if r.end_groups is None else [{k: v for k, v in decode_value(g, device).items() if k != "params"}
                                             for g in r.end_groups]
    return Recovered(step=target, model=model, optimizer=optimizer, compressor_state=comp,
                     compressor_state_exact=exact, report=report, rng=r.rng, data=r.data, end_groups=end,
                     world_size=len(chain.snapshot.paths), rank_compressor_state=rank_state,
                     compressor_world_size=None if stopped is None else stopped[0].ranks,
                     compressor_name=None if stopped is None else stopped[0].compressor_name)
