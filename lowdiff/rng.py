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
import sys
from collections.abc import Iterable, Mapping
from typing import cast

import numpy as np
import torch

from lowdiff.errors import CorruptFileError, UnsupportedError

log = logging.getLogger(__name__)

TORCH = "torch"
NUMPY = "numpy"
PYTHON = "python"
CUDA_PREFIX = "cuda/"

_MT_WORDS = 624
_NUMPY_TAIL = struct.Struct("<qqd")  # pos, has_gauss, cached_gaussian
_PYTHON_TAIL = struct.Struct("<qd")  # has_gauss_next, gauss_next
NUMPY_NBYTES = _MT_WORDS * 4 + _NUMPY_TAIL.size
PYTHON_NBYTES = (_MT_WORDS + 1) * 4 + _PYTHON_TAIL.size
_PYTHON_WORDS = struct.Struct(f"<{_MT_WORDS + 1}I")


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


def _numpy_state() -> torch.Tensor:
    raw = _NUMPY_READER.read()
    return _bytes_tensor(raw) if raw is not None else _numpy_state_slow()


def _numpy_state_slow() -> torch.Tensor:
    return _bytes_tensor(_legacy_bytes(np.random.get_state(legacy=True)))


def _legacy_bytes(state: object) -> bytes:
    """A ``RandomState.get_state(legacy=True)`` tuple in the NUMPY layout (FORMAT.md §7)."""
    name, key, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", state)
    if name != "MT19937" or key.shape != (_MT_WORDS,):
        raise UnsupportedError(f"numpy's global generator is {name}; lowdiff records MT19937 only")
    return key.astype("<u4").tobytes() + _NUMPY_TAIL.pack(int(pos), int(has_gauss), float(cached))


class _NumpyReader:
    """Reads numpy's global ``RandomState`` straight from its memory, in :func:`_numpy_state_slow`'s byte layout.

    ``get_state()`` copies the 624 key words one at a time in Python-level code: 53 us warm, ~170 us on a fast
    training step (the largest part of lowdiff's fixed cost per step). The same bytes lie in the bit generator's
    C struct (``ctypes.state_address``: 624 x uint32 key, int pos) and in the ``RandomState`` object itself (the
    legacy gaussian cache: ``aug_bitgen_t {bitgen_t *; int has_gauss; double gauss}``, at an offset found once
    by looking for the pointer to the object's own bitgen). That offset is trusted only after reads of a private
    ``RandomState`` matched ``get_state()`` through states with and without a cached gaussian, and every
    CHECK_EVERY reads of the global one are compared with ``get_state()`` again; any doubt (another numpy, a
    big-endian machine, a replaced generator, a mismatch) falls back to ``get_state()`` for good."""

    CHECK_EVERY = 512

    def __init__(self) -> None:
        self._offset: int | None = None
        self._tried = False
        self._reads = 0

    def read(self) -> bytes | None:
        """The global generator's state as NUMPY_NBYTES bytes, or None: use ``get_state()``."""
        if not self._tried:
            self._tried = True
            self._offset = self._find_offset()
        offset = self._offset  # once: another thread may give the direct read up meanwhile
        if offset is None:
            return None
        rs = getattr(np.random.get_state, "__self__", None)  # the generator np.random's functions draw from
        if type(rs) is not np.random.RandomState or type(rs._bit_generator) is not np.random.MT19937:
            return None
        with rs._bit_generator.lock:  # the lock RandomState draws under
            raw = self._read(rs, offset)
        self._reads += 1
        if self._reads % self.CHECK_EVERY == 1 and not self._agrees(rs, offset):
            log.error("lowdiff: reading numpy's generator state directly disagreed with get_state(); "
                      "using get_state() from now on")
            self._offset = None
            return None
        return raw

    def _agrees(self, rs: np.random.RandomState, offset: int) -> bool:
        """The direct read equals ``get_state()``. ``get_state()`` takes the generator's lock itself, so another
        thread may draw between it and the read: a difference is looked at again before it counts."""
        for _ in range(3):
            slow = _legacy_bytes(np.random.get_state(legacy=True))
            with rs._bit_generator.lock:
                if self._read(rs, offset) == slow:
                    return True
        return False

    @staticmethod
    def _read(rs: np.random.RandomState, offset: int) -> bytes:
        key_pos = ctypes.string_at(rs._bit_generator.ctypes.state_address, _MT_WORDS * 4 + 4)
        pos = int.from_bytes(key_pos[-4:], sys.byteorder, signed=True)
        base = id(rs) + offset
        has_gauss = ctypes.c_int.from_address(base + 8).value
        gauss = ctypes.c_double.from_address(base + 16).value
        return key_pos[:-4] + _NUMPY_TAIL.pack(pos, has_gauss, gauss)

    @classmethod
    def _find_offset(cls) -> int | None:
        if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
            return None
        try:
            probe = np.random.RandomState(12345)
            size = type(probe).__basicsize__
            base = id(probe)
            found = [o for o in range(0, size - 24, 8)
                     if base < (ctypes.c_void_p.from_address(base + o).value or 0) < base + size]
            if len(found) != 1:
                return None
            offset = found[0]
            for draws in (0, 1, 2, 3, 700):  # an odd number of normals leaves a cached gaussian
                probe.standard_normal(draws)
                if cls._read(probe, offset) != _legacy_bytes(probe.get_state(legacy=True)):
                    return None
            return offset
        except Exception as e:  # any surprise in numpy's internals: the documented way stays
            log.debug("lowdiff: reading numpy's generator state directly is not possible here (%s)", e)
            return None


_NUMPY_READER = _NumpyReader()


def _python_state() -> torch.Tensor:
    version, words, gauss_next = random.getstate()
    if version != 3 or len(words) != _MT_WORDS + 1:
        raise UnsupportedError(f"python random state version {version} with {len(words)} words is not supported")
    tail = _PYTHON_TAIL.pack(gauss_next is not None, 0.0 if gauss_next is None else float(gauss_next))
    return _bytes_tensor(_PYTHON_WORDS.pack(*words) + tail)


def capture(rank: int | None = None, cuda_devices: Iterable[int] = ()) -> dict[str, torch.Tensor]:
    """The state of every RNG source now, by entry name (prefixed with ``rank_prefix(rank)``).

    Costs ~0.1 ms (numpy's ``get_state`` is most of it); the tensors are fresh CPU copies."""
    p = rank_prefix(rank)
    out = {p + TORCH: torch.get_rng_state()}
    for index in cuda_devices:
        out[f"{p}{CUDA_PREFIX}{index}"] = torch.cuda.get_rng_state(index).cpu()
    out[p + NUMPY] = _numpy_state()
    out[p + PYTHON] = _python_state()
    return out


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
