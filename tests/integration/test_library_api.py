"""lowdiff.inspect, lowdiff.verify and lowdiff.compact: the library functions the CLI is a thin layer over."""

from __future__ import annotations

from pathlib import Path

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

    report = lowdiff.verify(run)
    assert report.ok and report.latest_step == 10 and report.files == 8

    res = lowdiff.compact(run, keep=1)
    assert res.step == 10 and res.wrote_snapshot and res.removed
    after = lowdiff.inspect(run)
    assert after.snapshot_steps == [10] and after.segments == [] and after.latest_step == 10
    assert lowdiff.verify(run).ok
    assert_state_equal(*refs[10], lowdiff.recover(run))


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
