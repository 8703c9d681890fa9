"""Readers concurrent with retention (issue 20): a file listed and then deleted before it is opened is not damage,
and never a bare FileNotFoundError: recovery lists again and returns an exact state."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from lowdiff_harness import Scenario, Trainer, assert_state_equal, make_model, make_optimizer, train_run

import lowdiff
from lowdiff._recovery import ReplayOptions
from lowdiff._storage.format import list_snapshots
from lowdiff.errors import FileVanishedError

SCENARIO = Scenario(model="mlp_bn", optimizer="adamw", compressor="topk", ratio=0.25, every_steps=3, batch_steps=2,
                    scheduler=False)


def test_snapshot_deleted_between_listing_and_opening_is_listed_again(tmp_path: Path) -> None:
    refs = train_run(SCENARIO, tmp_path / "run", 8).refs
    opened: list[Path] = []

    def retention_right_after_listing(path: Path) -> None:
        if not opened:  # retention runs between the first listing and the first open: the chosen snapshot goes
            path.unlink()
        opened.append(path)

    rec = lowdiff.recover(tmp_path / "run", workers=1, options=ReplayOptions(before_read=retention_right_after_listing))
    assert opened[0].name == "step-0000000006.h5" and rec.report.skipped == []
    assert rec.step == 8 and rec.report.snapshot_step == 3
    assert_state_equal(*refs[8], rec)


def test_segment_deleted_while_the_chain_is_replayed(tmp_path: Path) -> None:
    """The prefetch thread opens the next segment while the previous one is applied: it may be gone by then (and
    back in a new listing, as when compaction rewrites the log)."""
    refs = train_run(SCENARIO, tmp_path / "run", 8).refs
    run = tmp_path / "run"
    gone: list[Path] = []

    def vanishes_once(path: Path) -> None:
        if path.name == "steps-0000000007-0000000008.h5" and not gone:
            gone.append(path)
            raise FileVanishedError(f"{path} was deleted after it was listed", path=path)

    rec = lowdiff.recover(run, workers=1, options=ReplayOptions(before_read=vanishes_once))
    assert gone and rec.step == 8 and rec.report.skipped == []
    assert_state_equal(*refs[8], rec)


def test_files_that_keep_vanishing_are_a_clear_refusal(tmp_path: Path) -> None:
    train_run(SCENARIO, tmp_path / "run", 4)

    def always_gone(path: Path) -> None:
        raise FileVanishedError("gone", path=path)

    with pytest.raises(lowdiff.StepNotAvailableError, match="keep disappearing"):
        lowdiff.recover(tmp_path / "run", workers=1, options=ReplayOptions(before_read=always_gone))


def test_recover_alongside_a_trainer_applying_retention(tmp_path: Path) -> None:
    """A reader thread recovers the latest step over and over while the trainer deletes old snapshots and log
    (snapshot.keep = 2): every recovery returns the exact state of the step it reports, none fails."""
    run = tmp_path / "run"
    cfg = SCENARIO.config(run)
    cfg["snapshot"]["keep"] = 2
    cfg["snapshot"]["every_steps"] = 2
    cfg["log"]["batch_steps"] = 1
    model = make_model(SCENARIO.model, 0)
    inner = make_optimizer(SCENARIO.optimizer, model, SCENARIO.model, 1)
    t = Trainer(SCENARIO, model, inner, lowdiff.wrap(inner, model, cfg), None)
    t.opt.resume()
    t.record(0)
    results: list[lowdiff.Recovered] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                results.append(lowdiff.recover(run, workers=1))
            except BaseException as e:  # noqa: BLE001 - every failure is the finding
                errors.append(e)

    th = threading.Thread(target=reader, name="reader")
    th.start()
    try:
        for k in range(1, 41):
            t.step(k)
            t.opt.flush()
    finally:
        done.set()
        th.join(timeout=120)
        t.opt.close()
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors[:3]]
    assert len(results) >= 5
    for rec in results:
        assert_state_equal(*t.refs[rec.step], rec)
    assert len(list_snapshots(run)) == 2
