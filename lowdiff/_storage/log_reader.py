"""Which states a run directory can rebuild: snapshots plus contiguous chains of committed segments."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

from lowdiff._storage.format import FileSet, list_segments, list_snapshots
from lowdiff.errors import StepNotAvailableError


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
    treated as missing. A chain ends before the first step two segments hold (:func:`contested`): a writer
    never writes a step twice, so one of them comes from another history (a file moved to ``quarantine/`` by a
    resume and put back, a restored backup), and which one is not knowable from the files."""
    segments = [Segment(f, la, p) for f, la, p in list_segments(run_dir) if not set(p.paths) & exclude]
    firsts = [s.first for s in segments]
    before = _reach_before(segments)
    out = []
    for step, files in sorted(list_snapshots(run_dir).items(), reverse=True):
        if set(files.paths) & exclude:
            continue
        chain: list[Segment] = []
        end = step
        while True:
            i = bisect.bisect_right(firsts, end + 1) - 1  # the last segment starting at or before end + 1
            if i < 0 or segments[i].last < end + 1 or before[i] >= end + 1:
                break  # no segment holds step end + 1, or two do
            seg = segments[i]
            later = segments[i + 1].first if i + 1 < len(segments) else None
            if later is not None and later <= seg.last:  # the next segment holds seg's steps from there on
                if later > end + 1:
                    chain.append(seg)
                    end = later - 1
                break
            chain.append(seg)
            end = seg.last
        out.append(Chain(step, files, tuple(chain), end))
    return out


def _reach_before(segments: list[Segment]) -> list[int]:
    """Per segment (sorted by first step), the last step any segment before it holds (-1 for none)."""
    out, reach = [], -1
    for s in segments:
        out.append(reach)
        reach = max(reach, s.last)
    return out


def contested(run_dir: Path, exclude: frozenset[Path] = frozenset()) -> list[tuple[Segment, Segment]]:
    """Pairs of committed segments that hold a step in common (never written so; :func:`chains`); files in
    ``exclude`` (known damaged) are treated as missing."""
    segments = [Segment(f, la, p) for f, la, p in list_segments(run_dir) if not set(p.paths) & exclude]
    out = []
    for i, a in enumerate(segments):
        for b in segments[i + 1:]:  # sorted by first step: the rest start later still
            if b.first > a.last:
                break
            out.append((a, b))
    return out


def contested_note(a: Segment, b: Segment) -> str:
    """What to tell the user about two segments holding the same steps (``a`` starting first)."""
    return (f"steps {b.first}-{min(a.last, b.last)} are held by two segments, {a.files.name} and {b.files.name}: one "
            "is from another history (a file put back from quarantine/, a restored backup, another copy of the run); "
            f"recovery goes no further than step {b.first - 1} along them. Move the one that does not belong out of "
            "log/")


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
