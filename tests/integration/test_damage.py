"""Damaged run directories: recover() steps around a damaged file exactly, or raises CorruptFileError naming
it. It never returns a wrong state. (DESIGN.md §4-5, docs/reference/FORMAT.md §6)"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from lowdiff_harness import Scenario, assert_state_equal, train_run

import lowdiff
from lowdiff._storage.container import ContainerReader
from lowdiff._storage.manifest import read_manifest

STEPS = 10
# Snapshots 0, 4, 8; segments 1-3, 4-6, 7-9, 10-10.
SCENARIO = Scenario(model="mlp_bn", optimizer="adam", groups=2, compressor="topk", ratio=0.25, batch_steps=3,
                    every_steps=4, codec="zstd", clip=True)
NEWEST_SEGMENT = "log/steps-0000000010-0000000010.h5"
OLDER_SEGMENT = "log/steps-0000000007-0000000009.h5"
NEWEST_SNAPSHOT = "snapshots/step-0000000008.h5"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pristine") / "run"
    refs = train_run(SCENARIO, root, STEPS).refs
    for rel in (NEWEST_SEGMENT, OLDER_SEGMENT, NEWEST_SNAPSHOT):
        assert (root / rel).is_file(), sorted(str(p.relative_to(root)) for p in root.rglob("*.h5"))
    return root, refs


@pytest.fixture
def damaged_copy(pristine, tmp_path: Path):
    def _copy() -> Path:
        d = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        shutil.copytree(pristine[0], d)
        return d

    return _copy


def _flip(path: Path, pos: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ mask]))


def _regions(path: Path) -> dict[str, tuple[int, int]]:
    with h5py.File(path, "r") as f:
        idx = (int(f["index"].id.get_offset()), int(f["index"].shape[0]))
        data = (int(f["data"].id.get_offset()), int(f["data"].shape[0]))
    return {"index": idx, "data": data, "superblock": (0, 8)}


def _positions(path: Path) -> list[int]:
    """Bytes to damage: spread over the tensor bytes (checksummed entries), the JSON index and the HDF5
    signature."""
    out = []
    for start, n in _regions(path).values():
        k = 8 if n > 64 else 3
        out += [start + (i * (n - 1)) // max(k - 1, 1) for i in range(k)]
    return sorted(set(out))


def _check(run_dir: Path, refs, rel: str, step: int | None, allowed_steps: set[int]) -> str:
    """recover() must either return the exact state of some allowed step, or raise CorruptFileError naming
    the damaged file."""
    try:
        rec = lowdiff.recover(run_dir, step=step, workers=1)
    except lowdiff.CorruptFileError as e:
        assert str(run_dir / rel) in str(e), f"error does not name {rel}: {e}"
        return "raised"
    assert rec.step in allowed_steps, (rec.step, allowed_steps)
    assert_state_equal(*refs[rec.step], rec)
    return "fallback" if rec.report.skipped else "intact"


def test_pristine_copy_recovers(pristine, damaged_copy) -> None:
    run_dir = damaged_copy()
    assert _check(run_dir, pristine[1], "manifest.json", None, {STEPS}) == "intact"


def test_flipped_byte_in_newest_segment(pristine, damaged_copy) -> None:
    refs = pristine[1]
    outcomes = []
    for pos in _positions(pristine[0] / NEWEST_SEGMENT):
        run_dir = damaged_copy()
        _flip(run_dir / NEWEST_SEGMENT, pos)
        # Latest: the damaged segment moves the latest step back to 9 (reported), or the error names the file.
        outcome = _check(run_dir, refs, NEWEST_SEGMENT, None, {STEPS, STEPS - 1})
        outcomes.append(outcome)
        if outcome == "fallback":
            rec = lowdiff.recover(run_dir, workers=1)
            assert rec.step == STEPS - 1 and any(NEWEST_SEGMENT in s for s in rec.report.skipped)
        # Asking for step 10 itself can only be answered exactly or refused.
        _check(run_dir, refs, NEWEST_SEGMENT, STEPS, {STEPS})
        # Steps before it do not need the damaged file.
        assert_state_equal(*refs[9], lowdiff.recover(run_dir, step=9, workers=1))
        shutil.rmtree(run_dir)
    # Every damaged byte here is checksummed (JSON index, tensor bytes) or the HDF5 signature: all detected.
    assert "intact" not in outcomes, outcomes


def test_flipped_byte_in_newest_snapshot_falls_back_to_an_older_one(pristine, damaged_copy) -> None:
    refs = pristine[1]
    detected = 0
    positions = _positions(pristine[0] / NEWEST_SNAPSHOT)
    for pos in positions:
        run_dir = damaged_copy()
        _flip(run_dir / NEWEST_SNAPSHOT, pos)
        for target in (None, 8, 9):
            want = {STEPS} if target is None else {target}
            outcome = _check(run_dir, refs, NEWEST_SNAPSHOT, target, want)
            if outcome == "fallback":
                rec = lowdiff.recover(run_dir, step=target, workers=1)
                assert rec.report.snapshot_step == 4
                assert any(NEWEST_SNAPSHOT in s for s in rec.report.skipped)
                detected += 1
        shutil.rmtree(run_dir)
    assert detected == 3 * len(positions), "every damaged byte here must be detected and stepped around"


def test_flipped_byte_in_older_segment(pristine, damaged_copy) -> None:
    """7-9 is needed for steps 9 and 10 from every snapshot: those are refused (or exact); 8 is not affected."""
    refs = pristine[1]
    for pos in _positions(pristine[0] / OLDER_SEGMENT)[::2]:
        run_dir = damaged_copy()
        _flip(run_dir / OLDER_SEGMENT, pos)
        _check(run_dir, refs, OLDER_SEGMENT, None, {STEPS, 8, 6})
        _check(run_dir, refs, OLDER_SEGMENT, 9, {9})
        assert_state_equal(*refs[8], lowdiff.recover(run_dir, step=8, workers=1))
        shutil.rmtree(run_dir)


def test_damaged_manifest_is_refused_naming_it(pristine, damaged_copy) -> None:
    refs = pristine[1]
    run_dir = damaged_copy()
    manifest = run_dir / "manifest.json"
    original = manifest.read_bytes()
    raised = 0
    for pos in range(0, len(original), 5):
        manifest.write_bytes(original)
        _flip(manifest, pos, 1 << (pos % 8))
        raised += _check(run_dir, refs, "manifest.json", None, {STEPS}) == "raised"
    assert raised > len(original) // 5 * 0.9
    for data in (b"", original[: len(original) // 2], b"[]", b"{}"):
        manifest.write_bytes(data)
        assert _check(run_dir, refs, "manifest.json", None, set()) == "raised"


@pytest.mark.parametrize("rel, keep", [(NEWEST_SEGMENT, 0.5), (NEWEST_SEGMENT, 0.98), (NEWEST_SNAPSHOT, 0.5),
                                       (NEWEST_SNAPSHOT, 0.0), (OLDER_SEGMENT, 0.9)])
def test_truncated_file(pristine, damaged_copy, rel: str, keep: float) -> None:
    run_dir = damaged_copy()
    path = run_dir / rel
    os.truncate(path, int(path.stat().st_size * keep))
    outcome = _check(run_dir, pristine[1], rel, None, {STEPS, 9, 8, 6})
    assert outcome in ("raised", "fallback")


def test_missing_newest_segment_moves_latest_back(pristine, damaged_copy) -> None:
    run_dir = damaged_copy()
    (run_dir / NEWEST_SEGMENT).unlink()
    rec = lowdiff.recover(run_dir, workers=1)
    assert rec.step == 9 and rec.report.skipped == []
    assert_state_equal(*pristine[1][9], rec)
    with pytest.raises(lowdiff.StepNotAvailableError):
        lowdiff.recover(run_dir, step=10)


def test_stale_tmp_files_are_ignored(pristine, damaged_copy) -> None:
    run_dir = damaged_copy()
    (run_dir / "log" / "steps-0000000011-0000000012.h5.tmp").write_bytes(b"partial")
    (run_dir / "snapshots" / "step-0000000012.h5.tmp").write_bytes(os.urandom(100))
    (run_dir / "manifest.json.tmp").write_bytes(b"{")
    rec = lowdiff.recover(run_dir, workers=1)
    assert rec.step == STEPS and rec.report.skipped == []
    assert_state_equal(*pristine[1][STEPS], rec)


def test_both_newest_snapshot_and_a_segment_damaged(pristine, damaged_copy) -> None:
    run_dir = damaged_copy()
    for rel in (NEWEST_SNAPSHOT, NEWEST_SEGMENT):
        start, n = _regions(run_dir / rel)["data"]
        _flip(run_dir / rel, start + n // 2)
    outcome = _check(run_dir, pristine[1], NEWEST_SEGMENT, None, {9})
    if outcome == "fallback":
        rec = lowdiff.recover(run_dir, workers=1)
        assert rec.report.snapshot_step == 4 and len(rec.report.skipped) == 2


def test_parallel_recovery_steps_around_damage_too(pristine, damaged_copy) -> None:
    """The damaged file is found during a parallel replay; the fallback is the same, still exact."""
    refs = pristine[1]
    run_dir = damaged_copy()
    start, n = _regions(run_dir / NEWEST_SNAPSHOT)["data"]
    _flip(run_dir / NEWEST_SNAPSHOT, start + n // 3)
    rec = lowdiff.recover(run_dir, step=9, workers=2)
    assert rec.report.mode == "parallel" and rec.report.snapshot_step == 4
    assert any(NEWEST_SNAPSHOT in s for s in rec.report.skipped)
    assert_state_equal(*refs[9], rec)


# --- known bugs -----------------------------------------------------------------------------------------------


def test_index_that_is_not_a_dataset_is_corrupt(pristine, damaged_copy) -> None:
    run_dir = damaged_copy()
    path = run_dir / NEWEST_SNAPSHOT
    with h5py.File(path, "r+") as f:
        del f["index"]
        f["index"] = np.dtype("u1")  # a committed datatype where the dataset should be
    with pytest.raises(lowdiff.CorruptFileError, match=str(path)):
        ContainerReader(path, "snapshot")


def _recover_in_child(run_dir: str, queue) -> None:  # pragma: no cover - runs in a forked child
    try:
        rec = lowdiff.recover(run_dir, workers=1)
        queue.put(("ok", rec.step))
    except lowdiff.CorruptFileError as e:
        queue.put(("corrupt", str(e)))
    except BaseException as e:
        queue.put((type(e).__name__, str(e)))


def test_damaged_attribute_heap_does_not_hang_recovery(pristine, damaged_copy) -> None:
    run_dir = damaged_copy()
    path = run_dir / NEWEST_SEGMENT
    raw = path.read_bytes()
    gcol = raw.find(b"GCOL")
    assert gcol >= 0, "the container has no global heap (the attributes moved): revisit this test"
    _flip(path, gcol + 16 + 8)  # size field of the heap's first object
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_recover_in_child, args=(str(run_dir), queue), daemon=True)
    proc.start()
    proc.join(timeout=10)
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join(timeout=10)
    assert not hung, "recover() did not finish within 10 s"
    kind, detail = queue.get(timeout=5)
    assert kind in ("ok", "corrupt"), (kind, detail)


def test_damage_found_by_a_worker_process_is_stepped_around(pristine, damaged_copy) -> None:
    """The damaged column belongs to worker process 1's share: only that child reads it. Its error must reach the
    parent with the file named, and recovery steps around the file exactly as in one process."""
    refs = pristine[1]
    run_dir = damaged_copy()
    path = run_dir / NEWEST_SEGMENT
    manifest = read_manifest(run_dir)
    last = manifest.optimized_params[-1]  # contiguous shares: the last tensor is in the last worker's share
    reader = ContainerReader(path, "segment")
    try:
        entry = next(d for name, d in reader.entries.items() if name.startswith(f"grad/{last}/"))
    finally:
        reader.close()
    start, _ = _regions(path)["data"]
    _flip(path, start + entry["offset"] + entry["nbytes"] // 2)
    rec = lowdiff.recover(run_dir, workers=2)
    assert rec.report.mode == "parallel" and rec.report.workers == 2
    assert rec.step == STEPS - 1 and any(NEWEST_SEGMENT in s for s in rec.report.skipped)
    assert_state_equal(*refs[STEPS - 1], rec)
