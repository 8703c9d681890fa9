"""A run directory written by an older lowdiff (tests/data/golden-2.0, format 2.0) stays readable: recovery of
every logged step after its newest snapshot equals the state the run that wrote it had, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import lowdiff

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden-2.0"


@pytest.mark.parametrize("step", [4, 5, 6])
def test_format_2_0_recovers_exactly(tmp_path: Path, step: int) -> None:
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "run", run)  # recovery must not need to write, but the fixture stays pristine
    expected = torch.load(GOLDEN / "expected.pt", weights_only=True)[step]
    rec = lowdiff.recover(run, step=step, workers=1)
    model_sd, optim_sd = expected
    assert rec.step == step
    assert set(rec.model) == set(model_sd)
    assert all(torch.equal(rec.model[k], v) for k, v in model_sd.items())
    assert set(rec.optimizer["state"]) == set(optim_sd["state"])
    for i, st in optim_sd["state"].items():
        for k, v in st.items():
            got = rec.optimizer["state"][i][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, (i, k)
    assert [g["lr"] for g in rec.optimizer["param_groups"]] == [g["lr"] for g in optim_sd["param_groups"]]
