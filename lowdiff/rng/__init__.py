"""Random number generator state: what a resumed run needs to draw the random numbers the uninterrupted run
would have drawn (dropout masks, noise, anything sampled in the training loop).

Four sources, each captured as ONE uint8 tensor with a fixed little-endian layout (docs/reference/FORMAT.md §7), so a
run directory never holds a pickle:

- ``torch``: the CPU default generator, ``torch.get_rng_state()`` (torch's own byte layout, 5056 bytes);
- ``cuda/<index>``: the default generator of each CUDA device in use, ``torch.cuda.get_rng_state(index)``;
- ``numpy``: numpy's global ``RandomState`` (MT19937): 624 x uint32 key, int64 pos, int64 has_gauss,
  float64 cached_gaussian (2520 bytes);
- ``python``: the ``random`` module: 625 x uint32 (MT state words and index), int64 has_gauss_next,
  float64 gauss_next (2516 bytes).

The wrapper captures them at the end of every ``opt.step()``: state k is the RNG state after optimizer step k,
i.e. exactly what the forward pass of step k+1 starts from. With ``world_size > 1`` every name is prefixed with
``rank<RRRRR>/`` (each rank has its own generators); a resume restores its own rank's entries.

>>> state = lowdiff.rng.capture()          # doctest: +SKIP
>>> lowdiff.rng.restore(state)             # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

from lowdiff._storage.tensors import (
    MT_WORDS,
    NUMPY_TAIL,
    PYTHON_TAIL,
    RNG_CUDA_PREFIX,
    RNG_NUMPY,
    RNG_NUMPY_NBYTES,
    RNG_PYTHON,
    RNG_PYTHON_NBYTES,
    RNG_TORCH,
)
from lowdiff.errors import CorruptFileError
from lowdiff.rng._direct import PYTHON_WORDS, numpy_bytes, python_state_bytes

log = logging.getLogger(__name__)

# The sources and the sizes of their states are the format's (lowdiff._storage.tensors, which validates them).
TORCH, NUMPY, PYTHON, CUDA_PREFIX = RNG_TORCH, RNG_NUMPY, RNG_PYTHON, RNG_CUDA_PREFIX
NUMPY_NBYTES, PYTHON_NBYTES = RNG_NUMPY_NBYTES, RNG_PYTHON_NBYTES
_MT_WORDS = MT_WORDS
_NUMPY_TAIL = NUMPY_TAIL
_PYTHON_TAIL = PYTHON_TAIL
_PYTHON_WORDS = PYTHON_WORDS


def current_rank() -> int | None:
    """This process's rank when torch.distributed runs with more than one process, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return None


def rank_prefix(rank: int | None) -> str:
    """The entry-name prefix of one rank's RNG state ("" for a single process)."""
    return "" if rank is None else f"rank{rank:05d}/"


def cuda_devices_in_use(extra: Iterable[int] = ()) -> list[int]:
    """CUDA devices whose generators matter: the current device and ``extra`` (the model's), and only if CUDA
    is already initialized; capture never initializes CUDA itself (that would create a context on every GPU
    of every rank)."""
    if not torch.cuda.is_initialized():  # implies is_available(), which costs more (it is asked every step)
        return []
    return sorted({torch.cuda.current_device(), *extra})


def _bytes_tensor(buf: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8)


class Captured(dict[str, torch.Tensor]):
    """What :func:`capture_raw` returns: the states as tensors, and ``raw``, the same bytes (what a message to the
    persistence process carries, without going back from the tensors).

    The tensors are made on first use (most captures never need them: a step's record sends the bytes): every way
    of reading or changing the mapping makes them first. Copying or pickling gives a plain dict."""

    __slots__ = ("raw", "_made", "_changed")

    def __init__(self, raw: dict[str, bytes]) -> None:
        super().__init__()
        self.raw = raw
        self._made = False
        self._changed = False

    def unchanged_raw(self) -> dict[str, bytes] | None:
        """``raw`` while the mapping holds exactly the states captured (nothing set or removed since), else None."""
        return None if self._changed else self.raw

    def _make(self) -> None:
        if not self._made:
            self._made = True
            dict.update(self, ((k, _bytes_tensor(v)) for k, v in self.raw.items()))

    def __getitem__(self, key: str) -> torch.Tensor:
        self._make()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        self._make()
        return dict.get(self, key, default)

    def __iter__(self) -> Iterator[str]:
        return dict.__iter__(self) if self._made else iter(self.raw)

    def __len__(self) -> int:
        return dict.__len__(self) if self._made else len(self.raw)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) if self._made else key in self.raw

    def keys(self) -> Any:
        self._make()
        return dict.keys(self)

    def values(self) -> Any:
        self._make()
        return dict.values(self)

    def items(self) -> Any:
        self._make()
        return dict.items(self)

    def copy(self) -> dict[str, torch.Tensor]:
        return dict(self.items())

    def __eq__(self, other: object) -> bool:
        self._make()
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        self._make()
        return dict.__ne__(self, other)

    def __or__(self, other: Any) -> Any:
        return dict(self.items()) | other

    def __ror__(self, other: Any) -> Any:
        return other | dict(self.items())

    def __reversed__(self) -> Iterator[str]:
        return reversed(list(self))

    __hash__ = None

    def __repr__(self) -> str:
        self._make()
        return dict.__repr__(self)

    def __reduce__(self) -> Any:
        return dict, (self.copy(),)


def _changing(name: str) -> Any:
    op = getattr(dict, name)

    def method(self: Captured, *args: Any, **kwargs: Any) -> Any:
        self._make()
        self._changed = True
        return op(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in ("__setitem__", "__delitem__", "__ior__", "pop", "popitem", "setdefault", "update", "clear"):
    setattr(Captured, _name, _changing(_name))


def capture(rank: int | None = None, cuda_devices: Iterable[int] = ()) -> dict[str, torch.Tensor]:
    """The state of every RNG source now, by entry name (prefixed with ``rank_prefix(rank)``).

    Costs a few tens of microseconds; the tensors are fresh CPU copies."""
    return dict(capture_raw(rank, cuda_devices))


_ARRAYS: dict[int, Any] = {}
"""ctypes char array types by length, made once: making one (``c_char * n``) cost more than the copy."""


def _state_bytes(state: torch.Tensor) -> bytes:
    """The bytes of a generator's state (a new contiguous uint8 CPU tensor, as ``get_state()`` returns), copied
    through ctypes: with the caches cold after a training step ``.numpy().tobytes()`` cost about 30 us more."""
    n = state.numel()
    kind = _ARRAYS.get(n)
    if kind is None:
        kind = _ARRAYS[n] = ctypes.c_char * n
    return cast(bytes, kind.from_address(state.data_ptr()).raw)


def capture_raw(rank: int | None = None, cuda_devices: Iterable[int] = ()) -> Captured:
    """:func:`capture`, keeping the bytes the tensors were made from (what lowdiff's stager takes: the message to
    the persistence process carries them). A plain dict is what to save or pickle."""
    p = rank_prefix(rank)
    raw = {p + TORCH: _state_bytes(torch.default_generator.get_state())}  # torch.get_rng_state(), one call less
    for index in cuda_devices:
        raw[f"{p}{CUDA_PREFIX}{index}"] = _state_bytes(torch.cuda.get_rng_state(index).cpu())
    raw[p + NUMPY] = numpy_bytes()
    raw[p + PYTHON] = python_state_bytes()
    return Captured(raw)


def restore(state: Mapping[str, torch.Tensor], rank: int | None = None) -> list[str]:
    """Set every RNG source recorded for ``rank`` in ``state``; returns the sources restored (without prefix).

    Sources the state lacks are left as they are; CUDA devices this process does not have are skipped with a
    warning. Raises :class:`CorruptFileError` when a recorded state has the wrong size or values.
    """
    p = rank_prefix(rank)
    mine = {}
    for name, t in state.items():
        source = name[len(p):]
        # Without a prefix, "rank00001/torch" must not pass for a source; "cuda/0" must.
        if name.startswith(p) and ("/" not in source or source.startswith(CUDA_PREFIX)):
            mine[source] = t
    done: list[str] = []
    for source, t in sorted(mine.items()):
        t = t.detach().cpu()
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise CorruptFileError(f"RNG state {p}{source} must be a 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        buf = t.numpy().tobytes()
        try:
            if source == TORCH:
                torch.set_rng_state(t.clone())
            elif source.startswith(CUDA_PREFIX):
                index = int(source[len(CUDA_PREFIX):])
                if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                    log.warning("lowdiff: RNG state of cuda:%d not restored: this process has no such device", index)
                    continue
                torch.cuda.set_rng_state(t.clone(), index)
            elif source == NUMPY:
                _restore_numpy(buf)
            elif source == PYTHON:
                _restore_python(buf)
            else:
                log.warning("lowdiff: unknown RNG source %r in the run directory; ignored", source)
                continue
        except (RuntimeError, ValueError, TypeError, struct.error) as e:
            raise CorruptFileError(f"RNG state {p}{source} ({len(buf)} bytes) cannot be restored: {e}") from e
        done.append(source)
    return done


def _restore_numpy(buf: bytes) -> None:
    if len(buf) != NUMPY_NBYTES:
        raise ValueError(f"expected {NUMPY_NBYTES} bytes")
    key = np.frombuffer(buf[: _MT_WORDS * 4], dtype="<u4").astype(np.uint32)
    pos, has_gauss, cached = _NUMPY_TAIL.unpack(buf[_MT_WORDS * 4 :])
    np.random.set_state(("MT19937", key, pos, has_gauss, cached))


def _restore_python(buf: bytes) -> None:
    if len(buf) != PYTHON_NBYTES:
        raise ValueError(f"expected {PYTHON_NBYTES} bytes")
    words = _PYTHON_WORDS.unpack(buf[: _PYTHON_WORDS.size])
    has_gauss, gauss_next = _PYTHON_TAIL.unpack(buf[_PYTHON_WORDS.size :])
    random.setstate((3, words, gauss_next if has_gauss else None))


def nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in state.values())


def restore_at_resume(state: Mapping[str, torch.Tensor], rank: int | None, step: int) -> None:
    """What ``opt.resume()`` does: restore this rank's RNG state logged at ``step``, or say why not.

    Not at step 0: no step has drawn anything yet, so the fresh process is already where the run was (the
    state snapshot 0 recorded at ``wrap()`` would undo draws made between ``wrap()`` and ``resume()``)."""
    if step == 0:
        return
    if not state:
        log.warning("lowdiff: no RNG state was logged at step %d (a run from an older lowdiff, or a compacted "
                    "snapshot); random draws after the resume differ from the uninterrupted run", step)
        return
    done = restore(state, rank)
    if TORCH not in done:
        ranks = sorted({n.split("/", 1)[0] for n in state if n.startswith("rank")}) or ["a single process"]
        log.warning("lowdiff: no RNG state for %s at step %d (the run was written by %s); RNG not restored: "
                    "resume with the world size the run was trained with to continue exactly",
                    f"rank {rank}" if rank is not None else "a single process", step, ", ".join(ranks[:4]))
