"""``lowdiff.inspect``: what a run directory holds, without replaying anything."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowdiff._storage.format import STOP_DIR, FileSet, list_segments, list_snapshots
from lowdiff._storage.layout import for_files, layouts
from lowdiff._storage.log_reader import chains
from lowdiff._storage.manifest import Manifest, read_manifest
from lowdiff._storage.remote import fetched, is_url, name_remote
from lowdiff._storage.run_dir import DECISIONS_FILE
from lowdiff._storage.segment_reader import SegmentReader
from lowdiff.errors import LowDiffError


@dataclass(frozen=True)
class RunInfo:
    """A summary of a run directory (:func:`inspect`). Step ranges come from file names: ``latest_step`` assumes
    the files are intact (:func:`lowdiff.verify` checks that)."""

    run_dir: Path | str
    manifest: Manifest
    snapshot_steps: list[int]
    snapshot_bytes: int
    segments: list[tuple[int, int]]
    """(first step, last step) of each committed segment, in order."""
    log_bytes: int
    latest_step: int | None
    """The newest step a snapshot and a contiguous log reach (None: no snapshot)."""
    tuner_decisions: list[dict[str, Any]] = field(default_factory=list)
    tuner_error: str | None = None
    """Why ``tuner.json`` could not be read (None: read, or absent)."""
    stop_steps: list[int] = field(default_factory=list)
    """Steps a clean stop saved the compressor's memory at (FORMAT.md section 4a): a resume there is exact."""
    log_compressor: tuple[str, dict[str, Any]] | None = None
    """The compressor (name, ``ratio``/``rank``) the newest segment was written with; it differs from the
    manifest's when a resume changed the compressor (None: no readable segment)."""

    def summary(self) -> str:
        m, cfg = self.manifest, self.manifest.config
        comp = cfg.get("compressor", {})
        lines = [
            f"run {self.run_dir}",
            f"  model: {len(m.params)} parameters ({sum(p.numel for p in m.params):,} elements), "
            f"{len(m.buffers)} buffers",
            f"  optimizer: {m.optimizer_class}, {len(m.param_groups)} group(s)",
            *([f"  sharded (fully_shard) on {', '.join(str(n) for n in sorted(layouts(m.sharding)))} ranks"]
              if m.sharding else []),
            f"  compressor: {_compressor(str(comp.get('name')), comp)}; codec {cfg.get('log', {}).get('codec')}",
            f"  snapshots: {len(self.snapshot_steps)} at steps {_ranges(self.snapshot_steps)} "
            f"({self.snapshot_bytes / 1e6:.2f} MB)",
        ]
        if self.log_compressor is not None and self.log_compressor != (comp.get("name"), _params(comp)):
            lines.append(f"  compressor of the newest segment: {_compressor(*self.log_compressor)} (changed on a "
                         "resume; the manifest keeps the run's first configuration)")
        if self.segments:
            first, last = self.segments[0][0], self.segments[-1][1]
            lines.append(f"  log: {len(self.segments)} segments, steps {first}..{last} ({self.log_bytes / 1e6:.2f} MB, "
                         f"{self.log_bytes / max(1, last - first + 1) / 1e3:.1f} kB/step)")
        else:
            lines.append("  log: empty")
        if self.latest_step is not None:
            lines.append(f"  latest recoverable step: {self.latest_step}")
        if self.stop_steps:
            lines.append(f"  clean stop at step {_ranges(self.stop_steps)}: the compressor's memory is saved there, "
                         "so a resume at that step is exact")
        if self.tuner_error is not None:
            lines.append(f"  tuner decisions: unreadable {DECISIONS_FILE} ({self.tuner_error})")
        elif self.tuner_decisions:
            lines.append("  tuner decisions:\n" + format_decisions(self.tuner_decisions))
        return "\n".join(lines)


def inspect(run_dir: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> RunInfo:
    """Summarize ``run_dir``: model, optimizer, compressor, snapshots, log, latest recoverable step, tuner
    decisions. Reads the manifest, file names and the newest segment's header only (fast on any size of run).

    >>> print(lowdiff.inspect("runs/exp1").summary())   # doctest: +SKIP
    """
    if is_url(run_dir):  # fetched into a temporary directory and read there (lowdiff._storage.remote)
        with fetched(str(run_dir), storage_options) as local:
            try:
                return dataclasses.replace(inspect(local), run_dir=str(run_dir))
            except LowDiffError as e:
                name_remote(e, local, str(run_dir))
                raise
    root = Path(run_dir)
    manifest = read_manifest(root)
    snaps = list_snapshots(root)
    segs = list_segments(root)
    cs = chains(root)
    decisions: list[dict[str, Any]] = []
    error = None
    path = root / DECISIONS_FILE
    if path.is_file():
        try:
            decisions = list(json.loads(path.read_text())["decisions"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            error = str(e)
    return RunInfo(run_dir=root, manifest=manifest, snapshot_steps=sorted(snaps),
                   stop_steps=sorted(list_snapshots(root, STOP_DIR)),
                   log_compressor=_newest_compressor(manifest, segs),
                   snapshot_bytes=sum(f.nbytes for f in snaps.values()),
                   segments=[(a, b) for a, b, _ in segs], log_bytes=sum(f.nbytes for _, _, f in segs),
                   latest_step=max(c.end for c in cs) if cs else None, tuner_decisions=decisions,
                   tuner_error=error)


def _newest_compressor(manifest: Manifest, segs: list[tuple[int, int, FileSet]]) -> tuple[str, dict[str, Any]] | None:
    """What the newest segment that opens says it was compressed with (its header only; no payload is read)."""
    for first, last, files in reversed(segs):
        try:
            reader = SegmentReader(files, for_files(manifest, files), first, last)
        except LowDiffError:
            continue
        try:
            return reader.compressor, _params(reader.compressor_params)
        finally:
            reader.close()
    return None


def _params(comp: dict[str, Any]) -> dict[str, Any]:
    return {k: comp.get(k) for k in ("ratio", "rank")}


def _compressor(name: str, comp: dict[str, Any]) -> str:
    return f"{name} (ratio {comp.get('ratio')}, rank {comp.get('rank')})"


def _ranges(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps)) or "-"
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}"


def format_decisions(decisions: Iterable[Mapping[str, Any]]) -> str:
    """Human-readable table of decisions as stored by :meth:`Decision.to_dict` (for ``lowdiff inspect``)."""
    rows = []
    for d in decisions:
        c = d.get("costs", {})
        if d.get("probe_steps"):
            rows.append(
                f"  step {d.get('step')}: PROBE for {d.get('probe_steps')} steps, every_steps={d.get('every_steps')} "
                f"batch_steps={d.get('batch_steps')} ({d.get('reason')}; durability lag up to "
                f"{d.get('batch_steps')} steps meanwhile, nothing skipped)")
            continue
        rows.append(
            f"  step {d.get('step')}: every_steps={d.get('every_steps')} batch_steps={d.get('batch_steps')} "
            f"waste {d.get('waste_s_per_hour', float('nan')):.2f} s/h, overhead {d.get('overhead', 0):.2%} "
            f"({d.get('reason')}; T={c.get('iteration_s', 0) * 1e3:.3g} ms, "
            f"BW_w={_bytes(c.get('write_bytes_per_s', 0))}/s, l_w={c.get('write_latency_s', 0) * 1e3:.3g} ms)"
            + ("" if d.get("feasible", True) else " LIMITS NOT MET")
        )
    return "\n".join(rows) if rows else "  (no tuner decisions)"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"
