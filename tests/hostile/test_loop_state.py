"""Format 2.2's additions read as untrusted input (FORMAT.md sections 4, 5, 7): per-rank compressor state only in its
own rank's shard, no gradient at a step marked skipped, end-of-iteration hyperparameters and tracked state checked
like every other value; and a log written before 2.2 (no end-of-iteration state) still resumes, saying what it
cannot restore."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from forge import load, rewrite
from lowdiff_harness import Scenario, start, train_run

import lowdiff
from lowdiff._recovery.compact import snapshot_from_recovered
from lowdiff._recovery.verify import verify
from lowdiff._storage.format import Shard, list_segments, list_snapshots
from lowdiff._storage.manifest import read_manifest
from lowdiff._storage.segment import SegmentReader
from lowdiff._storage.snapshot import SnapshotState, read_rank_state, read_snapshot, write_snapshot
from lowdiff.errors import CorruptFileError

SCENARIO = Scenario(compressor="topk", ratio=0.25, batch_steps=3, every_steps=100)


def sharded_snapshot(run: Path, step: int) -> list[Path]:
    """A 2-shard snapshot at ``step`` (as two ranks write it), each shard with its rank's own residuals."""
    manifest = read_manifest(run)
    rec = lowdiff.recover(run, step=step)
    whole = snapshot_from_recovered(manifest, rec)
    whole.extra["compressor_state_exact"] = True
    names = [p.name for p in manifest.params]
    for i in range(2):
        mine = set(names[i::2])
        state = SnapshotState(
            step=step, params={n: t for n, t in whole.params.items() if n in mine},
            buffers=whole.buffers if i == 0 else {},
            optimizer_state={n: st for n, st in whole.optimizer_state.items() if n in mine},
            param_groups=whole.param_groups, compressor_name="topk", extra=whole.extra,
            rank_compressor_state={n: {"residual": torch.full((manifest.param(n).numel,), float(i + 1))}
                                   for n in manifest.optimized_params})
        write_snapshot(run, state, "none", Shard(i, 2), run_id=manifest.run_id)
    return list(list_snapshots(run)[step].paths)


def test_each_rank_reads_its_own_residuals(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(SCENARIO, run, 6)
    sharded_snapshot(run, 6)
    m = read_manifest(run)
    snap = list_snapshots(run)[6]
    for rank in range(2):
        state = read_rank_state(snap, m, rank)
        assert set(state) == set(m.optimized_params)
        assert all(torch.equal(st["residual"], torch.full_like(st["residual"], rank + 1.0)) for st in state.values())
    rec = lowdiff.recover(run, step=6, rank=1)
    assert rec.world_size == 2 and rec.compressor_state_exact
    assert all(float(st["residual"][0]) == 2.0 for st in rec.rank_compressor_state.values())
    assert verify(run).ok


def test_residuals_of_another_rank_or_in_an_unsharded_snapshot_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(SCENARIO, run, 6)
    shard0, shard1 = sharded_snapshot(run, 6)
    other = load(shard1)
    name = other.names("rank/")[0]

    def steal(f: object) -> None:  # rank 1's entry moved into rank 0's shard
        f.entries.append(dict(other.entry(name)))  # type: ignore[attr-defined]
        f.raw[name] = other.raw[name]  # type: ignore[attr-defined]

    rewrite(shard0, steal)
    with pytest.raises(CorruptFileError, match="per-rank state of rank 1 in shard"):
        read_snapshot(list_snapshots(run)[6], read_manifest(run))
    report = verify(run)
    assert not report.ok and any("per-rank state" in p for p in report.problems)
    rec = lowdiff.recover(run)  # stepped around: the log from snapshot 0 still reaches step 6
    assert rec.step == 6 and rec.report.snapshot_step == 0 and rec.report.skipped

    run2 = tmp_path / "run2"
    train_run(SCENARIO, run2, 2)
    rewrite(list_snapshots(run2)[0].paths[0], steal)
    with pytest.raises(CorruptFileError, match="per-rank state"):
        read_snapshot(list_snapshots(run2)[0], read_manifest(run2))


def _segment(run: Path) -> Path:
    return list_segments(run)[0][2].paths[0]


@pytest.mark.parametrize("forge,match", [
    (lambda f: f.meta["steps"][1].__setitem__("skipped", True), "gradient at a step marked skipped"),
    (lambda f: f.meta["steps"][1].__setitem__("skipped", "yes"), "skipped"),
    (lambda f: f.meta["steps"][0]["end_groups"][0].__setitem__("lr", -1.0), "end of iteration.*lr"),
    (lambda f: f.meta["steps"][0].__setitem__("end_groups", [{}]), "end of iteration"),
    (lambda f: f.meta["steps"][0]["data"].__setitem__("lr_scheduler", {"__counter__": 5}), "malformed mapping"),
    (lambda f: f.meta["steps"][0]["data"].__setitem__("lr_scheduler", {"__items__": [[[1], 2]]}), "not hashable"),
], ids=["grad-at-skipped", "skipped-not-bool", "end-lr-negative", "end-groups-missing", "bad-counter",
        "unhashable-key"])
def test_forged_step_metadata_is_refused(tmp_path: Path, forge, match: str) -> None:
    run = tmp_path / "run"
    train_run(Scenario(batch_steps=3, every_steps=100), run, 6)
    seg = _segment(run)
    assert "end_groups" in load(seg).meta["steps"][0]
    rewrite(seg, lambda f: forge(f))
    with pytest.raises(CorruptFileError, match=match):
        SegmentReader(seg, read_manifest(run), 1, 3).close()
    assert not verify(run).ok


def test_log_without_end_of_iteration_state_resumes_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    """A log written before 2.2 took tracked state inside opt.step() and has no end-of-iteration hyperparameters:
    the resume uses what it has (the step's own lr) and says that the scheduler is one call behind."""
    run = tmp_path / "run"
    t = train_run(Scenario(batch_steps=3, every_steps=100), run, 6)
    for _, _, files in list_segments(run):
        for p in files.paths:
            rewrite(p, lambda f: [s.pop("end_groups") for s in f.meta["steps"]])
    rec = lowdiff.recover(run)
    assert rec.step == 6 and rec.end_groups is None
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        t2 = start(Scenario(batch_steps=3, every_steps=100), run)
    assert any("older lowdiff" in r.getMessage() and "'lr_scheduler'" in r.getMessage() for r in caplog.records)
    assert t2.inner.param_groups[0]["lr"] == t.refs[6][1]["param_groups"][0]["lr"]  # the step's own lr
    t2.opt.close()
