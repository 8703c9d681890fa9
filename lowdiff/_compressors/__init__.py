"""Gradient compressors. Each module has a ``compress`` side (with error feedback) and ONE pure ``decode``.

Training and recovery both call :func:`decode_payload`, so the tensor the optimizer consumed during training
and the tensor replay feeds it are produced by the same code. A payload is a dict of named tensors:

- ``{"values", "indices"}``: Top-k (values in the gradient dtype, sorted int32 flat indices);
- ``{"p", "q"}``: PowerSGD rank-r factors, gradient = p @ q.T reshaped;
- ``{"full"}``: the whole gradient (compressor none, and tensors PowerSGD sends uncompressed).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lowdiff._compressors import powersgd, topk
from lowdiff._compressors.base import Compressor, Payload
from lowdiff.errors import CorruptFileError

__all__ = ["Compressor", "Payload", "decode_payload", "make_compressor", "PAYLOAD_FIELDS"]

# The field sets a payload may have; anything else in a log is rejected.
PAYLOAD_FIELDS: tuple[frozenset[str], ...] = (
    frozenset({"values", "indices"}),
    frozenset({"p", "q"}),
    frozenset({"full"}),
)


def decode_payload(payload: Mapping[str, torch.Tensor], shape: torch.Size | tuple[int, ...], *,
                   trusted: bool = False) -> torch.Tensor:
    """The dense gradient a payload stands for, with the parameter's ``shape``. Pure and deterministic.

    ``trusted``: the payload was just produced by a compressor, not read from a file; skips the checks of
    index ranges that would each cost a device synchronization on a GPU. The result is the same."""
    keys = frozenset(payload)
    if keys == PAYLOAD_FIELDS[0]:
        return topk.decode(payload["values"], payload["indices"], shape, check_range=not trusted)
    if keys == PAYLOAD_FIELDS[1]:
        return powersgd.decode(payload["p"], payload["q"], shape)
    if keys == PAYLOAD_FIELDS[2]:
        full = payload["full"]
        if full.numel() != _numel(shape):
            raise CorruptFileError(f"full gradient has {full.numel()} elements, parameter shape is {tuple(shape)}")
        return full.reshape(shape)
    raise CorruptFileError(f"unknown payload fields {sorted(keys)}; expected one of "
                           f"{[sorted(f) for f in PAYLOAD_FIELDS]}")


def _numel(shape: torch.Size | tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def make_compressor(name: str, *, ratio: float = 0.01, rank: int = 4, error_feedback: bool = True) -> Compressor:
    """The compressor named in the config (``compressor.name``)."""
    if name == "topk":
        return topk.TopKCompressor(ratio=ratio, error_feedback=error_feedback)
    if name == "powersgd":
        return powersgd.PowerSGDCompressor(rank=rank, error_feedback=error_feedback)
    if name == "none":
        from lowdiff._compressors.identity import IdentityCompressor

        return IdentityCompressor()
    raise ValueError(f"unknown compressor {name!r}; allowed: topk, powersgd, none")
