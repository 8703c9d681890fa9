"""The HDF5 container: round trip over codecs; damage and truncation are CorruptFileError naming the file."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowdiff import CorruptFileError
from lowdiff._storage import atomic, codecs
from lowdiff._storage.container import ContainerReader, EntryIn, write_container
from lowdiff._storage.format import FORMAT_VERSION

CODECS = list(codecs.CODECS)
DTYPES = {"param/a": "float32", "param/b": "int64", "optim/a/step": "float32", "empty": "uint8"}


def _entries(seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "param/a": bytes(rng.getrandbits(8) for _ in range(3000)),
        "param/b": b"MARKER-" * 200,
        "optim/a/step": b"\x01\x02\x03\x04",
        "empty": b"",
    }


def _write(path: Path, entries: dict[str, bytes], codec: str, format_version: int = FORMAT_VERSION) -> None:
    # Entry "param/a" is given as two chunks: the writer concatenates them.
    ins = []
    for name, raw in entries.items():
        chunks = [raw[: len(raw) // 2], raw[len(raw) // 2 :]] if name == "param/a" else [raw]
        ins.append(EntryIn(name, chunks, {"dtype": DTYPES[name], "shape": [len(raw)]}))
    write_container(path, "snapshot", {"step": 3}, ins, codec, format_version=format_version)


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip(tmp_path: Path, codec: str) -> None:
    path = tmp_path / "c.h5"
    entries = _entries()
    _write(path, entries, codec)
    assert not atomic.tmp_path(path).exists()
    with ContainerReader(path, "snapshot") as r:
        assert r.meta == {"step": 3}
        assert set(r.entries) == set(entries)
        for name, raw in entries.items():
            assert bytes(r.read(name, len(raw))) == raw
            assert r.entries[name]["dtype"] == DTYPES[name] and r.entries[name]["codec"] == codec


def test_the_same_entries_written_a_second_apart_make_the_same_file(tmp_path: Path) -> None:
    """No timestamp in the file (libhdf5 stamps objects with their creation time unless told not to): a rewritten
    file is the same bytes, and the direct and buffered writes of one container compare equal whenever they run."""
    entries = {**_entries(), "param/a": bytes(range(256)) * 8192}  # 2 MB: the data region is aligned too
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    _write(a, entries, "none")
    t = time.time()
    time.sleep(1.05 - (t - int(t)))  # into the next wall-clock second
    _write(b, entries, "none")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_a_written_file_has_its_pages_dropped_only_once_it_is_synced(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints are read only at recovery: their pages are given back (fresh page-cache pages cost 2-3 ms of
    system CPU per MB on the shared VM, docs/measurements/pagecache.md), and only after the fsync, when they are
    clean (advice on dirty pages drops nothing)."""
    calls: list[tuple[str, int]] = []
    fsync, advise = os.fsync, os.posix_fadvise

    def spy_fsync(fd: int) -> None:
        calls.append(("fsync", fd))
        fsync(fd)

    def spy_advise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append(("advise", fd))
        assert (offset, length, advice) == (0, 0, os.POSIX_FADV_DONTNEED)
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "posix_fadvise", spy_advise)
    path = tmp_path / "c.h5"
    _write(path, _entries(), "none")
    advised = [fd for kind, fd in calls if kind == "advise"]
    assert len(advised) == 1
    assert ("fsync", advised[0]) in calls[:calls.index(("advise", advised[0]))]  # the file's fsync came first
    with ContainerReader(path, "snapshot") as r:
        assert bytes(r.read("param/b", 1400)) == b"MARKER-" * 200
    r_fd, w_fd = os.pipe()  # advice the descriptor cannot take (ESPIPE) is ignored: it is advice only
    try:
        atomic.drop_cached(r_fd)
    finally:
        os.close(r_fd)
        os.close(w_fd)


@pytest.mark.parametrize("codec", CODECS)
@given(blobs=st.lists(st.binary(max_size=300), min_size=0, max_size=5))
def test_round_trip_any_entries(tmp_path_factory: pytest.TempPathFactory, codec: str, blobs: list[bytes]) -> None:
    path = tmp_path_factory.mktemp("c") / "x.h5"
    write_container(path, "segment", {"n": len(blobs)},
                    [EntryIn(f"e{i}", [b], {}) for i, b in enumerate(blobs)], codec)
    with ContainerReader(path, "segment") as r:
        assert [bytes(r.read(f"e{i}", len(b))) for i, b in enumerate(blobs)] == blobs


def _offset(path: Path, dataset: str) -> int:
    with h5py.File(path, "r") as f:
        off = f[dataset].id.get_offset()
    assert off is not None
    return int(off)


def _flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("codec", CODECS)
def test_bit_flip_in_data_is_corrupt_and_names_the_file(tmp_path: Path, codec: str) -> None:
    path = tmp_path / "c.h5"
    entries = _entries()
    _write(path, entries, codec)
    with ContainerReader(path, "snapshot") as r:
        d = r.entries["param/b"]
    _flip(path, _offset(path, "data") + d["offset"] + d["nbytes"] // 2)
    with ContainerReader(path, "snapshot") as r:
        # Untouched entries still read fine; the damaged one never comes back silently.
        assert bytes(r.read("param/a", len(entries["param/a"]))) == entries["param/a"]
        with pytest.raises(CorruptFileError, match="checksum") as e:
            r.read("param/b", len(entries["param/b"]))
    assert str(path) in str(e.value) and "param/b" in str(e.value)


def test_bit_flip_in_index_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    _write(path, _entries(), "none")
    _flip(path, _offset(path, "index") + 5)
    with pytest.raises(CorruptFileError) as e:
        ContainerReader(path, "snapshot")
    assert str(path) in str(e.value)


@pytest.mark.parametrize("keep", [0, 1, 100, 0.5, -1])
def test_truncated_file_is_corrupt(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "c.h5"
    entries = _entries()
    _write(path, entries, "lz4")
    size = path.stat().st_size
    new = int(size * keep) if isinstance(keep, float) else (size + keep if keep < 0 else keep)
    os.truncate(path, new)
    with pytest.raises(CorruptFileError) as e:
        with ContainerReader(path, "snapshot") as r:
            for name, raw in entries.items():
                r.read(name, len(raw))
    assert str(path) in str(e.value)


def test_wrong_kind_version_and_missing(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    _write(path, _entries(), "none")
    with pytest.raises(CorruptFileError, match="not a lowdiff segment file"):
        ContainerReader(path, "segment")
    # Any edit behind lowdiff's back breaks the metadata checksum in the trailer...
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 99
    with pytest.raises(CorruptFileError, match="trailer|checksum"):
        ContainerReader(path, "snapshot")
    # ...while a well-formed file from a newer format version is refused with advice.
    newer = tmp_path / "newer.h5"
    _write(newer, _entries(), "none", format_version=99)
    with pytest.raises(CorruptFileError, match="upgrade lowdiff"):
        ContainerReader(newer, "snapshot")
    with pytest.raises(FileNotFoundError):
        ContainerReader(tmp_path / "absent.h5", "snapshot")
    (tmp_path / "junk.h5").write_bytes(b"this is not hdf5" * 10)
    with pytest.raises(CorruptFileError, match="junk.h5"):
        ContainerReader(tmp_path / "junk.h5", "snapshot")


def test_reader_checks_sizes_against_the_callers_expectation(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    entries = _entries()
    _write(path, entries, "zstd")
    with ContainerReader(path, "snapshot") as r:
        with pytest.raises(CorruptFileError, match="expected"):
            r.read("param/a", len(entries["param/a"]) + 1)
        with pytest.raises(CorruptFileError, match="missing entry"):
            r.read("param/zzz", 1)


def test_write_failure_commits_nothing(tmp_path: Path) -> None:
    import errno

    import lowdiff
    from lowdiff.testing import intercept_writes

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "c.h5"
    with intercept_writes(pwritev=enospc), pytest.raises(lowdiff.CheckpointWriteError) as e:
        _write(path, _entries(), "none")
    assert e.value.errno == errno.ENOSPC and str(path) in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_data_dataset_is_uint8(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    _write(path, _entries(), "none")
    with h5py.File(path, "r") as f:
        assert f["data"].dtype == np.uint8 and f["index"].dtype == np.uint8
