"""Snapshot 0 holds the state the first step starts from, not merely the state ``wrap()`` saw.

``wrap()`` writes snapshot 0 and commits the run. Code between ``wrap()`` and the first ``opt.step()`` may change
what it holds: weights loaded after wrapping, an optimizer state loaded, a scheduler created on the wrapper (it sets
``lr`` and adds ``initial_lr`` to the groups). Every recovery replays the log from a snapshot, so a stale snapshot 0
is a silently wrong state at every step until the next snapshot. The wrapper keeps a :func:`fingerprint` of what it
wrote and, at the first step, writes snapshot 0 again if the state no longer matches it.

A run resumed at step 0 (it died before its first iteration ended) keeps the live state instead of loading
snapshot 0: nothing was trained, and the restarted script has just built the state again, pretrained weights
included, which snapshot 0 may predate. Snapshot 0 is then always written again at the first step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

REWRITE = object()
"""In place of a fingerprint: write snapshot 0 at the first step whatever the state (resumed at step 0)."""

_SUMMED = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64)


def fingerprint(tensors: Iterable[torch.Tensor], groups: Any) -> tuple[Any, ...]:
    """What changes when the state changes, at the cost of one reduction per tensor: each tensor's identity,
    shape, dtype and version counter (in-place writes bump it; writes through ``.data`` do not) and the exact bits
    of its float64 sum (which such writes change), plus ``groups`` (plain values). A tensor of another dtype
    (complex, quantized) makes the fingerprint unequal to any other: snapshot 0 is then always written again."""
    meta: list[Any] = []
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        t = t.detach()
        meta.append((t.data_ptr(), tuple(t.shape), t.dtype, t._version))
        if t.dtype not in _SUMMED:
            meta.append(object())
            continue
        sums.setdefault(t.device, []).append(t.sum(dtype=torch.float64))
    bits = tuple(torch.stack(s).cpu().numpy().tobytes() for s in sums.values())
    return tuple(meta), bits, repr(groups)
