"""The HDF5 container every snapshot and log segment uses.

One file holds two datasets: ``index`` (UTF-8 JSON: file metadata plus one descriptor per entry) and
``data`` (uint8: the entries' encoded bytes back to back). Each entry descriptor carries its codec, byte
range, raw size and CRC-32, plus dtype/shape fields owned by the caller. Packing entries into one dataset
instead of one dataset per tensor keeps HDF5 object creation off the critical path (measured ~0.3 ms per
dataset with attributes here, ~75 ms for a 200-tensor segment), and a reader can still fetch just the byte
ranges of the tensors it owns.

The bulk bytes are written with ``os.pwrite`` into the space HDF5 allocated for ``data`` (contiguous layout,
early allocation, no fill), so the GIL is released during the write and it runs at raw disk bandwidth.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from lowdiff.errors import CheckpointWriteError, CorruptFileError
from lowdiff.storage import atomic, codecs
from lowdiff.storage.format import DTYPES, FORMAT_NAME, FORMAT_VERSION


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


_crc32 = _pick_crc32()


@dataclass
class EntryIn:
    """One entry to write: ``raw`` is a list of buffers that are concatenated (no copy with codec none)."""

    name: str
    raw: list[Any]
    fields: dict[str, Any]


_SMALL_PIECE_BYTES = 1 << 16


def _u8(chunk: Any) -> torch.Tensor:
    """A flat uint8 view of a tensor (no copy when contiguous) or a copy of a bytes-like object."""
    if isinstance(chunk, torch.Tensor):
        return chunk.detach().reshape(-1).view(torch.uint8)
    data = bytes(chunk)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _small_tensors(raw: list[Any]) -> bool:
    """Several pieces, all tensors of one dtype, averaging under _SMALL_PIECE_BYTES (one pass: this runs for every
    column of every segment, Top-k: 152 columns x 10 steps)."""
    if len(raw) < 2:
        return False
    dtype, total = None, 0
    for t in raw:
        if not isinstance(t, torch.Tensor) or (dtype is not None and t.dtype != dtype):
            return False
        dtype = t.dtype
        total += t.nbytes
    return total < _SMALL_PIECE_BYTES * len(raw)


def _flat_cat(raw: list[Any]) -> torch.Tensor:
    """Tensors of one dtype: their bytes back to back as one flat uint8 tensor (one copy). One ``torch.cat`` of the
    pieces as they are (a column's pieces share their trailing shape), no per-piece reshape: per-piece Python
    work is what dominates small-piece segments. Call under ``torch.no_grad()``."""
    try:
        joined = torch.cat(raw)
    except RuntimeError:  # 0-d pieces or differing trailing shapes
        joined = torch.cat([t.reshape(-1) for t in raw])
    return joined.reshape(-1).view(torch.uint8)


def write_container(path: Path, kind: str, meta: dict[str, Any], entries: list[EntryIn], codec: str) -> int:
    """Write and atomically commit one container file; returns the bytes written.

    ``EntryIn.raw`` items may be tensors (their raw bytes are stored) or bytes-like objects. Raw bytes are
    handed to ``pwritev`` without copying (codec none) or joined with one ``torch.cat`` per entry before
    compression; either way the file is written with a handful of system calls, not one per tensor.
    """
    descriptors: list[dict[str, Any]] = []
    chunks: list[Any] = []
    offset = 0
    if codec == "none":
        # Zero-copy: every piece is handed to pwritev as it is; crc32 chains over an entry's pieces.
        for e in entries:
            if _small_tensors(e.raw):  # many small pieces (top-k per step): one copy beats per-piece overhead
                with torch.no_grad():
                    ps = [_flat_cat(e.raw)]
            else:
                ps = [_u8(c) for c in e.raw]
            views = [memoryview(p.numpy()) for p in ps if p.numel()]
            n = sum(v.nbytes for v in views)
            crc = 0
            for v in views:
                crc = _crc32(v, crc)
            descriptors.append({**e.fields, "name": e.name, "codec": codec, "offset": offset, "nbytes": n,
                                "raw_nbytes": n, "crc32": crc})
            chunks.extend(views)
            offset += n
    else:
        for e in entries:
            if len(e.raw) == 1:
                joined = _u8(e.raw[0])
            elif not e.raw:
                joined = torch.empty(0, dtype=torch.uint8)
            elif all(isinstance(c, torch.Tensor) for c in e.raw) and len({c.dtype for c in e.raw}) == 1:
                with torch.no_grad():
                    joined = _flat_cat(e.raw)
            else:
                joined = torch.cat([_u8(c) for c in e.raw])
            raw_nbytes = joined.numel()
            encoded = codecs.encode(codec, memoryview(joined.numpy()), _itemsize(e.fields.get("dtype")))
            nbytes = memoryview(encoded).nbytes
            descriptors.append({**e.fields, "name": e.name, "codec": codec, "offset": offset, "nbytes": nbytes,
                                "raw_nbytes": raw_nbytes, "crc32": _crc32(encoded)})
            chunks.append(encoded)
            offset += nbytes
    index = json.dumps({"meta": meta, "entries": descriptors}, separators=(",", ":")).encode()
    tmp = atomic.tmp_path(path)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT_NAME
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = kind
            ds = f.create_dataset("index", data=np.frombuffer(index, dtype=np.uint8))
            ds.attrs["crc32"] = _crc32(index)
            data_offset = _allocate_data(f, offset)
        fd = os.open(tmp, os.O_RDWR)
        try:
            if offset:
                atomic.pwrite_all(fd, chunks, data_offset)
            size = os.fstat(fd).st_size
            atomic.pwrite_all(fd, [_trailer(fd, size, data_offset, offset)], size)
            os.fsync(fd)  # on the fd already open: commit() need not reopen the file to sync it
        finally:
            os.close(fd)
        atomic.commit(tmp, path, synced=True)
    except OSError as e:
        atomic.remove_quietly(tmp)
        raise CheckpointWriteError(e.errno, f"writing {path} failed: {e.strerror or e}; nothing was "
                                   "committed for it", str(path)) from e
    except BaseException:
        atomic.remove_quietly(tmp)
        raise
    return offset + len(index)


# The trailer: CRC-32 of every byte of the HDF5 file outside the `data` blob (superblock, object headers,
# heaps, the index), checked BEFORE libhdf5 parses anything: damaged HDF5 metadata can make libhdf5 loop
# forever or misread objects, so it must never see it. The data blob has its own per-entry CRCs.
_TRAILER = struct.Struct("<8sQQQI4x")  # magic, hdf5 size, data offset, data length, crc32
_TRAILER_MAGIC = b"LDIFFEND"


def _meta_crc(fd: int, hdf5_size: int, data_offset: int, data_len: int) -> int:
    crc = 0
    for start, end in ((0, data_offset if data_len else hdf5_size), (data_offset + data_len, hdf5_size)):
        pos = start
        while pos < end:
            chunk = os.pread(fd, min(end - pos, 1 << 20), pos)
            if not chunk:
                raise CorruptFileError(f"file ends at {pos}, expected {end} bytes")
            crc = _crc32(chunk, crc)
            pos += len(chunk)
    return crc


def _trailer(fd: int, size: int, data_offset: int, data_len: int) -> bytes:
    return _TRAILER.pack(_TRAILER_MAGIC, size, data_offset, data_len, _meta_crc(fd, size, data_offset, data_len))


def verify_trailer(path: Path) -> None:
    """Refuse a file whose HDF5 metadata is damaged or truncated, without letting libhdf5 read it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < _TRAILER.size:
            raise CorruptFileError(f"{path}: {size} bytes is too short for a lowdiff file (truncated?)")
        magic, hdf5_size, data_offset, data_len, crc = _TRAILER.unpack(os.pread(fd, _TRAILER.size,
                                                                                 size - _TRAILER.size))
        if magic != _TRAILER_MAGIC or hdf5_size != size - _TRAILER.size or data_offset + data_len > hdf5_size:
            raise CorruptFileError(f"{path}: missing or damaged lowdiff trailer: the file is truncated or damaged, "
                                   "or was written by a pre-release lowdiff (format version 1, no trailer)")
        if _meta_crc(fd, hdf5_size, data_offset, data_len) != crc:
            raise CorruptFileError(f"{path}: HDF5 metadata checksum mismatch (file damaged)")
    except CorruptFileError as e:
        e.path = path
        raise
    finally:
        os.close(fd)


def _itemsize(dtype: object) -> int:
    return DTYPES[dtype].itemsize if isinstance(dtype, str) and dtype in DTYPES else 1


def _allocate_data(f: h5py.File, nbytes: int) -> int:
    if nbytes == 0:
        f.create_dataset("data", shape=(0,), dtype=np.uint8)
        return 0
    space = h5py.h5s.create_simple((nbytes,))
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dsid = h5py.h5d.create(f.id, b"data", h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl)
    offset = dsid.get_offset()
    if offset is None:
        raise OSError("HDF5 did not allocate the data dataset")
    return int(offset)


class ContainerReader:
    """Read-only view of a committed container; every check failure names the file."""

    def __init__(self, path: Path, expected_kind: str) -> None:
        self.path = path
        verify_trailer(path)
        try:
            self._file = h5py.File(path, "r")
        except FileNotFoundError:
            raise
        except OSError as e:
            err = CorruptFileError(f"{path}: not a readable HDF5 file ({e}); it may be truncated or damaged")
            err.path = path
            raise err from e
        try:
            self._load(expected_kind)
        except CorruptFileError as e:
            self._file.close()
            e.path = e.path or path
            raise
        except BaseException:
            self._file.close()
            raise

    def _load(self, expected_kind: str) -> None:
        f, where = self._file, str(self.path)
        try:
            if f.attrs.get("format") != FORMAT_NAME or f.attrs.get("kind") != expected_kind:
                raise CorruptFileError(f"{where}: not a lowdiff {expected_kind} file")
            version = int(f.attrs.get("format_version", -1))
            if version != FORMAT_VERSION:
                raise CorruptFileError(f"{where}: format version {version}, this lowdiff reads {FORMAT_VERSION}; "
                                       "upgrade lowdiff to read it")
            index_ds, data_ds = f["index"], f["data"]
            if not isinstance(index_ds, h5py.Dataset) or not isinstance(data_ds, h5py.Dataset):
                raise CorruptFileError(f"{where}: index/data are not datasets")
            if index_ds.dtype != np.uint8 or data_ds.dtype != np.uint8 or index_ds.ndim != 1 or data_ds.ndim != 1:
                raise CorruptFileError(f"{where}: index/data datasets must be 1-D uint8")
            raw_index = index_ds[()].tobytes()
            if _crc32(raw_index) != int(index_ds.attrs.get("crc32", -1)):
                raise CorruptFileError(f"{where}: index checksum mismatch (file damaged)")
            doc = json.loads(raw_index)
        except CorruptFileError:
            raise
        except (KeyError, ValueError, TypeError, OSError, AttributeError, RuntimeError) as e:
            raise CorruptFileError(f"{where}: damaged container ({e!r})") from e
        self._data = data_ds
        self.data_nbytes = int(data_ds.shape[0])
        if not (isinstance(doc, dict) and isinstance(doc.get("meta"), dict) and isinstance(doc.get("entries"), list)):
            raise CorruptFileError(f"{where}: index lacks meta/entries")
        self.meta: dict[str, Any] = doc["meta"]
        self.entries: dict[str, dict[str, Any]] = {}
        for d in doc["entries"]:
            if not isinstance(d, dict) or not isinstance(d.get("name"), str):
                raise CorruptFileError(f"{where}: malformed entry descriptor {str(d)[:80]}")
            for key in ("offset", "nbytes", "raw_nbytes", "crc32"):
                v = d.get(key)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise CorruptFileError(f"{where}: entry {d['name']!r} has invalid {key} {v!r}")
            if d["offset"] + d["nbytes"] > self.data_nbytes:
                raise CorruptFileError(f"{where}: entry {d['name']!r} runs past the end of the data "
                                       f"({d['offset'] + d['nbytes']} > {self.data_nbytes}); file truncated?")
            self.entries[d["name"]] = d

    def read(self, name: str, expected_raw_nbytes: int) -> bytes | memoryview:
        try:
            return self._read(name, expected_raw_nbytes)
        except CorruptFileError as e:
            e.path = e.path or self.path
            raise

    def _read(self, name: str, expected_raw_nbytes: int) -> bytes | memoryview:
        """Verified, decompressed bytes of one entry. ``expected_raw_nbytes`` comes from the caller's own
        dtype x shape computation, so a hostile descriptor cannot make us allocate more."""
        d = self.entries.get(name)
        where = f"{self.path} [{name}]"
        if d is None:
            raise CorruptFileError(f"{self.path}: missing entry {name!r}")
        if d["raw_nbytes"] != expected_raw_nbytes:
            raise CorruptFileError(f"{where}: holds {d['raw_nbytes']} raw bytes, expected {expected_raw_nbytes}")
        start, n = d["offset"], d["nbytes"]
        try:
            data = self._data[start : start + n].tobytes() if n else b""
        except OSError as e:
            raise CorruptFileError(f"{where}: read failed ({e})") from e
        if _crc32(data) != d["crc32"]:
            raise CorruptFileError(f"{where}: checksum mismatch (file damaged)")
        return codecs.decode(str(d.get("codec")), data, expected_raw_nbytes, where, _itemsize(d.get("dtype")))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ContainerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
