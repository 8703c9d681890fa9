"""How replay runs: sizes that trade speed for nothing else, and a seam for fault injection in tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """Passed as ``lowdiff.recover(..., options=ReplayOptions(...))``; the defaults are what users want. None of
    them changes a recovered bit (tests run with tiny chunks to split every tensor of their small models)."""

    chunk_elems: int = 1 << 16
    """Elements per cache block of an element-wise optimizer's step (rounded down to a multiple of 4096 when at
    least 4096): 64 K float32 = 256 KB per tensor, so a chunk's working set stays within L2/L3."""
    sqrt_min_elems: int = 256
    """Tensors smaller than this take torch's plain sqrt instead of lowdiff._recovery.exact_sqrt's zero path."""
    before_read: Callable[[Path], None] | None = None
    """Called with the path of each snapshot or segment file just before recovery reads it: a seam for tests to
    make files vanish or fail (raise ``lowdiff.errors.FileVanishedError`` or ``CorruptFileError`` there). Never set
    in production."""
    on_worker_start: Callable[[int], None] | None = None
    """Called first in each replay worker process with its index (>= 1): a seam for tests to make a worker fail
    or die. Never set in production."""

    def __post_init__(self) -> None:
        if self.chunk_elems < 1 or self.sqrt_min_elems < 1:
            raise ValueError(f"chunk_elems and sqrt_min_elems must be >= 1, got {self.chunk_elems}, "
                             f"{self.sqrt_min_elems}")


DEFAULT_OPTIONS = ReplayOptions()
