"""Files put back into a run directory by hand or by a backup tool: a segment moved to ``quarantine/`` by a resume
and restored next to the segments that replaced it holds the same steps as they do. Recovery must never apply a
step twice or pick one of two files silently: it stops before the first step two segments hold, and ``lowdiff
verify`` names them (docs/reference/FORMAT.md §8)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lowdiff_harness import Scenario, assert_state_equal, start, train_run

import lowdiff
from lowdiff.recovery.verify import verify

SCENARIO = Scenario(compressor="topk", ratio=0.25, every_steps=5, batch_steps=3)


def _resume_at_snapshot_and_train(run: Path, last: int):
    t = start(SCENARIO, run, resume=False)
    k = t.opt.resume(at="snapshot")
    t.record(k)
    t.train(k + 1, last)
    t.opt.close()
    return k


def test_an_ordinary_resume_at_a_snapshot_verifies(tmp_path: Path) -> None:
    """Resuming at snapshot 10 moves the segment of steps 10-12 aside; the log then has no step 10 (a gap after
    step 9), which snapshot 10 covers: nothing is skipped or refused, so verify reports no problem."""
    run = tmp_path / "run"
    ref = train_run(SCENARIO, run, 12)
    assert _resume_at_snapshot_and_train(run, 13) == 10
    report = verify(run)
    assert report.ok, report.problems
    assert report.latest_step == 13
    assert_state_equal(*ref.refs[12], lowdiff.recover(run, step=12))


def test_a_quarantined_segment_put_back_is_not_replayed_twice(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ref = train_run(SCENARIO, run, 12)
    _resume_at_snapshot_and_train(run, 13)
    (moved,) = [p for p in (run / "quarantine").rglob("*.h5") if "steps-" in p.name]
    shutil.copy2(moved, run / "log" / moved.name.removeprefix("log-"))  # steps 10-12, beside those of 11-13
    rec = lowdiff.recover(run)
    assert rec.step == 10  # the snapshot: steps 11 and 12 are held by two files
    assert_state_equal(*ref.refs[10], rec)
    assert any("held by two segments" in s for s in rec.report.skipped)
    with pytest.raises(lowdiff.StepNotAvailableError, match="held by two segments"):
        lowdiff.recover(run, step=12)
    report = verify(run)
    assert not report.ok
    assert any("steps-0000000010-0000000012" in p and "steps-0000000011-0000000013" in p for p in report.problems), \
        report.problems
