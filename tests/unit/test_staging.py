"""lowdiff._transfer.host_copies on the CPU: owned copies of live tensors, pooled buffers handed back only when
released."""

from __future__ import annotations

from pathlib import Path

import torch
from lowdiff_harness import Scenario, assert_state_equal, start, train_run

import lowdiff
from lowdiff._transfer.host_copies import HostCopier, HostPool


def test_cpu_stage_copies_live_tensors_and_keeps_fresh_ones() -> None:
    live, fresh = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    out, ready, release = HostCopier([live]).stage([live, fresh], [True, False])
    assert ready is None and release is None
    assert out[1].data_ptr() == fresh.data_ptr()  # fresh: no copy
    assert torch.equal(out[0], live) and out[0].data_ptr() != live.data_ptr()
    live.zero_()
    assert out[0].sum() == 15  # the copy does not follow the live tensor


def test_pool_reuses_a_buffer_only_after_release() -> None:
    pool, stager = HostPool(), HostCopier([])
    a, b = torch.randn(3, 4), torch.randn(5)
    out1, _, release1 = stager.stage([a, b], [True, True], pool=pool)
    assert release1 is not None and out1[0].shape == (3, 4) and out1[1].shape == (5,)
    assert torch.equal(out1[0], a) and torch.equal(out1[1], b)
    out2, _, release2 = stager.stage([a * 2, b * 2], [True, True], pool=pool)
    assert pool.reused == 0 and out2[0].data_ptr() != out1[0].data_ptr()  # out1 still in use: a new buffer
    assert torch.equal(out1[0], a)  # untouched by the second copy
    release1()
    out3, _, _ = stager.stage([a * 3, b * 3], [True, True], pool=pool)
    assert pool.reused == 1 and out3[0].data_ptr() == out1[0].data_ptr()
    assert torch.equal(out3[0], a * 3) and torch.equal(out2[0], a * 2)


def test_pooled_records_recover_exactly(tmp_path: Path) -> None:
    # Compressor none on the CPU: every record's gradients sit in pooled buffers that are reused once written.
    s = Scenario(model="mlp_bn", optimizer="adamw", compressor="none", batch_steps=2, every_steps=5)
    t = start(s, tmp_path / "run")
    t.train(1, 6)
    t.opt.flush()  # steps 1-6 committed: their buffers are back in the pool for steps 7-11
    t.train(7, 11)
    assert t.opt.stats is not None and t.opt.stats.host_buffers_reused > 0
    t.opt.close()
    for k in range(12):
        assert_state_equal(*t.refs[k], lowdiff.recover(tmp_path / "run", step=k))


def test_pooled_snapshots_are_each_exact(tmp_path: Path) -> None:
    """Snapshot host copies are reused once the writer has persisted them: each snapshot file must still hold its
    own step's state (a buffer handed back too early would hold a later one)."""
    s = Scenario(model="mlp_bn", optimizer="adamw", compressor="topk", ratio=0.25, batch_steps=1, every_steps=2)
    t = train_run(s, tmp_path / "run", 10, close=False)
    t.opt.close()
    assert t.opt.stats is not None and t.opt.stats.snapshot_buffers_reused > 0
    snaps = sorted((tmp_path / "run" / "snapshots").glob("step-*.h5"))
    assert len(snaps) == 6  # steps 0, 2, ..., 10
    for k in (2, 4, 6, 8, 10):
        # Only step k's snapshot and nothing after it: the recovery reads that snapshot alone.
        rec = lowdiff.recover(tmp_path / "run", step=k)
        assert rec.report.snapshot_step == k and rec.report.steps_replayed == 0
        assert_state_equal(*t.refs[k], rec)
