"""Which states a run directory can rebuild: snapshots plus contiguous chains of committed segments."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lowdiff.errors import StepNotAvailableError
from lowdiff.storage.format import FileSet, list_segments, list_snapshots


@dataclass(frozen=True)
class Segment:
    first: int
    last: int
    files: FileSet


@dataclass(frozen=True)
class Chain:
    """A snapshot and the segments that extend it contiguously to ``end``."""

    snapshot_step: int
    snapshot: FileSet
    segments: tuple[Segment, ...]
    end: int

    def segments_to(self, target: int) -> list[Segment]:
        return [s for s in self.segments if s.first <= target]


def chains(run_dir: Path, exclude: frozenset[Path] = frozenset()) -> list[Chain]:
    """One chain per committed snapshot, newest snapshot first; files in ``exclude`` (known damaged) are
    treated as missing."""
    segments = [Segment(f, la, p) for f, la, p in list_segments(run_dir) if not set(p.paths) & exclude]
    out = []
    for step, files in sorted(list_snapshots(run_dir).items(), reverse=True):
        if set(files.paths) & exclude:
            continue
        chain: list[Segment] = []
        end = step
        for seg in segments:
            if seg.first <= end + 1 <= seg.last:
                chain.append(seg)
                end = seg.last
        out.append(Chain(step, files, tuple(chain), end))
    return out


def candidates_for(run_dir: Path, target: int | None, exclude: frozenset[Path] = frozenset()
                   ) -> tuple[int, list[Chain]]:
    """(target, chains able to reach it, newest snapshot first); raises if none can."""
    cs = chains(run_dir, exclude)
    if not cs:
        raise StepNotAvailableError(f"{run_dir}: no committed snapshot; nothing to recover")
    if target is None:
        target = max(c.end for c in cs)
    if target < 0:
        raise StepNotAvailableError(f"step must be >= 0, got {target}")
    ok = [c for c in cs if c.snapshot_step <= target <= c.end]
    if not ok:
        latest = max(c.end for c in cs)
        raise StepNotAvailableError(f"{run_dir}: step {target} is not recoverable; the log reaches step {latest} "
                                    f"(snapshots at {sorted(c.snapshot_step for c in cs)[:8]})")
    return target, ok
