"""Which compressor memory a rank resumes with (lowdiff._training.resume.compressor_state), and what it says when the
log cannot give it back exactly."""

from __future__ import annotations

import logging

import pytest
import torch

from lowdiff._compressors import make_compressor
from lowdiff._recovery import Recovered, RecoveryReport
from lowdiff._training.resume import compressor_state

PARAMS = {"w": torch.zeros(4, 3)}
Q = {"w": {"q": torch.ones(3, 1)}}
RES = {"w": {"residual": torch.full((12,), 2.0)}}


def recovered(*, exact: bool, world_size: int, shared: dict, mine: dict) -> Recovered:
    return Recovered(step=10, model={}, optimizer={}, compressor_state=shared, compressor_state_exact=exact,
                     report=RecoveryReport(10, 10, 0, 0, 1, "sequential"), world_size=world_size,
                     rank_compressor_state=mine)


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_same_world_size_at_a_snapshot_step_gets_its_own_residuals(caplog: pytest.LogCaptureFixture) -> None:
    comp = make_compressor("powersgd", rank=1)
    with caplog.at_level(logging.INFO, logger="lowdiff"):
        state = compressor_state(recovered(exact=True, world_size=2, shared=Q, mine=RES), comp, 2, PARAMS)
    assert set(state["w"]) == {"q", "residual"} and torch.equal(state["w"]["residual"], RES["w"]["residual"])
    assert messages(caplog) == []


def test_another_world_size_restarts_residuals_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    comp = make_compressor("powersgd", rank=1)
    with caplog.at_level(logging.INFO, logger="lowdiff"):
        state = compressor_state(recovered(exact=True, world_size=2, shared=Q, mine={}), comp, 1, PARAMS)
    assert set(state["w"]) == {"q"}  # Q is the same on every rank: it continues
    (msg,) = messages(caplog)
    assert "resumed on 1 rank(s) the state at step 10, whose compressor memory 2 rank(s) wrote" in msg
    assert "restart at zero" in msg


def test_a_snapshot_written_before_per_rank_residuals(caplog: pytest.LogCaptureFixture) -> None:
    """Format 2.1 kept each parameter's residual from one rank only: not this rank's, so it restarts at zero."""
    comp = make_compressor("topk", ratio=0.1)
    with caplog.at_level(logging.INFO, logger="lowdiff"):
        state = compressor_state(recovered(exact=True, world_size=2, shared=RES, mine={}), comp, 2, PARAMS)
    assert state == {}
    assert any("written before lowdiff saved each rank's own residuals" in m for m in messages(caplog))


def test_between_snapshots_points_at_resume_at_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    comp = make_compressor("topk", ratio=0.1)
    with caplog.at_level(logging.INFO, logger="lowdiff"):
        assert compressor_state(recovered(exact=False, world_size=1, shared={}, mine={}), comp, 1, PARAMS) == {}
    assert any("resume(at='snapshot')" in m for m in messages(caplog))
