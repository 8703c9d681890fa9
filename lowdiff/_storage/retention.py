"""Retention: how many snapshots to keep, and which log segments they still need."""

from __future__ import annotations

from pathlib import Path

from lowdiff._storage.atomic import remove_quietly
from lowdiff._storage.format import list_segments, list_snapshots


def apply_retention(root: Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` snapshots; delete older ones and segments ending at or before the oldest kept
    snapshot. The log is deleted first: a snapshot without older log is still a base, the reverse is not."""
    snaps = list_snapshots(root)
    steps = sorted(snaps)
    if len(steps) <= keep:
        return []
    oldest_kept = steps[-keep]
    removed = []
    for _first, last, files in list_segments(root):
        if last <= oldest_kept:
            for path in files.paths:
                remove_quietly(path)
                removed.append(path)
    for s in steps[:-keep]:
        for path in snaps[s].paths:
            remove_quietly(path)
            removed.append(path)
    return removed
