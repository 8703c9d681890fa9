"""``lowdiff compact``: fold the log up to a step into a new full snapshot, and apply retention."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowdiff._recovery.api import Recovered, recover
from lowdiff._storage import history, layout
from lowdiff._storage.format import Shard, encode_value, list_snapshots
from lowdiff._storage.manifest import Manifest, read_manifest
from lowdiff._storage.named_state import to_named
from lowdiff._storage.remote import is_url
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.snapshot import SnapshotState, write_snapshot
from lowdiff.config import resolve_codec
from lowdiff.errors import LowDiffError

log = logging.getLogger(__name__)


@dataclass
class CompactResult:
    step: int
    wrote_snapshot: bool
    removed: list[Path]


def compact(run_dir: str | Path, step: int | None = None, keep: int | None = None, codec: str | None = None,
            workers: int | None = None, optimizer_class: type | None = None) -> CompactResult:
    """Write a full snapshot at ``step`` (default: latest durable) rebuilt from the log; then, if ``keep`` is
    given, delete all but the newest ``keep`` snapshots and every segment no remaining snapshot needs.

    Takes the run's writer lock, so it refuses to run beside a live trainer. A local run directory only: a URL
    (a run mirrored with ``remote.url``) is refused.
    """
    if is_url(run_dir):  # Path() would fold its '//' and report a missing local directory
        raise LowDiffError(f"compact works on a local run directory only, not {run_dir}: recover the state from "
                           f"there (lowdiff-recover {run_dir} --output FILE), or copy the run to a local directory "
                           "and compact that")
    root = Path(run_dir)
    manifest = read_manifest(root)
    run = RunDir(root)
    run.wait_for_persistence()  # a dead trainer's persistence processes, still committing
    run.open()  # the writer lock: refuses to run beside a live trainer
    try:
        run.run_id = manifest.run_id
        # Refused before the replay: without --step the target is the latest step, which no snapshot passes.
        newer = sorted(s for s in list_snapshots(root) if step is not None and s > step)
        if keep and len(newer) >= keep:
            raise LowDiffError(f"compact --step {step} --keep {keep}: {len(newer)} snapshot(s) newer than step "
                               f"{step} ({newer[:4]}) would be kept instead of the one this writes, and the log "
                               f"reaching step {step} deleted; keep at least {len(newer) + 1}, or leave --keep out")
        rec = recover(root, step=step, workers=workers, optimizer_class=optimizer_class)
        # Retention keeps the newest snapshots by name. Without --step, one newer than the step recovery reached is
        # one it refused (damaged, of a discarded history): kept, it would make retention delete what recovery uses.
        beyond = sorted(s for s in list_snapshots(root) if s > rec.step)
        if keep and len(beyond) >= keep:
            raise LowDiffError(f"compact --keep {keep}: {len(beyond)} snapshot(s) newer than step {rec.step}, which "
                               f"recovery could not use ({beyond[:4]}; {'; '.join(rec.report.skipped)[:400]}), would "
                               "be kept instead of the one this writes, and the files recovery uses deleted; move "
                               "them out of the run directory first (lowdiff verify lists them), or keep more")
        wrote = False
        # Recovery started from a snapshot at this very step only if one is there intact: a damaged one (stepped
        # around) is written again, else retention would count it as the snapshot to keep and delete the rest.
        if rec.report.snapshot_step != rec.step:
            codec = codec or resolve_codec(str(manifest.config.get("log", {}).get("codec", "auto")),
                                           str(manifest.config.get("compressor", {}).get("name", "none")))
            state = snapshot_from_recovered(manifest, rec)
            count = rec.world_size if rec.world_size in layout.layouts(manifest.sharding) else 1
            run.branch = history.at_step(manifest.history, rec.step)  # the history that state is in
            if count == 1:
                run.write_snapshot(state, codec)
            else:  # a fully_shard run: the snapshot in its chain's layout, one file per rank (FORMAT.md section 9)
                for i, part in enumerate(layout.split(manifest, state, count)):
                    write_snapshot(root, part, codec, Shard(i, count), run_id=manifest.run_id, branch=run.branch)
            wrote = True
        removed = run.apply_retention(RetentionPolicy(keep)) if keep else []
        return CompactResult(step=rec.step, wrote_snapshot=wrote, removed=removed)
    finally:
        run.release()


def snapshot_from_recovered(manifest: Manifest, rec: Recovered) -> SnapshotState:
    canonical = dict(manifest.state_dict_keys)
    tensors = {canonical[k]: v for k, v in rec.model.items()}
    order = manifest.optimized_params
    groups: list[dict[str, Any]] = []
    for names, g in zip(manifest.param_groups, rec.optimizer["param_groups"]):
        groups.append({k: encode_value(v) for k, v in g.items() if k != "params"} | {"params": names})
    return SnapshotState(
        step=rec.step,
        params={p.name: tensors[p.name] for p in manifest.params},
        buffers={b.name: tensors[b.name] for b in manifest.buffers},
        optimizer_state=to_named(rec.optimizer["state"], order),
        param_groups=groups,
        compressor_name=str(manifest.config.get("compressor", {}).get("name", "none")),
        compressor_state=rec.compressor_state,
        # Error-feedback residuals cannot be rebuilt from the log: a resume from this snapshot restarts them.
        extra={"compacted": True, "compressor_state_exact": rec.compressor_state_exact,
               "data": encode_value(rec.data),
               "end_groups": None if rec.end_groups is None else [encode_value(g) for g in rec.end_groups]},
        rng=dict(rec.rng),
    )
