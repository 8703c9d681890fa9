"""What tensors a run directory may hold, beyond shape and dtype matching the manifest: optimizer and compressor
state in a snapshot, and the bounds of each logged payload (docs/reference/FORMAT.md sections 4, 5, 8). Every
bound here is known before a byte of the tensor is read."""

from __future__ import annotations

import math
import re
import struct
from functools import lru_cache
from typing import Any

import torch

from lowdiff._storage.format import DTYPES
from lowdiff.errors import CorruptFileError

COMPRESSOR_NAMES = frozenset({"topk", "powersgd", "none"})
MAX_STATE_PER_ELEMENT = 4
"""Optimizer state elements per parameter element: no torch.optim optimizer keeps more than 4 tensors per parameter
(Adam with amsgrad: step, exp_avg, exp_avg_sq, max_exp_avg_sq; ASGD: step, eta, mu, ax)."""
MAX_RNG_SOURCES = 256
STATE_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
RNG_SOURCE_RE = re.compile(r"^[A-Za-z0-9_./-]{1,64}$")
COMPRESSOR_KEYS = frozenset({"residual", "q"})
# Compressor fields per payload kind (docs/reference/FORMAT.md section 5) and the compressors that write them.
FIELDS_OF = {"topk": (frozenset({"values", "indices"}),), "powersgd": (frozenset({"p", "q"}), frozenset({"full"})),
             "none": (frozenset({"full"}),)}


def check_state_tensor(t: torch.Tensor, spec: Any, key: str, where: str) -> None:
    """Optimizer tensor state of a parameter: shaped like it and of its dtype (exp_avg, momentum_buffer, ...), or
    a finite one-element counter (step), or a smaller factored statistic in a floating dtype (Adafactor). Which
    keys an optimizer keeps, and of which kind, lowdiff._recovery.optimizers checks with the optimizer itself."""
    if tuple(t.shape) == spec.shape and t.dtype == DTYPES[spec.dtype]:
        return
    if t.numel() == 1:
        if t.dtype == torch.bool or t.dtype.is_complex or not (t.dtype.is_floating_point
                                                              or t.dtype in (torch.int64, torch.int32)):
            raise CorruptFileError(f"{where}: optimizer state {key!r} is {t.dtype}, not a number")
        if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            raise CorruptFileError(f"{where}: optimizer state {key!r} = {t.item()!r} is not finite")
        return
    if tuple(t.shape) == spec.shape:
        raise CorruptFileError(f"{where}: optimizer state {key!r} is {t.dtype}, its parameter {spec.dtype}")
    if not t.dtype.is_floating_point or t.numel() > spec.numel:
        raise CorruptFileError(f"{where}: optimizer state {key!r} is {t.dtype}{list(t.shape)[:8]}, its parameter "
                               f"{spec.dtype}{list(spec.shape)}")


def check_compressor_tensor(t: torch.Tensor, spec: Any, key: str, where: str) -> None:
    """Error-feedback residual (the parameter's elements, flat or as PowerSGD's matrix) or PowerSGD's warm-start Q
    (m x r), in the parameter's dtype."""
    if key not in COMPRESSOR_KEYS or t.dtype != DTYPES[spec.dtype]:
        raise CorruptFileError(f"{where}: compressor state {key[:40]!r} of dtype {t.dtype} is not lowdiff's")
    if key == "residual" and t.numel() != spec.numel:
        raise CorruptFileError(f"{where}: residual has {t.numel()} elements, its parameter {spec.numel}")
    if key == "q":
        dims = _matrix(spec.shape)
        if t.dim() != 2 or dims is None or t.shape[0] != dims[1] or not 1 <= t.shape[1] <= min(dims):
            raise CorruptFileError(f"{where}: PowerSGD Q of shape {list(t.shape)} does not fit {list(spec.shape)}")


def _matrix(shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    return int(shape[0]), math.prod(shape[1:])


# The RNG sources a run directory holds states of (FORMAT.md §7; lowdiff.rng captures and restores them), and
# the layout of the two whose size is fixed: a Mersenne Twister's words, then a tail.
RNG_TORCH, RNG_NUMPY, RNG_PYTHON, RNG_CUDA_PREFIX = "torch", "numpy", "python", "cuda/"
MT_WORDS = 624
NUMPY_TAIL = struct.Struct("<qqd")  # numpy's legacy generator: pos, has_gauss, cached_gaussian
PYTHON_TAIL = struct.Struct("<qd")  # random: has_gauss_next, gauss_next
RNG_NUMPY_NBYTES = MT_WORDS * 4 + NUMPY_TAIL.size
RNG_PYTHON_NBYTES = (MT_WORDS + 1) * 4 + PYTHON_TAIL.size


@lru_cache(maxsize=1)
def _rng_sizes() -> dict[str, int]:
    return {RNG_TORCH: int(torch.get_rng_state().numel()), RNG_NUMPY: RNG_NUMPY_NBYTES,
            RNG_PYTHON: RNG_PYTHON_NBYTES}


def rng_nbytes(name: str) -> int | None:
    """The exact size of a known RNG source's state (docs/reference/FORMAT.md §7; ``rankRRRRR/`` prefixes
    ignored), None for a source whose size this process cannot tell (CUDA, unknown sources: not restored)."""
    source = name.split("/", 1)[1] if name.startswith("rank") and "/" in name else name
    return _rng_sizes().get(source)


def topk_bound(numel: int, ratio: Any, shards: int) -> int:
    """Most values a Top-k payload of a tensor of ``numel`` elements can hold: each of ``shards`` ranks keeps
    k = ceil(ratio x numel) (lowdiff._compressors.topk.k_for), merged as a union; at most ``numel``."""
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio <= 1:
        return min(numel, shards * max(1, min(numel, math.ceil(ratio * numel))))
    return numel


def field_layout(spec: Any, fname: str, inner: Any, rank_bound: int, where: str) -> tuple[int, int]:
    """(elements per row, the most elements a step may hold) of payload field ``fname`` of parameter ``spec``,
    from its stored ``inner_shape``; anything that cannot come from lowdiff's compressors is refused."""
    numel = spec.numel
    if fname in ("values", "indices"):
        if inner != [-1]:
            raise CorruptFileError(f"{where}: a Top-k {fname} column has inner_shape {str(inner)[:40]}, not [-1]")
        return 1, numel
    if fname == "full":
        want = [-1, *spec.shape[1:]] if spec.shape else [-1]
        if inner != want:
            raise CorruptFileError(f"{where}: full gradient of inner_shape {str(inner)[:40]}, expected {want}")
        return max(1, math.prod(spec.shape[1:])) if spec.shape else 1, numel
    dims = _matrix(spec.shape)
    if dims is None or not isinstance(inner, list) or len(inner) != 2 or inner[0] != -1 \
            or not isinstance(inner[1], int) or isinstance(inner[1], bool):
        raise CorruptFileError(f"{where}: PowerSGD factor of inner_shape {str(inner)[:40]} for {list(spec.shape)}")
    n, m = dims
    r = inner[1]
    if not 1 <= r <= min(n, m, rank_bound) or (n + m) * r >= n * m:
        raise CorruptFileError(f"{where}: PowerSGD rank {r} is impossible for {list(spec.shape)} (rank bound "
                               f"{rank_bound})")
    return r, (n if fname == "p" else m) * r
