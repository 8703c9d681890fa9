"""A log segment built straight from packed steps (lowdiff._storage.segment_packed, the writer thread's steady state)
holds the same entries, byte for byte, as the segment written from the same steps unpacked into tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowdiff._storage.container import ContainerReader
from lowdiff._storage.format import LOG_DIR
from lowdiff._storage.packed import Received
from lowdiff._storage.segment import KIND, StepRecord, write_segment
from lowdiff._transfer.packing import PackedStep, StepPacker, pack_host

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


@pytest.mark.parametrize("received", [False, True])
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_segment_from_packed_steps_equals_the_one_from_their_tensors(tmp_path: Path, codec: str,
                                                                       received: bool) -> None:
    keys, steps = _steps()
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
