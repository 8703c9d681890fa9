"""Reading numpy's and Python's global generator states in the layout of FORMAT.md §7, straight from the generators'
memory where that is proven to match the documented calls (``get_state()`` / ``getstate()``), which build a Python
object per state word."""

from __future__ import annotations

import ctypes
import logging
import random
import struct
import sys
from typing import Any, cast

import numpy as np

from lowdiff._storage.tensors import MT_WORDS, NUMPY_TAIL, PYTHON_TAIL
from lowdiff.errors import UnsupportedError

log = logging.getLogger("lowdiff.rng")

_MT_WORDS = MT_WORDS
_NUMPY_TAIL = NUMPY_TAIL
_PYTHON_TAIL = PYTHON_TAIL
PYTHON_WORDS = struct.Struct(f"<{_MT_WORDS + 1}I")


def numpy_bytes() -> bytes:
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
    """(generator, its bit generator, the lock, byte views of its key and pos and of its gaussian cache): built once
    per generator, so a read is two buffer copies without a foreign-function call (the generator is kept alive by
    this reference, so its memory stays where the views point)."""
    _last: tuple[Any, ...] = (None, b"", b"", b"")
    """(the views, the raw bytes read last, the state made of them): a state that has not changed since the last
    read (most training loops never draw from numpy's global generator) is not made again. Making it (unpacking
    and packing the tail, joining the bytes) cost about 30 us a step with the caches cold after a training step."""

    def _read(self, gen: object, offset: int) -> bytes:
        rs = cast(np.random.RandomState, gen)
        views = self._views
        if views[0] is not rs or views[1] is not rs._bit_generator or views[2] != offset:
            bitgen = rs._bit_generator
            key = (ctypes.c_char * (_MT_WORDS * 4 + 4)).from_address(bitgen.ctypes.state_address)
            gauss = (ctypes.c_char * _GAUSS.size).from_address(id(rs) + offset + 8)
            views = self._views = (rs, bitgen, offset, bitgen.lock, memoryview(key).cast("B"),
                                   memoryview(gauss).cast("B"))
        with views[3]:  # the lock RandomState draws under
            key_pos, gauss_raw = bytes(views[4]), bytes(views[5])
        last = self._last
        if last[0] is views and last[1] == key_pos and last[2] == gauss_raw:
            return cast(bytes, last[3])
        has_gauss, gauss = _GAUSS.unpack(gauss_raw)
        pos = int.from_bytes(key_pos[-4:], sys.byteorder, signed=True)
        out = key_pos[:-4] + _NUMPY_TAIL.pack(pos, has_gauss, gauss)
        self._last = (views, key_pos, gauss_raw, out)
        return out

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
    """(generator, offset, a byte view of its index and state words), built once per generator."""
    _last: tuple[Any, ...] = (None, b"", None, b"")
    """(the views, the raw bytes read last, ``gauss_next`` then, the state made of them), as numpy's reader keeps."""

    def _read(self, gen: object, offset: int) -> bytes:
        r = cast(random.Random, gen)
        views = self._views
        if views[0] is not r or views[1] != offset:
            words = (ctypes.c_char * (4 + _MT_WORDS * 4)).from_address(id(r) + offset)
            views = self._views = (r, offset, memoryview(words).cast("B"))
        index_state = bytes(views[2])  # holding the GIL: no draw interleaves
        gauss_next = r.gauss_next  # type: ignore[attr-defined]  # set by Random.__init__, not in the stubs
        last = self._last
        if last[0] is views and last[2] is gauss_next and last[1] == index_state:
            return cast(bytes, last[3])
        out = index_state[4:] + index_state[:4] + _PYTHON_TAIL.pack(gauss_next is not None,
                                                                    0.0 if gauss_next is None else gauss_next)
        self._last = (views, index_state, gauss_next, out)
        return out

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
    return PYTHON_WORDS.pack(*words) + tail


def python_state_bytes() -> bytes:
    raw = _PYTHON_READER.read()
    return raw if raw is not None else _python_bytes(random.getstate())
