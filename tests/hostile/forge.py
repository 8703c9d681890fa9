"""Forging run-directory files with VALID checksums around bad content, so the checks beyond the checksums are
what a test exercises (DESIGN.md section 10). Test-only; never imported by lowdiff."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from lowdiff._storage import codecs
from lowdiff._storage.container import _trailer

_TRAILER = struct.Struct("<8sQQQI4x")


@dataclass
class Forged:
    """A container's content: root attributes, index meta, entry descriptors and each entry's RAW bytes."""

    kind: str
    attrs: dict[str, Any]
    meta: dict[str, Any]
    entries: list[dict[str, Any]]
    raw: dict[str, bytes] = field(default_factory=dict)
    stored: dict[str, bytes] = field(default_factory=dict)
    """Entries stored verbatim (already encoded: codec and raw_nbytes as the descriptor says)."""

    def entry(self, name: str) -> dict[str, Any]:
        return next(d for d in self.entries if d["name"] == name)

    def names(self, prefix: str = "") -> list[str]:
        return [d["name"] for d in self.entries if d["name"].startswith(prefix)]

    def set_raw(self, name: str, raw: bytes, **fields: Any) -> None:
        """Replace an entry's bytes (stored uncompressed, every checksum recomputed) and descriptor fields."""
        d = self.entry(name)
        d.update(fields)
        self.raw[name] = raw

    def set_stored(self, name: str, stored: bytes, **fields: Any) -> None:
        """Store ``stored`` as the entry's encoded bytes (offset, size and CRC recomputed; the rest as given)."""
        self.entry(name).update(fields)
        self.stored[name] = stored

    def remove(self, name: str) -> None:
        self.entries = [d for d in self.entries if d["name"] != name]
        self.raw.pop(name, None)


def load(path: Path) -> Forged:
    """Read a committed container without lowdiff's reader (every entry decoded to its raw bytes)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(size - _TRAILER.size)
        _, _, data_offset, data_len, _ = _TRAILER.unpack(fh.read(_TRAILER.size))
        fh.seek(data_offset)
        blob = fh.read(data_len)
    with h5py.File(path, "r") as f:
        attrs = {k: f.attrs[k] for k in f.attrs}
        doc = json.loads(f["index"][()].tobytes())
    raw = {}
    for d in doc["entries"]:
        stored = blob[d["offset"] : d["offset"] + d["nbytes"]]
        itemsize = codecs_itemsize(d.get("dtype"))
        raw[d["name"]] = bytes(codecs.decode(d["codec"], stored, d["raw_nbytes"], "forge", itemsize))
    kind = attrs["kind"]
    return Forged(kind=str(kind.decode() if isinstance(kind, bytes) else kind), attrs=attrs, meta=doc["meta"],
                  entries=doc["entries"], raw=raw)


def codecs_itemsize(dtype: Any) -> int:
    from lowdiff._storage.format import DTYPES

    return DTYPES[dtype].itemsize if isinstance(dtype, str) and dtype in DTYPES else 1


def save(path: Path, c: Forged, *, hook: Callable[[h5py.File, bytes, bytes], None] | None = None,
         keep_descriptors: bool = False, index_doc: bytes | None = None) -> None:
    """Write ``c`` as a container with valid entry CRCs, index CRC and trailer (replacing any file at ``path``).

    ``hook(f, index_bytes, data_bytes)`` builds the two datasets itself (external storage, links, ...); by default
    both are plain contiguous datasets. ``keep_descriptors``: offsets, sizes and CRCs stay as the test set them.
    ``index_doc``: the exact index bytes to store (e.g. JSON no parser accepts)."""
    blob = bytearray()
    for d in c.entries:
        if d["name"] in c.stored:
            raw = c.stored[d["name"]]
            if not keep_descriptors:
                d.update(offset=len(blob), nbytes=len(raw), crc32=zlib.crc32(raw))
        else:
            raw = c.raw.get(d["name"], b"")
            if not keep_descriptors:
                d.update(codec="none", offset=len(blob), nbytes=len(raw), raw_nbytes=len(raw),
                         crc32=zlib.crc32(raw))
        blob += raw
    index = index_doc if index_doc is not None else json.dumps({"meta": c.meta, "entries": c.entries}).encode()
    if path.is_symlink() or path.exists():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    with h5py.File(path, "w") as f:
        for k, v in c.attrs.items():
            f.attrs[k] = v
        if hook is not None:
            hook(f, index, bytes(blob))
        else:
            ds = f.create_dataset("index", data=np.frombuffer(index, dtype=np.uint8))
            ds.attrs["crc32"] = zlib.crc32(index)
            f.create_dataset("data", data=np.frombuffer(bytes(blob), dtype=np.uint8) if blob else
                             np.zeros(0, np.uint8))
    add_trailer(path)


def add_trailer(path: Path, data: tuple[int, int] | None = None) -> None:
    """Append a valid trailer for the HDF5 file at ``path`` (``data``: the blob's (offset, length) to declare;
    default: the `data` dataset's, or none)."""
    if data is None:
        with h5py.File(path, "r") as f:
            ds = f.get("data", getlink=True)
            off, n = None, 0
            if isinstance(ds, h5py.HardLink) and isinstance(f["data"], h5py.Dataset):
                off, n = f["data"].id.get_offset(), int(f["data"].size or 0)
        data = (int(off), n) if off is not None and n else (0, 0)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        os.pwrite(fd, _trailer(fd, size, data[0], data[1]), size)
    finally:
        os.close(fd)


def rewrite(path: Path, fn: Callable[[Forged], Any], **save_kw: Any) -> None:
    c = load(path)
    fn(c)
    save(path, c, **save_kw)


def manifest_doc(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "manifest.json").read_bytes())


def forge_manifest(run_dir: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Edit manifest.json and recompute its checksum (docs/reference/FORMAT.md section 2)."""
    doc = manifest_doc(run_dir)
    doc.pop("crc32", None)
    fn(doc)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doc["crc32"] = zlib.crc32(body)
    (run_dir / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True))


def write_manifest_bytes(run_dir: Path, body: bytes) -> None:
    """A manifest whose JSON is ``body`` verbatim (its checksum cannot be made valid if it does not parse)."""
    (run_dir / "manifest.json").write_bytes(body)
