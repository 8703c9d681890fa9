"""Balanced assignment of named tensors to bins: writing ranks (sharded persistence) and replay workers."""

from __future__ import annotations


def partition_by_size(sizes: dict[str, int], bins: int) -> list[list[str]]:
    """Greedy largest-first into the least-loaded bin; deterministic (ties by name), so every rank computes
    the same assignment without communicating. Empty bins are kept (a rank may own nothing)."""
    out: list[list[str]] = [[] for _ in range(bins)]
    load = [0] * bins
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = load.index(min(load))
        out[i].append(name)
        load[i] += max(sizes[name], 1)
    return out
