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
from lowdiff.errors import CorruptFileError, UnsupportedError

log = logging.getLogger(__name__)

# The sources and the sizes of their states are the format's (lowdiff._storage.tensors, which validates them).
TORCH, NUMPY, PYTHON, CUDA_PREFIX = RNG_TORCH, RNG_NUMPY, RNG_PYTHON, RNG_CUDA_PREFIX
NUMPY_NBYTES, PYTHON_NBYTES = RNG_NUMPY_NBYTES, RNG_PYTHON_NBYTES
_MT_WORDS = MT_WORDS
_NUMPY_TAIL = NUMPY_TAIL
_PYTHON_TAIL = PYTHON_TAIL
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


def _numpy_bytes() -> bytes:
    raw = _NUMPY_READER.read()
    return raw if raw is not None else _legacy_bytes(np.random.get_state(legacy=True))


def _legacy_bytes(state: object) -> bytes:
    """A ``RandomState.get_state(legacy=True)`` tuple in the NUMPY layout (FORMAT.md §7)."""
    name, key, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", state)
    if name != "MT19937" or key.shape != (_MT_WORDS,):
        raise UnsupportedError(f"numpy's global generator is {name}; lowdiff records MT19937 only")
    return key.astype("<u4").tobytes() + _NUMPY_TAIL.pack(int(pos), int(has_gauss), float(cached))


_GAUSS = struct.Struct("<i4xd")  # numpy's aug_bitgen_t after its bitgen pointer: int has_gauss, double gauss


class _DirectReader:
    """Reads a generator's state straight from its memory instead of through ``get_state()`` / ``getstate()``,
    which build a Python object per state word (624 of them): 30-70 us per step on a fast training step, where
    the direct read is one or two memory copies. Subclasses say where the bytes lie; the layout is trusted only
    after reads of a private generator matched the documented call through varied states, and every CHECK_EVERY
    reads of the global one are compared with it again; any doubt (another interpreter or numpy, a big-endian
    machine, a replaced generator, a mismatch) falls back to the documented call for good."""

    CHECK_EVERY = 512
    what = ""

    def __init__(self) -> None:
        self._offset: int | None = None
        self._tried = False
        self._reads = 0

    def read(self) -> bytes | None:
        """The global generator's state in its FORMAT.md layout, or None: use the documented call."""
        if not self._tried:
            self._tried = True
            if sys.byteorder == "little" and ctypes.sizeof(ctypes.c_void_p) == 8 \
                    and sys.implementation.name == "cpython":
                try:
                    self._offset = self._find_offset()
                except Exception as e:  # any surprise in the internals: the documented way stays
                    log.debug("lowdiff: reading %s directly is not possible here (%s)", self.what, e)
        offset = self._offset  # once: another thread may give the direct read up meanwhile
        if offset is None:
            return None
        gen = self._global()
        if gen is None:
            return None
        raw = self._read(gen, offset)
        self._reads += 1
        if self._reads % self.CHECK_EVERY == 1 and not self._agrees(gen, offset):
            log.error("lowdiff: reading %s directly disagreed with its documented state; using that from now on",
                      self.what)
            self._offset = None
            return None
        return raw

    def _agrees(self, gen: object, offset: int) -> bool:
        """The direct read equals the documented call. Another thread may draw between the two, so a difference
        is looked at again before it counts."""
        for _ in range(3):
            if self._read(gen, offset) == self._documented(gen):
                return True
        return False

    def _global(self) -> object | None:
        raise NotImplementedError

    def _read(self, gen: object, offset: int) -> bytes:
        raise NotImplementedError

    def _documented(self, gen: object) -> bytes:
        raise NotImplementedError

    def _find_offset(self) -> int | None:
        raise NotImplementedError


class _NumpyReader(_DirectReader):
    """numpy's global ``RandomState``: its key and pos lie in the bit generator's C struct
    (``ctypes.state_address``: 624 x uint32 key, int pos), the legacy gaussian cache in the ``RandomState`` object
    itself (``aug_bitgen_t {bitgen_t *; int has_gauss; double gauss}``, at an offset found once by looking for the
    pointer to the object's own bitgen)."""

    what = "numpy's generator state"

    def _global(self) -> object | None:
        rs = getattr(np.random.get_state, "__self__", None)  # the generator np.random's functions draw from
        if type(rs) is not np.random.RandomState or type(rs._bit_generator) is not np.random.MT19937:
            return None
        return rs

    _views: tuple[Any, ...] = (None,)
    """(generator, its bit generator, the lock, ctypes arrays over its key and pos and over its gaussian cache):
    built once per generator, so a read is two buffer copies without a foreign-function call (the generator is
    kept alive by this reference, so its memory stays where the arrays point)."""

    def _read(self, gen: object, offset: int) -> bytes:
        rs = cast(np.random.RandomState, gen)
        views = self._views
        if views[0] is not rs or views[1] is not rs._bit_generator or views[2] != offset:
            bitgen = rs._bit_generator
            views = self._views = (rs, bitgen, offset, bitgen.lock,
                                   (ctypes.c_char * (_MT_WORDS * 4 + 4)).from_address(bitgen.ctypes.state_address),
                                   (ctypes.c_char * _GAUSS.size).from_address(id(rs) + offset + 8))
        with views[3]:  # the lock RandomState draws under
            key_pos, gauss_raw = views[4].raw, views[5].raw
        has_gauss, gauss = _GAUSS.unpack(gauss_raw)
        pos = int.from_bytes(key_pos[-4:], sys.byteorder, signed=True)
        return key_pos[:-4] + _NUMPY_TAIL.pack(pos, has_gauss, gauss)

    def _documented(self, gen: object) -> bytes:
        get_state = np.random.get_state  # the global generator's through np.random, as a user's code sees it
        if getattr(get_state, "__self__", None) is not gen:
            get_state = cast(np.random.RandomState, gen).get_state
        return _legacy_bytes(get_state(legacy=True))

    def _find_offset(self) -> int | None:
        probe = np.random.RandomState(12345)
        size = type(probe).__basicsize__
        base = id(probe)
        found = [o for o in range(0, size - 24, 8)
                 if base < (ctypes.c_void_p.from_address(base + o).value or 0) < base + size]
        if len(found) != 1:
            return None
        for draws in (0, 1, 2, 3, 700):  # an odd number of normals leaves a cached gaussian
            probe.standard_normal(draws)
            if self._read(probe, found[0]) != self._documented(probe):
                return None
        return found[0]


class _PythonReader(_DirectReader):
    """The ``random`` module's generator: CPython's ``RandomObject {PyObject_HEAD; int index; uint32_t
    state[624]}`` (the offset of ``index`` found once, right after the object header, and trusted only once
    reads matched ``getstate()``), with ``gauss_next`` from the Python-level object."""

    what = "Python's random state"

    def _global(self) -> object | None:
        inst = getattr(random.getstate, "__self__", None)  # the generator random's functions draw from
        return inst if type(inst) is random.Random else None

    _views: tuple[Any, ...] = (None,)
    """(generator, offset, a ctypes array over its index and state words), built once per generator."""

    def _read(self, gen: object, offset: int) -> bytes:
        r = cast(random.Random, gen)
        views = self._views
        if views[0] is not r or views[1] != offset:
            views = self._views = (r, offset, (ctypes.c_char * (4 + _MT_WORDS * 4)).from_address(id(r) + offset))
        index_state = views[2].raw  # holding the GIL: no draw interleaves
        gauss_next = r.gauss_next  # type: ignore[attr-defined]  # set by Random.__init__, not in the stubs
        return index_state[4:] + index_state[:4] + _PYTHON_TAIL.pack(gauss_next is not None,
                                                                     0.0 if gauss_next is None else gauss_next)

    def _documented(self, gen: object) -> bytes:
        getstate = random.getstate if getattr(random.getstate, "__self__", None) is gen else \
            cast(random.Random, gen).getstate
        return _python_bytes(getstate())

    def _find_offset(self) -> int | None:
        if not getattr(sys, "_is_gil_enabled", lambda: True)():
            return None  # free-threaded: another thread's draw may interleave with the copy (numpy's has a lock)
        probe = random.Random(12345)
        offset = object.__basicsize__  # PyObject_HEAD; its size differs on free-threaded builds
        if type(probe).__basicsize__ < offset + 4 + _MT_WORDS * 4:
            return None
        for draws, gauss in ((0, False), (1, False), (623, True), (624, False), (1000, True)):
            for _ in range(draws):
                probe.random()
            if gauss:
                probe.gauss(0.0, 1.0)  # leaves gauss_next set
            if self._read(probe, offset) != self._documented(probe):
                return None
        return offset


_NUMPY_READER = _NumpyReader()
_PYTHON_READER = _PythonReader()


def _python_bytes(state: tuple[int, tuple[int, ...], float | None]) -> bytes:
    version, words, gauss_next = state
    if version != 3 or len(words) != _MT_WORDS + 1:
        raise UnsupportedError(f"python random state version {version} with {len(words)} words is not supported")
    tail = _PYTHON_TAIL.pack(gauss_next is not None, 0.0 if gauss_next is None else float(gauss_next))
    return _PYTHON_WORDS.pack(*words) + tail


def _python_state_bytes() -> bytes:
    raw = _PYTHON_READER.read()
    return raw if raw is not None else _python_bytes(random.getstate())


class Captured(dict[str, torch.Tensor]):
    """What :func:`capture` returns: the states as tensors, and ``raw``, the same bytes (what a message to the
    persistence process carries, without going back from the tensors)."""

    __slots__ = ("raw",)

    def __init__(self, raw: dict[str, bytes]) -> None:
        super().__init__((k, _bytes_tensor(v)) for k, v in raw.items())
        self.raw = raw


def capture(rank: int | None = None, cuda_devices: Iterable[int] = ()) -> dict[str, torch.Tensor]:
    """The state of every RNG source now, by entry name (prefixed with ``rank_prefix(rank)``).

    Costs a few tens of microseconds; the tensors are fresh CPU copies."""
    return dict(capture_raw(rank, cuda_devices))


def capture_raw(rank: int | None = None, cuda_devices: Iterable[int] = ()) -> Captured:
    """:func:`capture`, keeping the bytes the tensors were made from (what lowdiff's stager takes: the message to
    the persistence process carries them). A plain dict is what to save or pickle."""
    p = rank_prefix(rank)
    raw = {p + TORCH: torch.get_rng_state().numpy().tobytes()}
    for index in cuda_devices:
        raw[f"{p}{CUDA_PREFIX}{index}"] = torch.cuda.get_rng_state(index).cpu().numpy().tobytes()
    raw[p + NUMPY] = _numpy_bytes()
    raw[p + PYTHON] = _python_state_bytes()
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
