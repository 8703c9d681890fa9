"""Files put back into a run directory by hand or by a backup tool: a segment or snapshot moved to ``quarantine/``
by a resume, restored next to the files of the history that replaced it. Recovery must never apply a step of a
discarded history nor pick one of two files silently: every file names the branch of the run's history it was
written in, and one of a branch a resume went back from is refused for the steps it holds past that point, even
where no file of the current history holds them (docs/reference/FORMAT.md §8); two segments of the current history
holding one step (a restored backup of the run written before branches existed) end the chain before it."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lowdiff_harness import Scenario, Trainer, assert_state_equal, start, train_run

import lowdiff
from lowdiff._recovery.verify import verify
from lowdiff._storage.manifest import read_manifest

SCENARIO = Scenario(compressor="topk", ratio=0.25, every_steps=5, batch_steps=3)


def _resume_at_snapshot_and_train(run: Path, last: int, lr_scale: float = 1.0) -> tuple[int, Trainer]:
    """Resume at the newest snapshot and train to ``last``; with ``lr_scale``, with another learning rate from there
    on (a rollback after a loss spike): the new history then differs from the one it replaced."""
    t = start(SCENARIO, run, resume=False)
    k = t.opt.resume(at="snapshot")
    for g in t.inner.param_groups:
        g["lr"] *= lr_scale
    t.record(k)
    t.train(k + 1, last)
    t.opt.close()
    return k, t


def test_an_ordinary_resume_at_a_snapshot_verifies(tmp_path: Path) -> None:
    """Resuming at snapshot 10 moves the segment of steps 10-12 aside; the log then has no step 10 (a gap after
    step 9), which snapshot 10 covers: nothing is skipped or refused, so verify reports no problem."""
    run = tmp_path / "run"
    ref = train_run(SCENARIO, run, 12)
    assert _resume_at_snapshot_and_train(run, 13)[0] == 10
    report = verify(run)
    assert report.ok, report.problems
    assert report.latest_step == 13
    assert_state_equal(*ref.refs[12], lowdiff.recover(run, step=12))


def test_a_quarantined_segment_put_back_is_not_replayed_twice(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(SCENARIO, run, 12)
    _, t = _resume_at_snapshot_and_train(run, 13, lr_scale=0.5)
    (moved,) = [p for p in (run / "quarantine").rglob("*.h5") if "steps-" in p.name]
    shutil.copy2(moved, run / "log" / moved.name.removeprefix("log-"))  # steps 10-12, beside those of 11-13
    rec = lowdiff.recover(run)
    assert rec.step == 13  # around the file of the history left at step 10, along the one that replaced it
    assert_state_equal(*t.refs[13], rec)
    assert any("steps-0000000010-0000000012" in s and "discarded part" in s for s in rec.report.skipped), \
        rec.report.skipped
    assert_state_equal(*t.refs[12], lowdiff.recover(run, step=12))
    report = verify(run)
    assert not report.ok
    assert any("steps-0000000010-0000000012" in p and "left at step 10" in p for p in report.problems), \
        report.problems


def test_a_segment_of_a_discarded_history_that_no_step_collides_with_is_refused(tmp_path: Path) -> None:
    """The rollback trains fewer steps than the history it replaced: the old segment of steps 22-24 put back
    follows the new history's last segment (21-21) with no step in common. Replayed on the new state it would give
    a state neither history had, silently."""
    run = tmp_path / "run"
    train_run(SCENARIO, run, 24)  # segments ..., 19-21, 22-24; snapshots ..., 15, 20
    k, t = _resume_at_snapshot_and_train(run, 21, lr_scale=0.5)
    assert k == 20
    moved = run / "quarantine" / "log-steps-0000000022-0000000024.h5"
    shutil.copy2(moved, run / "log" / "steps-0000000022-0000000024.h5")
    rec = lowdiff.recover(run)
    assert rec.step == 21
    assert_state_equal(*t.refs[21], rec)
    assert any("steps-0000000022-0000000024" in s and "left at step 20" in s for s in rec.report.skipped), \
        rec.report.skipped
    with pytest.raises(lowdiff.CorruptFileError, match="discarded part"):
        lowdiff.recover(run, step=24)
    report = verify(run)
    assert any("steps-0000000022-0000000024" in p for p in report.problems), report.problems


def _restore_a_discarded_snapshot(run: Path) -> tuple[Trainer, Trainer, Path]:
    """Snapshot 25 was damaged, so the resume went back to snapshot 20 and moved it aside; the rollback then trains
    to step 23 only; the intact copy of snapshot 25 is then restored from a backup. The first run and the rollback."""
    ref = train_run(SCENARIO, run, 26)
    snap25 = next((run / "snapshots").glob("*0000000025*"))
    backup = run.parent / snap25.name
    shutil.copy2(snap25, backup)
    with open(snap25, "r+b") as f:  # damaged: its checksum fails
        f.seek(snap25.stat().st_size // 2)
        f.write(b"\xff" * 64)
    k, t = _resume_at_snapshot_and_train(run, 23, lr_scale=0.5)
    assert k == 20
    shutil.copy2(backup, snap25)
    return ref, t, snap25


def test_a_snapshot_of_a_discarded_history_restored_from_a_backup_is_refused(tmp_path: Path) -> None:
    """The restored snapshot 25 is newer than anything of the new history: recovery would start from it and return
    the old history's state."""
    run = tmp_path / "run"
    _, t, snap25 = _restore_a_discarded_snapshot(run)
    rec = lowdiff.recover(run)
    assert rec.step == 23
    assert_state_equal(*t.refs[23], rec)
    assert any(snap25.name in s and "left at step 20" in s for s in rec.report.skipped), rec.report.skipped


def test_a_resume_at_a_snapshot_steps_around_a_restored_snapshot_of_a_discarded_history(tmp_path: Path) -> None:
    """resume(at="snapshot") tries the newest snapshot first: the restored snapshot 25, which nothing of the current
    history reaches, must make it try an older one, not fail the resume (it raised CorruptFileError)."""
    run = tmp_path / "run"
    ref, _, snap25 = _restore_a_discarded_snapshot(run)
    again = start(SCENARIO, run, resume=False)
    try:
        assert again.opt.resume(at="snapshot") == 20
        again.record(20)
        model, optimizer = again.refs[20]
        assert_state_equal(*ref.ends[20], SimpleNamespace(model=model, optimizer=optimizer))
    finally:
        again.opt.close()
    assert not snap25.exists()  # moved aside again, beyond the resumed step


def test_rollbacks_over_the_same_steps_keep_every_file_they_move_aside(tmp_path: Path) -> None:
    """Three rollbacks to snapshot 10, each training 11-13: the second and third move a segment of the same name
    to quarantine/; neither may replace the copy moved there before (lowdiff never deletes what it moves aside)."""
    run = tmp_path / "run"
    train_run(SCENARIO, run, 13)
    for lr_scale in (0.5, 0.25, 0.125):
        assert _resume_at_snapshot_and_train(run, 13, lr_scale)[0] == 10
    moved = sorted(p.name for p in (run / "quarantine").iterdir())
    # each clean close at step 13 also left a stop file (format 2.5), moved aside by the next rollback the same way
    assert moved == ["log-steps-0000000010-0000000012.h5", "log-steps-0000000011-0000000013.1.h5",
                     "log-steps-0000000011-0000000013.h5", "log-steps-0000000013-0000000013.h5",
                     "stops-step-0000000013.1.h5", "stops-step-0000000013.2.h5", "stops-step-0000000013.h5"], moved


@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_a_resume_at_the_latest_step_keeps_every_file_readable(tmp_path: Path, persistence: str) -> None:
    """Crash-and-resume cycles without going back: each resume starts a branch at the log's end, and every file of
    every branch stays in the one history recovery follows, back to step 0. The persistence process stamps its
    files with the branch too (it is started after the resume, from the trainer's run directory)."""
    run = tmp_path / "run"
    scenario = replace(SCENARIO, persistence=persistence)
    ref = train_run(scenario, run, 7)
    for last in (11, 16):
        t = start(scenario, run)
        k = t.opt.step_count
        t.train(k + 1, last)
        t.opt.close()
        ref.refs.update((s, v) for s, v in t.refs.items() if s > k)  # refs[k]: the end of iteration k
    for step in (3, 7, 11, 14, 16):
        assert_state_equal(*ref.refs[step], lowdiff.recover(run, step=step))
    assert verify(run).ok
    assert len(read_manifest(run).history) == 2


def test_compaction_after_a_rollback_writes_its_snapshot_into_the_current_history(tmp_path: Path) -> None:
    """``lowdiff compact`` stamps the snapshot it writes with the branch whose span holds its step: with every
    older file deleted (keep 1), recovery has that snapshot alone."""
    from lowdiff._recovery.compact import compact

    run = tmp_path / "run"
    train_run(SCENARIO, run, 12)
    _, t = _resume_at_snapshot_and_train(run, 13, lr_scale=0.5)
    assert compact(run, step=13, keep=1).wrote_snapshot
    assert_state_equal(*t.refs[13], lowdiff.recover(run))
    assert verify(run).ok


def test_compact_keep_refuses_while_recovery_steps_around_a_file(tmp_path: Path) -> None:
    """Retention counts snapshots by name: with the discarded history's snapshot 25 put back, `compact --keep 1`
    kept it as the newest and deleted every file of the current history."""
    from lowdiff._recovery.compact import compact

    run = tmp_path / "run"
    train_run(SCENARIO, run, 26)
    snap25 = next((run / "snapshots").glob("*0000000025*"))
    backup = tmp_path / snap25.name
    shutil.copy2(snap25, backup)
    snap25.write_bytes(snap25.read_bytes()[:100])  # damaged: the resume goes back to 20
    _, t = _resume_at_snapshot_and_train(run, 23, lr_scale=0.5)
    shutil.copy2(backup, snap25)
    before = sorted(p.name for p in run.rglob("*.h5"))
    with pytest.raises(lowdiff.LowDiffError, match="newer than step 23, which recovery could not use"):
        compact(run, keep=1)
    assert sorted(p.name for p in run.rglob("*.h5")) == before
    assert_state_equal(*t.refs[23], lowdiff.recover(run))


def test_the_snapshot_0_of_a_run_resumed_at_step_0_restored_from_a_backup_is_refused(tmp_path: Path) -> None:
    """Nothing was trained; the next process loads other weights after wrap() and resume() returns 0: snapshot 0 is
    written again at its first step, under its branch. The first snapshot 0, restored from a backup, must not be
    taken as the base the new branch's log replays on."""
    run = tmp_path / "run"
    start(SCENARIO, run).opt.close()  # the run is created, nothing trained
    snap0 = next((run / "snapshots").glob("*0000000000*"))
    backup = tmp_path / snap0.name
    shutil.copy2(snap0, backup)
    t = start(SCENARIO, run, resume=False)
    with torch.no_grad():  # "pretrained" weights
        for p in t.model.parameters():
            p.add_(1.0)
    assert t.opt.resume() == 0
    t.train(1, 7)
    t.opt.close()
    assert [s for _, s in read_manifest(run).history] == [-1]
    shutil.copy2(backup, snap0)
    with pytest.raises(lowdiff.CorruptFileError, match="first history"):
        lowdiff.recover(run, step=3)
    assert not verify(run).ok


def test_two_segments_of_one_branch_holding_a_step_end_the_chain_before_it(tmp_path: Path) -> None:
    """Files of one branch never share a step, unless written before format 2.4 (no branch at all) or forged: here
    the segment of steps 3-4 of a twin run (same seed, other batch size, its run id rewritten) beside this run's 1-3
    and 4-6, all of the first history. Recovery must not replay a step twice nor choose: it stops before step 3 and
    names the pair; verify reports it."""
    from forge import rewrite

    scenario = replace(SCENARIO, every_steps=100)
    run, twin = tmp_path / "run", tmp_path / "twin"
    ref = train_run(scenario, run, 6)  # segments 1-3, 4-6
    train_run(replace(scenario, batch_steps=2), twin, 6)  # 1-2, 3-4, 5-6
    run_id = read_manifest(run).run_id
    name = "steps-0000000003-0000000004.h5"
    shutil.copy2(twin / "log" / name, run / "log" / name)
    rewrite(run / "log" / name, lambda f: f.meta.__setitem__("run_id", run_id))
    rec = lowdiff.recover(run)
    assert rec.step == 2
    assert_state_equal(*ref.refs[2], rec)
    assert any("held by two segments" in s for s in rec.report.skipped), rec.report.skipped
    assert any("held by two segments" in p for p in verify(run).problems)
