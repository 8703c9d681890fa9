"""Readers concurrent with retention (issue 20): a file listed and then deleted before it is opened is not damage,
and never a bare FileNotFoundError: recovery lists again and returns an exact state."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from lowdiff_harness import Scenario, Trainer, assert_state_equal, make_model, make_optimizer, train_run

import lowdiff
from lowdiff.recovery import api
from lowdiff.storage.format import list_snapshots

SCENARIO = Scenario(model="mlp_bn", optimizer="adamw", compressor="topk", ratio=0.25, every_steps=3, batch_steps=2,
                    scheduler=False)


def test_snapshot_deleted_between_listing_and_opening_is_listed_again(tmp_path: Path, monkeypatch) -> None:
    refs = train_run(SCENARIO, tmp_path / "run", 8).refs
    real = api.candidates_for
    calls = []

    def listing_then_retention(root, target, exclude):  # type: ignore[no-untyped-def]
        out = real(root, target, exclude)
        if not calls:  # retention runs right after the first listing: the chosen snapshot is gone
            for p in out[1][0].snapshot.paths:
                p.unlink()
        calls.append(out)
        return out

    monkeypatch.setattr(api, "candidates_for", listing_then_retention)
    rec = lowdiff.recover(tmp_path / "run", workers=1)
    assert len(calls) == 2 and rec.report.skipped == []
    assert rec.step == 8 and rec.report.snapshot_step == 3
    assert_state_equal(*refs[8], rec)


def test_segment_deleted_while_the_chain_is_replayed(tmp_path: Path, monkeypatch) -> None:
    """The prefetch thread opens the next segment while the previous one is applied: it may be gone by then."""
    refs = train_run(SCENARIO, tmp_path / "run", 8).refs
    run = tmp_path / "run"
    seg = run / "log" / "steps-0000000007-0000000008.h5"
    kept = tmp_path / "kept.h5"
    shutil.copyfile(seg, kept)
    from lowdiff.recovery import replayer

    real = replayer._read_segment
    state = {"n": 0}

    def vanishing(manifest, s, names, with_buffers):  # type: ignore[no-untyped-def]
        state["n"] += 1
        if state["n"] == 1 and s.first == 7:
            seg.unlink()  # deleted after listing ...
            try:
                return real(manifest, s, names, with_buffers)
            finally:
                shutil.copyfile(kept, seg)  # ... and the next listing sees the run as it is now
        return real(manifest, s, names, with_buffers)

    monkeypatch.setattr(replayer, "_read_segment", vanishing)
    rec = lowdiff.recover(run, workers=1)
    assert rec.step == 8 and rec.report.skipped == []
    assert_state_equal(*refs[8], rec)


def test_files_that_keep_vanishing_are_a_clear_refusal(tmp_path: Path, monkeypatch) -> None:
    train_run(SCENARIO, tmp_path / "run", 4)
    from lowdiff.errors import FileVanishedError

    def always_gone(*a, **k):  # type: ignore[no-untyped-def]
        raise FileVanishedError("gone", path=tmp_path / "x")

    monkeypatch.setattr(api, "_replay_chain", always_gone)
    with pytest.raises(lowdiff.StepNotAvailableError, match="keep disappearing"):
        lowdiff.recover(tmp_path / "run", workers=1)


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
