"""The HDF5 container every snapshot and log segment uses.

One file holds two datasets: ``index`` (UTF-8 JSON: file metadata plus one descriptor per entry) and
``data`` (uint8: the entries' encoded bytes back to back). Each entry descriptor carries its codec, byte
range, raw size and CRC-32, plus dtype/shape fields owned by the caller. Packing entries into one dataset
instead of one dataset per tensor keeps HDF5 object creation off the critical path (measured ~0.3 ms per
dataset with attributes here, ~75 ms for a 200-tensor segment), and a reader can still fetch just the byte
ranges of the tensors it owns.

The bulk bytes are written with ``os.pwritev`` into the space HDF5 allocated for ``data`` (contiguous layout,
early allocation, no fill), so the GIL is released during the write and it runs at raw disk bandwidth; past the
page cache where the file system takes ``O_DIRECT`` (lowdiff._storage.direct_io).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from lowdiff._storage import atomic, codecs, direct_io
from lowdiff._storage.format import DTYPES, FORMAT_NAME, FORMAT_VERSION
from lowdiff._storage.later import json_value
from lowdiff._storage.safe_io import open_regular
from lowdiff._storage.trailer import TRAILER, TRAILER_MAGIC, check_trailer, meta_crc
from lowdiff._storage.trailer import crc32 as _crc32
from lowdiff.errors import CheckpointWriteError


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


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})


def _byte_view(chunk: Any) -> memoryview:
    """The bytes of a tensor (a contiguous CPU one: through numpy, without a torch call, each of which releases the
    GIL that a training thread then takes: a snapshot has hundreds of tensors) or of a bytes-like object (as it lies,
    when contiguous: memory a direct write may take from where it is)."""
    if not isinstance(chunk, torch.Tensor):
        v = memoryview(chunk)
        if v.c_contiguous:
            try:
                return v if v.format == "B" and v.ndim == 1 else v.cast("B")
            except (TypeError, ValueError):  # a format memoryview cannot cast (a byte order prefix): copied below
                pass
    elif (chunk.dtype in _NUMPY_DTYPES and chunk.device.type == "cpu"
            and not chunk.requires_grad and chunk.is_contiguous() and not chunk.is_conj() and not chunk.is_neg()):
        return chunk.numpy().reshape(-1).view(np.uint8).data
    return _u8(chunk).numpy().data


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


def write_container(path: Path, kind: str, meta: dict[str, Any], entries: list[EntryIn], codec: str, *,
                    format_version: int = FORMAT_VERSION, direct: bool = True, joined: memoryview | None = None
                    ) -> int:
    """Write and atomically commit one container file; returns the bytes written.

    ``EntryIn.raw`` items may be tensors (their raw bytes are stored) or bytes-like objects. Raw bytes are
    handed to ``pwritev`` without copying (codec none) or joined with one ``torch.cat`` per entry before
    compression; either way the file is written with a handful of system calls, not one per tensor. ``direct``:
    the bulk bytes go past the page cache where the file system takes it (lowdiff._storage.direct_io).
    ``joined``: the bytes of every entry, back to back in entry order; each entry's ``raw`` is then its one slice of
    it (a log segment built from packed steps, lowdiff._storage.segment_packed), and with codec none it is written
    as one piece.
    """
    descriptors: list[dict[str, Any]] = []
    chunks: list[Any] = []
    offset = 0
    if joined is not None:
        for e in entries:
            (part,) = e.raw
            n = part.nbytes
            encoded = part if codec == "none" else codecs.encode(codec, part, _itemsize(e.fields.get("dtype")))
            nbytes = memoryview(encoded).nbytes
            descriptors.append({**e.fields, "name": e.name, "codec": codec, "offset": offset, "nbytes": nbytes,
                                "raw_nbytes": n, "crc32": _crc32(encoded)})
            offset += nbytes
            if codec != "none":
                chunks.append(encoded)
        if codec == "none":
            chunks.append(joined)
    elif codec == "none":
        # Zero-copy: every piece is handed to pwritev as it is; crc32 chains over an entry's pieces.
        for e in entries:
            if _small_tensors(e.raw):  # many small pieces (top-k per step): one copy beats per-piece overhead
                with torch.no_grad():
                    ps = [_flat_cat(e.raw)]
                views = [v for v in (p.numpy().data for p in ps) if v.nbytes]
            else:
                views = [v for v in map(_byte_view, e.raw) if v.nbytes]
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
                flat = _u8(e.raw[0])
            elif not e.raw:
                flat = torch.empty(0, dtype=torch.uint8)
            elif all(isinstance(c, torch.Tensor) for c in e.raw) and len({c.dtype for c in e.raw}) == 1:
                with torch.no_grad():
                    flat = _flat_cat(e.raw)
            else:
                flat = torch.cat([_u8(c) for c in e.raw])
            raw_nbytes = flat.numel()
            encoded = codecs.encode(codec, flat.numpy().data, _itemsize(e.fields.get("dtype")))
            nbytes = memoryview(encoded).nbytes
            descriptors.append({**e.fields, "name": e.name, "codec": codec, "offset": offset, "nbytes": nbytes,
                                "raw_nbytes": raw_nbytes, "crc32": _crc32(encoded)})
            chunks.append(encoded)
            offset += nbytes
    index = json.dumps({"meta": meta, "entries": descriptors}, separators=(",", ":"), default=json_value).encode()
    tmp = atomic.tmp_path(path)
    try:
        atomic.ensure_space(tmp.parent, offset + len(index))
        # A data region of direct_io.MIN_BYTES or more starts at a multiple of direct_io.ALIGN in the file: all of
        # it can then go past the page cache, from the caller's memory where that is aligned too.
        with h5py.File(tmp, "w", alignment_threshold=direct_io.MIN_BYTES, alignment_interval=direct_io.ALIGN) as f:
            f.attrs["format"] = FORMAT_NAME
            f.attrs["format_version"] = format_version
            f.attrs["kind"] = kind
            ds = f.create_dataset("index", data=np.frombuffer(index, dtype=np.uint8))
            ds.attrs["crc32"] = _crc32(index)
            data_offset = _allocate_data(f, offset)
        fd = os.open(tmp, os.O_RDWR)
        try:
            if offset:
                direct_io.write_data(fd, tmp, chunks, data_offset, direct=direct)
            size = os.fstat(fd).st_size
            atomic.pwrite_all(fd, [_trailer(fd, size, data_offset, offset)], size)
            os.fsync(fd)  # on the fd already open: commit() need not reopen the file to sync it
            atomic.drop_cached(fd)
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


# The writer's trailer goes through these two module globals, looked up at call time: bench/studies/writebw.py times
# each phase of a write by wrapping them.
def _meta_crc(fd: int, hdf5_size: int, data_offset: int, data_len: int) -> int:
    return meta_crc(fd, hdf5_size, data_offset, data_len, _crc32)


def _trailer(fd: int, size: int, data_offset: int, data_len: int) -> bytes:
    return TRAILER.pack(TRAILER_MAGIC, size, data_offset, data_len, _meta_crc(fd, size, data_offset, data_len))


def verify_trailer(path: Path) -> None:
    """Refuse a file whose HDF5 metadata is damaged or truncated, without letting libhdf5 read it."""
    fd = open_regular(path, confined=False)
    try:
        check_trailer(fd, path)
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
    dcpl.set_obj_track_times(False)  # no timestamp: the same entries make the same file, byte for byte
    dsid = h5py.h5d.create(f.id, b"data", h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl)
    offset = dsid.get_offset()
    if offset is None:
        raise OSError("HDF5 did not allocate the data dataset")
    return int(offset)


from lowdiff._storage.container_reader import ContainerReader  # noqa: E402  (re-exported)

__all__ = ["ContainerReader", "EntryIn", "write_container", "verify_trailer"]
