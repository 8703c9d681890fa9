"""Container data written past the page cache (O_DIRECT): the same bytes as a buffered write, whatever the pieces'
sizes and the data's unaligned start, and still complete when the file system refuses it or a write comes back
short. Writes are watched through lowdiff.testing.intercept_writes; a write counts as direct when its descriptor
has O_DIRECT set."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowdiff
from lowdiff import CheckpointWriteError
from lowdiff._storage.container import ContainerReader, EntryIn, write_container
from lowdiff.config import load_config
from lowdiff.testing import intercept_writes, real_pwritev, takes_direct_io

MB = 1 << 20


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


class Watch:
    """Counts the bytes written through direct and buffered descriptors; ``fail_direct(fd, bufs, off)`` may answer
    a direct write instead of the real one."""

    def __init__(self, fail_direct: Callable[[int, list[Any], int], int] | None = None) -> None:
        self.direct = 0
        self.buffered = 0
        self.fail_direct = fail_direct

    def __call__(self, fd: int, buffers: list[Any], offset: int) -> int:
        if _is_direct(fd):
            n = self.fail_direct(fd, buffers, offset) if self.fail_direct else real_pwritev(fd, buffers, offset)
            self.direct += n
            return n
        n = real_pwritev(fd, buffers, offset)
        self.buffered += n
        return n


def _aligned(data: bytes, skew: int = 0) -> memoryview:
    """``data`` in page-aligned memory (an anonymous mmap), starting ``skew`` bytes into it."""
    page = np.frombuffer(mmap.mmap(-1, max(len(data) + skew, 1)), dtype=np.uint8)
    page[skew:skew + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return page[skew:skew + len(data)].data


def _entries(sizes: list[int], seed: int) -> list[EntryIn]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        # Tensors, views at odd offsets into a larger tensor, bytes, and page-aligned memory (written from where it
        # lies when its place in the file is aligned too), at the start of a page or not.
        kind = (i + seed) % 4
        raw: list[Any] = ([t] if kind == 0 else [t[1:], bytes(t[:1].numpy())] if kind == 1
                          else [bytes(t.numpy())] if kind == 2 else [_aligned(bytes(t.numpy()), (seed % 3) * 2048)])
        out.append(EntryIn(f"e{i}", raw, {}))
    return out


def _read_all(path: Path) -> dict[str, bytes]:
    with ContainerReader(path, "snapshot") as r:
        return {name: bytes(r.read(name, d["raw_nbytes"])) for name, d in r.entries.items()}


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not takes_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT (tmpfs?): the buffered path is what every other test runs")
    return tmp_path


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(st.integers(0, 5000), st.integers(MB // 2, 3 * MB)), min_size=1, max_size=6),
       seed=st.integers(0, 10))
def test_direct_and_buffered_files_are_the_same_bytes(direct_dir: Path, sizes: list[int], seed: int) -> None:
    entries = _entries(sizes, seed)
    watch = Watch()
    a, b = direct_dir / f"a{seed}.h5", direct_dir / f"b{seed}.h5"
    with intercept_writes(pwritev=watch):
        write_container(a, "snapshot", {"k": 1}, entries, "none", direct=True)
    used = watch.direct
    with intercept_writes(pwritev=watch):
        write_container(b, "snapshot", {"k": 1}, entries, "none", direct=False)
    assert watch.direct == used, "direct=False wrote through O_DIRECT"
    assert a.read_bytes() == b.read_bytes()
    if sum(sizes) >= 2 * MB:  # the aligned middle of the data region is at least 1 MB
        assert used > 0, "a container of several MB was written through the page cache only"
    a.unlink()
    b.unlink()


def _big() -> list[EntryIn]:
    return _entries([3 * MB + 17, 5, 2 * MB + 4093, 3 * MB], seed=3)


def test_aligned_memory_goes_past_the_page_cache_from_where_it_lies(direct_dir: Path) -> None:
    """A container of a few MB has its data region at an aligned file offset; an entry in page-aligned memory at an
    aligned place in it is written straight from that memory (no copy through the bounce buffer), the entries
    around it as before, and the file holds the same bytes as one written through the page cache."""
    g = torch.Generator().manual_seed(0)
    blobs = [bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy())
             for n in (3 * MB, 2 * MB + 5, 3 * MB)]
    first, middle = _aligned(blobs[0]), _aligned(blobs[2])
    entries = [EntryIn("a", [first], {}), EntryIn("b", [blobs[1]], {}), EntryIn("c", [middle], {})]
    spans = {name: (np.frombuffer(v, dtype=np.uint8).ctypes.data, v.nbytes) for name, v in (("a", first),
                                                                                            ("c", middle))}
    sources: list[tuple[int, int]] = []

    def watch(fd: int, buffers: list[Any], offset: int) -> int:
        if _is_direct(fd):
            sources.extend((np.frombuffer(b, dtype=np.uint8).ctypes.data, memoryview(b).nbytes) for b in buffers)
        return real_pwritev(fd, buffers, offset)

    a, b = direct_dir / "a.h5", direct_dir / "b.h5"
    with intercept_writes(pwritev=watch):
        write_container(a, "snapshot", {}, entries, "none", direct=True)
    write_container(b, "snapshot", {}, entries, "none", direct=False)
    assert a.read_bytes() == b.read_bytes()
    with h5py.File(a, "r") as f:
        assert f["data"].id.get_offset() % 4096 == 0
    assert (spans["a"][0], 3 * MB) in sources, "the first entry was not written from its own memory"
    # "c" lies at 5 MB + 5 in the data: not aligned in the file, so it is copied (its memory is not reused as is).
    assert all(not spans["c"][0] <= addr < spans["c"][0] + spans["c"][1] for addr, _ in sources)


@pytest.mark.parametrize("how", ["refused", "short", "enospc"])
def test_a_refused_or_short_direct_write_still_commits_the_whole_file(direct_dir: Path, how: str) -> None:
    entries = _big()
    ref = direct_dir / "ref.h5"
    write_container(ref, "snapshot", {}, entries, "none", direct=False)

    def refused(fd: int, buffers: list[Any], offset: int) -> int:
        raise OSError(errno.EINVAL, "O_DIRECT not supported here")  # a FUSE file system that took the open

    def short(fd: int, buffers: list[Any], offset: int) -> int:
        return real_pwritev(fd, [memoryview(buffers[0])[:4096]], offset)  # one block, then the rest buffered

    def enospc(fd: int, buffers: list[Any], offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    watch = Watch({"refused": refused, "short": short, "enospc": enospc}[how])
    path = direct_dir / "c.h5"
    with intercept_writes(pwritev=watch):
        if how == "enospc":  # a real failure is not taken for a refusal: nothing is committed
            with pytest.raises(CheckpointWriteError):
                write_container(path, "snapshot", {}, entries, "none", direct=True)
            assert not path.exists() and not list(direct_dir.glob("*.tmp"))
            return
        write_container(path, "snapshot", {}, entries, "none", direct=True)
    assert path.read_bytes() == ref.read_bytes()
    assert _read_all(path) == _read_all(ref)
    if how == "short":
        assert watch.direct > 0


def test_direct_io_false_in_the_config_keeps_every_write_in_the_page_cache(tmp_path: Path) -> None:
    """Thread persistence (its writes are this process's, so the seam sees them): a 4 MB model's snapshots go past
    the page cache by default and not with ``log.direct_io: false``; recovery is exact either way."""
    direct_ok = takes_direct_io(tmp_path)
    for direct in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
        run = tmp_path / f"run-{direct}"
        watch = Watch()
        with intercept_writes(pwritev=watch):
            opt = lowdiff.wrap(torch.optim.Adam(model.parameters(), lr=1e-3), model, {
                "run_dir": str(run), "compressor": {"name": "topk", "ratio": 0.05},
                "snapshot": {"every_steps": 3},
                "log": {"persistence": "thread", "batch_steps": 2, "direct_io": direct}})
            for i in range(7):
                model(torch.randn(8, 512, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            opt.close()
        if direct and direct_ok:
            assert watch.direct > 3 * MB
        elif not direct:
            assert watch.direct == 0
        rec = lowdiff.recover(run)
        for name, p in model.named_parameters():
            assert torch.equal(rec.model[name], p.detach())


def test_direct_io_must_be_a_flag() -> None:
    with pytest.raises(lowdiff.ConfigError, match="log.direct_io"):
        load_config({"run_dir": "x", "log": {"direct_io": "yes"}})
