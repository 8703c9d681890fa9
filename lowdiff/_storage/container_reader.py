"""Reading a container (lowdiff/_storage/container.py writes it) as untrusted input.

Order of checks, each before anything it guards is read or allocated (docs/reference/FORMAT.md sections 3, 8):
the file is a regular file opened without following links; its trailer is intact and bounded; libhdf5 then
parses the checksummed metadata through that same descriptor (it never opens a path), and the root holds exactly
the two datasets ``index`` and ``data`` as hard links, 1-D uint8, contiguous, unfiltered, without external
storage, and lying inside the file where the trailer says; the index is read with ``pread`` (bounded by the
trailer), its entries tile the data blob exactly, and an entry is read only when the caller asks for it with the
raw size it computed itself.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from lowdiff._storage import codecs
from lowdiff._storage.format import DTYPES, FORMAT_NAME, FORMAT_VERSION
from lowdiff._storage.safe_io import open_regular, parse_json
from lowdiff._storage.trailer import Trailer, check_trailer, crc32, pread_exact
from lowdiff.errors import CorruptFileError, UnsafeFileError

_ROOT_ATTRS = frozenset({"format", "format_version", "kind"})
_MAX_ATTR_BYTES = 1024
_MAX_NAME_CHARS = 4096


def _compress_bound(raw_nbytes: int) -> int:
    """The most bytes lz4 or zstd turn ``raw_nbytes`` into (both bounds are below this)."""
    return raw_nbytes + raw_nbytes // 64 + 65536


class ContainerReader:
    """Read-only view of a committed container; every check failure names the file.

    ``confined``: ``path`` is a run-directory member, whose directory must not be a symbolic link either."""

    def __init__(self, path: Path, expected_kind: str, *, confined: bool = False) -> None:
        self.path = path
        self._fd = open_regular(path, confined=confined)
        try:
            self._trailer = check_trailer(self._fd, path)
            self._load(expected_kind)
        except CorruptFileError as e:
            os.close(self._fd)
            e.path = e.path or path
            raise
        except BaseException:
            os.close(self._fd)
            raise

    def _fail(self, what: str, cls: type[CorruptFileError] = CorruptFileError) -> CorruptFileError:
        return cls(f"{self.path}: {what}", path=self.path)

    def _load(self, expected_kind: str) -> None:
        # libhdf5 reads through a duplicate of the checked descriptor: it never resolves a path itself.
        fobj = io.FileIO(os.dup(self._fd), "rb", closefd=True)
        try:
            try:
                f = h5py.File(fobj, "r")
            except OSError as e:
                raise self._fail(f"not a readable HDF5 file ({e}); it may be truncated or damaged") from e
            try:
                index_at, index_len = self._check_hdf5(f, expected_kind)
            except CorruptFileError:
                raise
            except (KeyError, ValueError, TypeError, OSError, AttributeError, RuntimeError, IndexError) as e:
                raise self._fail(f"damaged container ({e!r})") from e
            finally:
                f.close()
        finally:
            fobj.close()
        raw_index = pread_exact(self._fd, index_len, index_at, self.path)
        if crc32(raw_index) != self._index_crc:
            raise self._fail("index checksum mismatch (file damaged)")
        doc = parse_json(raw_index, str(self.path))
        if not (isinstance(doc, dict) and isinstance(doc.get("meta"), dict) and isinstance(doc.get("entries"), list)):
            raise self._fail("index lacks meta/entries")
        self.meta: dict[str, Any] = doc["meta"]
        self.entries = self._check_entries(doc["entries"])
        self.data_nbytes = self._trailer.data_len

    def _attr(self, obj: Any, name: str) -> Any:
        """A scalar attribute, read only after its size is known to be small."""
        aid = obj.attrs.get_id(name)
        if aid.shape not in ((), (1,)) or aid.get_storage_size() > _MAX_ATTR_BYTES:
            raise self._fail(f"attribute {name!r} has shape {aid.shape} ({aid.get_storage_size()} bytes); "
                             "not a lowdiff file")
        v = obj.attrs[name]
        return v.decode() if isinstance(v, bytes) else v

    def _check_hdf5(self, f: h5py.File, expected_kind: str) -> tuple[int, int]:
        names = set(f.attrs.keys())
        if not names <= _ROOT_ATTRS:
            raise self._fail(f"unexpected root attributes {sorted(names - _ROOT_ATTRS)[:5]}; not a lowdiff file")
        if "format" not in names or "kind" not in names or self._attr(f, "format") != FORMAT_NAME \
                or self._attr(f, "kind") != expected_kind:
            raise self._fail(f"not a lowdiff {expected_kind} file")
        try:
            version = int(self._attr(f, "format_version")) if "format_version" in names else -1
        except (TypeError, ValueError):
            version = -1
        if version != FORMAT_VERSION:
            raise self._fail(f"format version {version}, this lowdiff reads {FORMAT_VERSION}; upgrade lowdiff to "
                             "read it")
        links = sorted(f.keys())
        if links != ["data", "index"]:
            raise self._fail(f"holds {links[:6]}, not exactly the datasets 'data' and 'index'")
        spans = {}
        for name in ("index", "data"):
            link = f.get(name, getlink=True)
            if not isinstance(link, h5py.HardLink):
                raise self._fail(f"{name!r} is a {type(link).__name__}, which could point outside the file; lowdiff "
                                 "reads only its own datasets", UnsafeFileError)
            ds = f[name]
            if not isinstance(ds, h5py.Dataset):
                raise self._fail(f"{name!r} is not a dataset")
            spans[name] = self._check_dataset(name, ds)
        if "crc32" not in set(f["index"].attrs.keys()):
            raise self._fail("index has no checksum")
        crc = self._attr(f["index"], "crc32")
        if not isinstance(crc, (int, np.integer)):
            raise self._fail("index checksum is not an integer")
        self._index_crc = int(crc)
        t: Trailer = self._trailer
        data_at, data_len = spans["data"]
        if data_len != t.data_len or (data_len and data_at != t.data_offset):
            raise self._fail(f"the data blob ({data_len} bytes at {data_at}) is not where the trailer says "
                             f"({t.data_len} bytes at {t.data_offset})")
        index_at, index_len = spans["index"]
        if index_len and (index_at + index_len > t.hdf5_size or (t.data_len and index_at < t.data_offset + t.data_len
                                                                  and t.data_offset < index_at + index_len)):
            raise self._fail("the index lies outside the checksummed metadata")
        return index_at, index_len

    def _check_dataset(self, name: str, ds: h5py.Dataset) -> tuple[int, int]:
        """(file offset, length) of a 1-D uint8 dataset stored in this file, contiguous and unfiltered."""
        dcpl = ds.id.get_create_plist()
        layout = dcpl.get_layout()
        if layout == h5py.h5d.VIRTUAL or dcpl.get_external_count():
            raise self._fail(f"dataset {name!r} is stored outside the file (virtual dataset or external storage); "
                             "lowdiff reads only bytes of the file itself", UnsafeFileError)
        if ds.dtype != np.uint8 or ds.ndim != 1:
            raise self._fail(f"dataset {name!r} is {ds.dtype} with {ds.ndim} dimensions, not 1-D uint8")
        if layout != h5py.h5d.CONTIGUOUS or dcpl.get_nfilters():
            raise self._fail(f"dataset {name!r} is chunked, compact or filtered; lowdiff writes it contiguous")
        n = int(ds.shape[0])
        offset = ds.id.get_offset()
        if n and (offset is None or offset + n > self._trailer.hdf5_size):
            raise self._fail(f"dataset {name!r} claims {n} bytes that the file does not hold")
        return (int(offset) if offset is not None else 0), n

    def _check_entries(self, entries: list[Any]) -> dict[str, dict[str, Any]]:
        """Descriptors with valid fields that tile the data blob exactly (the writer packs them back to back)."""
        out: dict[str, dict[str, Any]] = {}
        for d in entries:
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or len(d["name"]) > _MAX_NAME_CHARS:
                raise self._fail(f"malformed entry descriptor {str(d)[:80]}")
            for key in ("offset", "nbytes", "raw_nbytes", "crc32"):
                v = d.get(key)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise self._fail(f"entry {d['name']!r} has invalid {key} {v!r}")
            if d.get("codec") not in codecs.CODECS:
                raise self._fail(f"entry {d['name']!r} has unknown codec {d.get('codec')!r}")
            if d["codec"] == "none" and d["nbytes"] != d["raw_nbytes"]:
                raise self._fail(f"entry {d['name']!r} is stored uncompressed in {d['nbytes']} bytes but claims "
                                 f"{d['raw_nbytes']}")
            if d["name"] in out:
                raise self._fail(f"entry {d['name']!r} appears twice")
            out[d["name"]] = d
        pos = 0
        for d in sorted(out.values(), key=lambda e: (e["offset"], e["nbytes"])):
            if d["offset"] != pos:
                raise self._fail(f"entry {d['name']!r} starts at byte {d['offset']} of the data, expected {pos} "
                                 "(entries overlap or leave a gap)")
            pos += d["nbytes"]
        if pos != self._trailer.data_len:
            raise self._fail(f"entries end at byte {pos} of the data, the data blob has {self._trailer.data_len} "
                             "(file truncated or padded?)")
        return out

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
        if n > _compress_bound(expected_raw_nbytes):
            raise CorruptFileError(f"{where}: {n} stored bytes cannot hold {expected_raw_nbytes} raw bytes")
        try:
            data = pread_exact(self._fd, n, self._trailer.data_offset + start, self.path)
        except OSError as e:
            raise CorruptFileError(f"{where}: read failed ({e})") from e
        if crc32(data) != d["crc32"]:
            raise CorruptFileError(f"{where}: checksum mismatch (file damaged)")
        return codecs.decode(str(d.get("codec")), data, expected_raw_nbytes, where, _itemsize(d.get("dtype")))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ContainerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _itemsize(dtype: object) -> int:
    return DTYPES[dtype].itemsize if isinstance(dtype, str) and dtype in DTYPES else 1
