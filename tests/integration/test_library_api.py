"""lowdiff.inspect, lowdiff.verify and lowdiff.compact: the library functions the CLI is a thin layer over."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lowdiff_harness import Scenario, assert_state_equal, train_run

import lowdiff

SCENARIO = Scenario(model="mlp_bn", optimizer="adamw", compressor="topk", ratio=0.25, every_steps=4, batch_steps=2)


def test_inspect_verify_compact(tmp_path: Path) -> None:
    run = tmp_path / "run"
    refs = train_run(SCENARIO, run, 10).refs
    info = lowdiff.inspect(run)
    assert info.snapshot_steps == [0, 4, 8] and info.segments == [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
    assert info.latest_step == 10 and info.manifest.optimizer_class.endswith("AdamW")
    assert "latest recoverable step: 10" in info.summary()
    assert info.stop_steps == [10] and "clean stop at step 10" in info.summary()  # close() after step 10

    report = lowdiff.verify(run)
    assert report.ok and report.latest_step == 10 and report.files == 9  # 3 snapshots, 5 segments, 1 stop

    res = lowdiff.compact(run, keep=1)
    assert res.step == 10 and res.wrote_snapshot and res.removed
    after = lowdiff.inspect(run)
    assert after.snapshot_steps == [10] and after.segments == [] and after.latest_step == 10
    assert lowdiff.verify(run).ok
    assert_state_equal(*refs[10], lowdiff.recover(run))


@pytest.mark.parametrize("persistence", ["process", "thread"])
def test_compact_beside_this_processs_open_wrapper_is_refused_at_once(tmp_path: Path, persistence: str) -> None:
    """The script compacts its own run while its wrapper is still open: refused, naming this process, instead of
    waiting out the persistence-lock timeout for a persistence process that is its own."""
    from dataclasses import replace

    t = train_run(replace(SCENARIO, persistence=persistence), tmp_path / "run", 3, close=False)
    try:
        with pytest.raises(lowdiff.RunLockedError, match="already open for writing in this process"):
            lowdiff.compact(tmp_path / "run")
    finally:
        t.opt.close()
    assert lowdiff.compact(tmp_path / "run").step == 3


def test_compact_replaces_a_damaged_snapshot_at_its_step_before_pruning(tmp_path: Path) -> None:
    """The newest snapshot, at the latest step, is damaged: recovery reaches that step from an older snapshot and
    the log. ``compact(keep=1)`` must write the step's snapshot again before pruning: it counted the damaged file as
    the snapshot to keep and deleted every file recovery had used, leaving the run unrecoverable."""
    run = tmp_path / "run"
    refs = train_run(SCENARIO, run, 8).refs  # snapshots 0, 4, 8: the newest at the latest step
    snap = run / "snapshots" / "step-0000000008.h5"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snap.write_bytes(bytes(data))
    res = lowdiff.compact(run, keep=1)
    assert res.step == 8 and res.wrote_snapshot
    assert lowdiff.inspect(run).snapshot_steps == [8]
    assert lowdiff.verify(run).ok
    assert_state_equal(*refs[8], lowdiff.recover(run))


def test_compact_of_an_older_step_refuses_a_keep_that_would_delete_it(tmp_path: Path) -> None:
    """``compact(step=5, keep=1)`` with snapshots after step 5: keeping the newest one would delete the snapshot
    just written for step 5 (and the log reaching it), so it is refused before anything is written or deleted."""
    run = tmp_path / "run"
    train_run(SCENARIO, run, 10)
    before = sorted(p.name for p in run.rglob("*.h5"))
    with pytest.raises(lowdiff.LowDiffError, match="newer"):
        lowdiff.compact(run, step=5, keep=1)
    assert sorted(p.name for p in run.rglob("*.h5")) == before
    res = lowdiff.compact(run, step=5, keep=3)  # 5, 8 and the newest kept: allowed
    assert 5 in lowdiff.inspect(run).snapshot_steps and res.wrote_snapshot


def test_verify_names_a_damaged_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(SCENARIO, run, 6)
    seg = run / "log" / "steps-0000000003-0000000004.h5"
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    report = lowdiff.verify(run)
    assert not report.ok and any(seg.name in p for p in report.problems)
    assert report.latest_step == 6  # the snapshot at 4 and the segment 5-6 still reach step 6


def test_verify_fails_a_run_without_snapshots(tmp_path: Path) -> None:
    """Every replay starts from a snapshot: with snapshots/ deleted, recover() refuses, and verify passed it."""
    run = tmp_path / "run"
    train_run(SCENARIO, run, 6)
    shutil.rmtree(run / "snapshots")
    report = lowdiff.verify(run)
    assert not report.ok and any("no committed snapshot" in p for p in report.problems), report.problems
