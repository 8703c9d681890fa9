"""Adam's square root without torch's slow path on zeros, with the same bits (used by replay's chunked steps)."""

from __future__ import annotations

import functools
from typing import Any

import torch

SQRT_MIN_ELEMS = 256
"""Below this many elements the checks cost more than the slow path."""
_TINY32 = torch.finfo(torch.float32).tiny
_TINY32_T = torch.tensor(_TINY32, dtype=torch.float32)
_POW2_75 = 2.0 ** 75


def exact_sqrt(x: torch.Tensor, min_elems: int = SQRT_MIN_ELEMS) -> torch.Tensor:
    """``x.sqrt()`` bit for bit, without the slow path torch's CPU float32 sqrt (MKL VML) takes on exact zeros
    (4-20x slower on tensors with many zeros, as Adam's second moment has under sparse Top-k gradients).

    Only the zeros are swapped out: when ``x`` holds zeros (and no negative or NaN value), each zero is raised to
    the smallest normal float (``c = max(x, tiny - tiny * sign(x))``: every other element is unchanged), the same
    torch sqrt runs over the zero-free ``c``, and ``min(sqrt(c), x * 2**75)`` puts back the zeros with their sign
    while keeping every other element's sqrt (``x * 2**75 > sqrt(x)`` for all ``x >= 2**-149``). Elements do not
    influence each other's sqrt (tests/property/test_replay_chunks.py checks that), so every element gets the
    very bits ``x.sqrt()`` gives it. Other dtypes, devices and autograd take plain ``x.sqrt()``, and so do
    tensors of fewer than ``min_elems`` elements (the checks cost more than the slow path there)."""
    n = x.numel()
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad or n < min_elems \
            or not x.is_contiguous():
        return x.sqrt()
    # The slow path costs per zero: with few zeros (a 1/64 sample says under 1/16) plain sqrt is faster.
    if n >= 4096 and int(torch.count_nonzero(x.view(-1)[::64])) * 16 > (n + 63) // 64 * 15:
        return x.sqrt()
    if x.amin().item() != 0:  # no zeros (or a negative / NaN, which the plain path handles)
        return x.sqrt()
    c = torch.sub(_TINY32_T, x.sign(), alpha=_TINY32)  # tiny where x is +-0, 0 where x > 0 (exact)
    torch.maximum(x, c, out=c)
    c.sqrt_()
    return torch.minimum(c, x.mul(_POW2_75), out=c)


class FastSqrtState(torch.Tensor):
    """An optimizer state tensor whose ``.sqrt()`` is :func:`exact_sqrt`; every other op is plain torch (no
    ``__torch_function__`` overhead). Only the replayer's chunk views are wrapped, and unwrapped on return."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    min_elems = SQRT_MIN_ELEMS

    def sqrt(self) -> torch.Tensor:
        return exact_sqrt(self.as_subclass(torch.Tensor), self.min_elems)


@functools.cache
def fast_sqrt_type(min_elems: int) -> type[FastSqrtState]:
    """:class:`FastSqrtState` with another ``min_elems`` (``ReplayOptions.sqrt_min_elems``)."""
    if min_elems == SQRT_MIN_ELEMS:
        return FastSqrtState
    return type("FastSqrtState", (FastSqrtState,), {"min_elems": min_elems})


def plain(t: Any) -> Any:
    """``t`` unwrapped from :class:`FastSqrtState` (anything else as it is)."""
    return t.as_subclass(torch.Tensor) if isinstance(t, FastSqrtState) else t
