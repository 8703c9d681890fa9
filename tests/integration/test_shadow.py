"""snapshot.shadow: snapshots written from the CPU replica are bit-identical to the live state."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff._storage.format import list_snapshots
from lowdiff._storage.manifest import read_manifest
from lowdiff._storage.snapshot import read_snapshot


def _train(run_dir: Path, steps: int, shadow: bool, *, every: int = 4, batch: int = 3,
           persistence: str = "thread") -> dict[int, tuple[dict, dict]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2),
                            torch.nn.Linear(16, 4))
    inner = torch.optim.AdamW([{"params": m[0].parameters(), "lr": 1e-2}, {"params": m[3].parameters()}], lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(inner, 2, 0.7)
    opt = lowdiff.wrap(inner, m, {"run_dir": str(run_dir), "snapshot": {"every_steps": every, "shadow": shadow},
                                  "log": {"batch_steps": batch, "persistence": persistence}})
    refs = {}
    for s in range(1, steps + 1):
        loss = m(torch.randn(32, 8)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
        sched.step()
        refs[s] = (copy.deepcopy(m.state_dict()), copy.deepcopy(inner.state_dict()))
    assert opt.stats is not None and opt.stats.shadow == shadow
    opt.close()
    return refs


def test_shadow_snapshots_equal_live_state(tmp_path: Path) -> None:
    refs = _train(tmp_path / "run", 13, shadow=True)
    manifest = read_manifest(tmp_path / "run")
    snaps = list_snapshots(tmp_path / "run")
    assert sorted(snaps) == [0, 4, 8, 12]
    names = manifest.optimized_params
    for step in (4, 8, 12):
        st = read_snapshot(snaps[step], manifest)
        assert st.extra.get("shadow") is True
        model_sd, optim_sd = refs[step]
        for k, v in model_sd.items():
            assert torch.equal(v, st.params.get(k, st.buffers.get(k))), (step, k)
        for i, s in optim_sd["state"].items():
            for k, v in s.items():
                assert torch.equal(v, st.optimizer_state[names[i]][k]), (step, names[i], k)
    rec = lowdiff.recover(tmp_path / "run")
    assert rec.step == 13 and rec.report.snapshot_step == 12
    for k, v in refs[13][0].items():
        assert torch.equal(v, rec.model[k])


@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_shadow_snapshots_keep_their_own_buffers(tmp_path: Path, persistence: str) -> None:
    """A record's changed buffers (BatchNorm's running stats) are views of a host slot that goes back to the pool,
    or the ring, once its segment is written and is then reused for a later step: the replica must keep copies,
    or a snapshot written after that reuse holds a later step's buffers. Segments end exactly at snapshot steps
    here, so every slot is released before the snapshot of its step is written."""
    refs = _train(tmp_path / "run", 13, shadow=True, every=3, batch=3, persistence=persistence)
    manifest = read_manifest(tmp_path / "run")
    snaps = list_snapshots(tmp_path / "run")
    assert {3, 6, 9, 12} <= set(snaps)
    for step in (3, 6, 9, 12):
        st = read_snapshot(snaps[step], manifest)
        for k, v in refs[step][0].items():
            assert torch.equal(v, st.params.get(k, st.buffers.get(k))), (step, k)


def test_shadow_requires_compressor_none(tmp_path: Path) -> None:
    with pytest.raises(lowdiff.ConfigError, match="snapshot.shadow"):
        lowdiff.Config.from_dict({"run_dir": str(tmp_path), "compressor": {"name": "topk"},
                                  "snapshot": {"shadow": True}})
