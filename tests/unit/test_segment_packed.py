"""A log segment built straight from packed steps (lowdiff._storage.segment_packed, the writer thread's steady state)
holds the same entries, byte for byte, as the segment written from the same steps unpacked into tensors."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from lowdiff._storage.container import ContainerReader
from lowdiff._storage.format import LOG_DIR
from lowdiff._storage.packed import Received
from lowdiff._storage.segment import KIND, StepRecord, write_segment
from lowdiff._transfer.packing import PackedStep, StepPacker, pack_host
from lowdiff.testing import intercept_writes, real_pwritev, takes_direct_io

STEPS = 6


def _records(packer: StepPacker, tensors_at: list[list[torch.Tensor]], keys: list[tuple[str, str]],
             received: bool = False) -> list[StepRecord]:
    """Packed as the training side packs them, or (``received``) as the persistence process holds them."""
    out = []
    for i, tensors in enumerate(tensors_at):
        layout, _ = packer.plan(keys, tensors)
        assert layout is not None
        buf = torch.full((layout.nbytes + 13,), 0xCD, dtype=torch.uint8)  # a pooled buffer may be longer
        pack_host(layout, tensors, buf)
        rng = {"torch": torch.tensor([i // 2, 7, 9], dtype=torch.uint8)}  # changes every other step
        out.append(StepRecord(step=10 + i, groups=[{"lr": 0.1 * i}], grads={}, rng=rng,
                              data={"epoch": i},
                              packed=Received(buf, layout.wire) if received else PackedStep(buf, layout)))
    return out


def _steps() -> tuple[list[tuple[str, str]], list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    keys = [("w", "values"), ("w", "indices"), ("b", "p"), ("", "bn.running_mean"), ("b", "q"), ("s", "x"),
            ("e", "x"), ("h", "v"), ("", "bn.num_batches_tracked"), ("", "frozen"), ("w2", "x")]
    steps = []
    for i in range(STEPS):
        steps.append([
            torch.randn(7, generator=g), torch.randint(0, 100, (7,), generator=g, dtype=torch.int32),
            torch.randn(5, 2, generator=g, dtype=torch.float64),
            torch.randn(4, generator=g) if i % 3 else torch.zeros(4),  # changes at some steps only
            torch.randn(3, 2, generator=g), torch.tensor(float(i)), torch.empty(0, 3),
            torch.randn(6, generator=g).to(torch.bfloat16), torch.tensor(i // 2, dtype=torch.int64),
            torch.ones(2, 2), torch.randn(2, 9, generator=g, dtype=torch.float16)])
    return keys, steps


def _contents(path: Path) -> tuple[dict, dict[str, bytes]]:
    with ContainerReader(path, KIND) as r:
        return r.meta, {n: bytes(r.read(n, d["raw_nbytes"])) for n, d in r.entries.items()}


def _index(path: Path) -> list[dict]:
    with ContainerReader(path, KIND) as r:
        return sorted(r.entries.values(), key=lambda d: d["offset"])


@pytest.mark.parametrize("n", [STEPS, 1])  # 1: compressor none's segments, sliced from the step's buffer as it lies
@pytest.mark.parametrize("received", [False, True])
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_segment_from_packed_steps_equals_the_one_from_their_tensors(tmp_path: Path, codec: str,
                                                                       received: bool, n: int) -> None:
    keys, steps = _steps()
    steps = steps[:n]
    packed = _records(StepPacker(), steps, keys, received)
    unpacked = [r.unpacked() for r in _records(StepPacker(), steps, keys)]
    assert all(r.packed is None for r in unpacked) and all(r.packed is not None for r in packed)
    assert [r.payload_nbytes for r in packed] == [r.payload_nbytes for r in unpacked]
    paths = []
    for name, records in (("packed", packed), ("unpacked", unpacked)):
        d = tmp_path / name
        (d / LOG_DIR).mkdir(parents=True)
        write_segment(d, records, codec, "topk")
        (path,) = (d / LOG_DIR).iterdir()
        paths.append(path)
    fast, slow = (_contents(p) for p in paths)
    assert json.dumps(fast[0]) == json.dumps(slow[0])  # metadata: steps, groups, tracked data
    assert list(fast[1]) == list(slow[1]) and fast[1] == slow[1]  # every entry, in the same order, same bytes
    assert _index(paths[0]) == _index(paths[1])  # offsets, sizes, checksums, counts, dtypes, shapes
    counts = {d["name"]: d["counts"] for d in _index(paths[0])}
    if n == 1:
        assert counts["buffer/frozen"] == [4] and counts["grad/w/values"] == [7]
        return
    assert counts["buffer/frozen"] == [4] + [-1] * (STEPS - 1)  # written once, unchanged after
    assert counts["buffer/bn.running_mean"].count(-1) == 0  # zeros at steps 0 and 3, random between
    assert counts["buffer/bn.num_batches_tracked"] == [1, -1, 1, -1, 1, -1]
    assert counts["rng/torch"] == [3, -1, 3, -1, 3, -1]
    assert counts["grad/e/x"] == [0] * STEPS


def test_steps_packed_with_different_layouts_are_written_from_their_tensors(tmp_path: Path) -> None:
    """A parameter without a gradient at one step changes the layout: the segment falls back to the tensors and
    still holds every step (the missing one as -1)."""
    keys, steps = _steps()
    packer = StepPacker()
    records = _records(packer, steps[:2], keys) + _records(packer, [steps[2][1:]], keys[1:])
    for i, r in enumerate(records):
        r.step = 10 + i
    (tmp_path / LOG_DIR).mkdir()
    write_segment(tmp_path, records, "none", "topk")
    (path,) = (tmp_path / LOG_DIR).iterdir()
    counts = {d["name"]: d["counts"] for d in _index(path)}
    assert counts["grad/w/values"] == [7, 7, -1] and counts["grad/w/indices"] == [7, 7, 7]


def _big_steps(n: int, seed: int) -> tuple[list[tuple[str, str]], list[list[torch.Tensor]]]:
    """``STEPS`` steps of a Top-k-like payload of ``n`` entries: a segment of about ``STEPS * 8 * n`` bytes."""
    g = torch.Generator().manual_seed(seed)
    keys = [("w", "values"), ("w", "indices"), ("", "bn.running_mean")]
    return keys, [[torch.randn(n, generator=g), torch.randint(0, 1 << 30, (n,), generator=g, dtype=torch.int32),
                   torch.randn(3, generator=g)] for _ in range(STEPS)]


def _write_pair(root: Path, name: str, keys: list[tuple[str, str]], steps: list[list[torch.Tensor]]) -> None:
    """The segment from packed steps and from the same steps unpacked; asserts they are the same file contents."""
    paths = []
    for kind, records in (("packed", _records(StepPacker(), steps, keys)),
                          ("unpacked", [r.unpacked() for r in _records(StepPacker(), steps, keys)])):
        d = root / name / kind
        (d / LOG_DIR).mkdir(parents=True)
        write_segment(d, records, "none", "topk")
        (path,) = (d / LOG_DIR).iterdir()
        paths.append(path)
    assert _contents(paths[0]) == _contents(paths[1]), name
    assert _index(paths[0]) == _index(paths[1]), name


def test_segments_written_one_after_another_and_from_two_threads_keep_their_own_bytes(tmp_path: Path) -> None:
    """The writing thread keeps the buffers a segment is built in for its next segment: segments that grow, shrink
    and grow past what was kept, one after another and from two threads at once, each hold their own steps."""
    sizes = [40_000, 3, 90_000, 1_000, 300_000]  # 1.9 MB, 0.1 kB, 4.3 MB, 48 kB, 14 MB of gradient bytes
    for i, n in enumerate(sizes):
        _write_pair(tmp_path, f"seq{i}", *_big_steps(n, seed=i))
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i, n in enumerate([90_000] * 6):  # the same size in both: each reuses what it kept
                _write_pair(tmp_path, f"t{t}-{i}", *_big_steps(n + t, seed=10 * t + i))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)


def test_a_large_segment_goes_to_the_device_from_the_buffer_it_was_built_in(tmp_path: Path) -> None:
    """The segment's bytes are joined in page-aligned memory and its data region is aligned in the file, so a
    direct write takes them from where they lie: no block is copied through a reused bounce buffer first (each
    direct write comes from memory no other one used)."""
    if not takes_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT (tmpfs?)")
    addresses: list[tuple[int, int]] = []

    def watch(fd: int, buffers: list[Any], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            addresses.extend((np.frombuffer(b, dtype=np.uint8).ctypes.data, offset) for b in buffers)
        return real_pwritev(fd, buffers, offset)

    keys, steps = _big_steps(400_000, seed=3)  # 19 MB: more than one bounce buffer's worth
    (tmp_path / LOG_DIR).mkdir()
    with intercept_writes(pwritev=watch):
        write_segment(tmp_path, _records(StepPacker(), steps, keys), "none", "topk")
    (path,) = (tmp_path / LOG_DIR).iterdir()
    with h5py.File(path, "r") as f:
        data_offset = f["data"].id.get_offset()
    assert data_offset % 4096 == 0, "the data region of a large container starts at an aligned file offset"
    assert addresses, "nothing went past the page cache"
    assert len({a for a, _ in addresses}) == len(addresses), f"a buffer was reused for several blocks: {addresses}"
    assert addresses[0][1] == data_offset
