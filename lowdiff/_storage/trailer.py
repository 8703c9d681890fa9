"""The 40-byte trailer after every container's HDF5 bytes, and the CRC-32 used throughout the format.

The trailer holds a CRC-32 of every byte of the HDF5 file outside the `data` blob (superblock, object headers,
heaps, the index), checked BEFORE libhdf5 parses anything: damaged HDF5 metadata can make libhdf5 loop forever or
misread objects, so it must never see it. The data blob has its own per-entry CRCs. The region it covers is
bounded (``MAX_METADATA_BYTES``), so a forged trailer cannot make a reader checksum a terabyte.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any, NamedTuple

from lowdiff.errors import CorruptFileError

TRAILER = struct.Struct("<8sQQQI4x")  # magic, hdf5 size, data offset, data length, crc32
TRAILER_MAGIC = b"LDIFFEND"
MAX_METADATA_BYTES = 256 << 20
"""HDF5 structure plus the index JSON: a few KB per tensor and step (a 1000-tensor, 64-step segment's index is
~3 MB); more is not a lowdiff file, and checksumming it would take seconds to minutes."""


def _pick_crc32() -> Any:
    """The fastest available CRC-32 (the zlib/IEEE polynomial, same values as ``zlib.crc32``, chaining alike).

    CPython's zlib 1.2.x computes ~4 GB/s here, 11-18 ms of writer CPU per 43 MB segment; ISA-L (``isal``) and
    zlib-ng use carry-less multiplication, ~25-30 GB/s. All three release the GIL for large buffers. Optional:
    used when installed, zlib otherwise."""
    try:
        from isal.isal_zlib import crc32 as isal_crc32

        return isal_crc32
    except ImportError:
        pass
    try:
        from zlib_ng.zlib_ng import crc32 as ng_crc32

        return ng_crc32
    except ImportError:
        return zlib.crc32


crc32 = _pick_crc32()


class Trailer(NamedTuple):
    hdf5_size: int
    data_offset: int
    data_len: int


def meta_crc(fd: int, hdf5_size: int, data_offset: int, data_len: int, crc_fn: Any = None) -> int:
    """CRC-32 of the HDF5 bytes outside the data blob (``crc_fn``: the CRC-32 function, default :data:`crc32`)."""
    crc_fn = crc_fn or crc32
    crc = 0
    for start, end in ((0, data_offset if data_len else hdf5_size), (data_offset + data_len, hdf5_size)):
        pos = start
        while pos < end:
            chunk = os.pread(fd, min(end - pos, 1 << 20), pos)
            if not chunk:
                raise CorruptFileError(f"file ends at {pos}, expected {end} bytes")
            crc = crc_fn(chunk, crc)
            pos += len(chunk)
    return crc


def check_trailer(fd: int, path: Path) -> Trailer:
    """The verified trailer of the open file ``fd``; a damaged, truncated or forged one is a CorruptFileError."""
    try:
        size = os.fstat(fd).st_size
        if size < TRAILER.size:
            raise CorruptFileError(f"{path}: {size} bytes is too short for a lowdiff file (truncated?)")
        magic, hdf5_size, data_offset, data_len, crc = TRAILER.unpack(pread_exact(fd, TRAILER.size,
                                                                                  size - TRAILER.size, path))
        if magic != TRAILER_MAGIC or hdf5_size != size - TRAILER.size or data_offset + data_len > hdf5_size \
                or (data_len and data_offset < 8):
            raise CorruptFileError(f"{path}: missing or damaged lowdiff trailer: the file is truncated or damaged, "
                                   "or was written by a pre-release lowdiff (format version 1, no trailer)")
        if hdf5_size - data_len > MAX_METADATA_BYTES:
            raise CorruptFileError(f"{path}: its trailer declares {hdf5_size - data_len} bytes of HDF5 metadata, "
                                   f"more than a lowdiff file has ({MAX_METADATA_BYTES}); it is not a lowdiff file")
        if meta_crc(fd, hdf5_size, data_offset, data_len) != crc:
            raise CorruptFileError(f"{path}: HDF5 metadata checksum mismatch (file damaged)")
    except CorruptFileError as e:
        e.path = path
        raise
    except OSError as e:
        raise CorruptFileError(f"{path}: read failed ({e.strerror or e})", path=path) from e
    return Trailer(hdf5_size, data_offset, data_len)


def pread_exact(fd: int, n: int, offset: int, path: Path) -> bytes:
    """``n`` bytes at ``offset`` (the caller has bounded ``n``); a short file is a CorruptFileError."""
    if n <= 0:
        return b""
    first = os.pread(fd, n, offset)
    if len(first) == n:
        return first
    parts, got = [first], len(first)
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            raise CorruptFileError(f"{path}: ends before byte {offset + n} (truncated?)", path=path)
        parts.append(b)
        got += len(b)
    return b"".join(parts)
