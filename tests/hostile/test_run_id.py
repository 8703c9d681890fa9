"""Every file of a run names the run (its run id) and its own step(s) and shard (docs/reference/FORMAT.md §2, §8);
a run written before run ids (tests/data/golden-2.0) stays readable and resumable."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from forge import load
from lowdiff_harness import Scenario, assert_state_equal, start, train_run

import lowdiff
from lowdiff._recovery.verify import verify
from lowdiff._storage.format import list_segments, list_snapshots
from lowdiff._storage.manifest import read_manifest, run_id_from_ints, run_id_to_ints, shared_run_id

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden-2.0"
GOLDEN_SCENARIO = Scenario(model="mlp_bn", optimizer="sgd", groups=2, compressor="topk", ratio=0.25, batch_steps=3,
                           every_steps=4, codec="zstd", scheduler=True)


def _metas(run: Path) -> list[dict]:
    paths = [p for f in list_snapshots(run).values() for p in f.paths]
    paths += [p for _, _, f in list_segments(run) for p in f.paths]
    return [load(p).meta for p in paths]


def test_every_file_names_the_run_and_its_shard(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(Scenario(compressor="topk", ratio=0.5), run, 7)
    m = read_manifest(run)
    assert m.run_id is not None and len(m.run_id) == 32 and m.format_minor == 6
    metas = _metas(run)
    assert len(metas) >= 4 and all(meta["run_id"] == m.run_id and meta["shard"] == [0, 1] for meta in metas)
    seg = [meta for meta in metas if "first_step" in meta]
    assert all(meta["compressor_params"] == {"ratio": 0.5, "rank": 2} for meta in seg)
    # A second run draws another id.
    train_run(Scenario(), tmp_path / "other", 2)
    assert read_manifest(tmp_path / "other").run_id != m.run_id


def test_resume_and_compact_keep_the_run_id(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(Scenario(), run, 4)
    run_id = read_manifest(run).run_id
    t = start(Scenario(), run)
    t.train(5, 8)
    t.opt.close()
    from lowdiff._recovery.compact import compact

    compact(run, step=7)
    assert {meta["run_id"] for meta in _metas(run)} == {run_id}
    assert verify(run).ok


def test_run_id_broadcast_encoding_round_trips() -> None:
    for rid in ("0" * 32, "f" * 32, "8" + "0" * 31, "7" + "f" * 31, "0123456789abcdef" * 2):
        ints = run_id_to_ints(rid)
        assert all(-(2**63) <= v < 2**63 for v in ints)  # fits the int64 tensor broadcast_ints sends
        assert run_id_from_ints(ints) == rid
    seen: list[list[int]] = []
    rid = shared_run_id(lambda values, what: seen.append(values) or values)
    assert len(seen) == 1 and run_id_from_ints(seen[0]) == rid


def test_golden_run_without_run_id_recovers_exactly_and_verifies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "run", run)
    expected = torch.load(GOLDEN / "expected.pt", weights_only=True)
    assert read_manifest(run).run_id is None
    for step in (4, 5, 6):
        assert_state_equal(*expected[step], lowdiff.recover(run, step=step, workers=1))
    assert verify(run).ok


def test_golden_run_resumed_by_this_version_stays_without_run_id(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "run", run)
    before = json.loads((run / "manifest.json").read_text())
    t = start(GOLDEN_SCENARIO, run)
    assert t.opt.step_count == 6
    t.train(7, 11)
    t.opt.close()
    after = json.loads((run / "manifest.json").read_text())
    # The resume recorded its branch of the run's history (format 2.4) and nothing else.
    (branch, step), = after.pop("history")
    assert step == 6 and len(branch) == 32
    for doc in (before, after):
        doc.pop("crc32"), doc.pop("format_minor", None)
    assert after == before
    assert all("run_id" not in meta for meta in _metas(run))
    assert {meta.get("branch") for meta in _metas(run)} == {None, branch}
    for step in (9, 11):
        assert_state_equal(*t.refs[step], lowdiff.recover(run, step=step, workers=1))
    assert verify(run).ok


def test_disk_full_at_the_writer_lock_names_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20: ENOSPC while wrap() takes the lock was a bare OSError naming no path."""
    real = os.ftruncate

    def full(fd: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "ftruncate", full)  # the disk, not lowdiff, is patched
    with pytest.raises(lowdiff.CheckpointWriteError) as e:
        start(Scenario(), tmp_path / "run")
    assert e.value.errno == errno.ENOSPC and "writer.lock" in str(e.value) and "free disk space" in str(e.value)
    monkeypatch.setattr(os, "ftruncate", real)
    t = start(Scenario(), tmp_path / "run")  # nothing left locked
    t.opt.close()


def test_a_planted_lock_symlink_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "writer.lock").symlink_to(victim)
    with pytest.raises(lowdiff.CheckpointWriteError, match="symbolic link"):
        start(Scenario(), run)
    assert victim.read_text() == "precious"


@pytest.mark.distributed
def test_every_rank_stamps_the_same_run_id(tmp_path: Path) -> None:
    """Two gloo ranks: rank 0 draws the id and broadcasts it; both ranks' shards carry it (and their shard)."""
    sys_path = Path(__file__).resolve().parent.parent / "distributed"
    import sys

    sys.path.insert(0, str(sys_path))
    from test_ddp import torchrun  # the 2-rank harness of tests/distributed

    run = tmp_path / "run"
    torchrun(2, str(run), "topk", "6", str(tmp_path / "ref.pt"))
    run_id = read_manifest(run).run_id
    metas = []
    for f in [*list_snapshots(run).values(), *(f for _, _, f in list_segments(run))]:
        assert len(f.paths) == 2
        for i, p in enumerate(f.paths):
            meta = load(p).meta
            assert meta["shard"] == [i, 2]
            metas.append(meta)
    assert {meta["run_id"] for meta in metas} == {run_id}
    assert verify(run).ok
    # One shard stamped with another run's id is foreign: skipped, the rest still recovers.
    newest = list_snapshots(run)[max(list_snapshots(run))].paths[1]
    from forge import rewrite

    rewrite(newest, lambda f: f.meta.__setitem__("run_id", "0" * 32))
    rec = lowdiff.recover(run, workers=1)
    assert any(newest.name in s and "belongs to run" in s for s in rec.report.skipped)
    assert not verify(run).ok
    json.dumps(rec.report.skipped)
