"""Shared fixtures. The training scenarios and the bit-exact comparison live in ``lowdiff_harness`` so the
kill -9 child process can import them too."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lowdiff_harness, whatever pytest's import mode

from lowdiff_harness import SLOW, Scenario, Trainer, assert_state_equal, train_run  # noqa: E402

# CI: derandomized (the same examples every run), no example database on disk. LOWDIFF_SLOW=1: random
# examples, EXAMPLES_SCALE times as many in the expensive tests.
settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "slow", derandomize=False, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "slow" if SLOW else "ci"))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh, not yet existing run directory (lowdiff creates it)."""
    return tmp_path / "run"


@pytest.fixture
def train():
    """``train(scenario, run_dir, steps, close=True) -> Trainer`` with ``refs[k]`` = state after step k."""

    def _train(scenario: Scenario, run_dir: Path, steps: int, *, close: bool = True) -> Trainer:
        return train_run(scenario, run_dir, steps, close=close)

    return _train


@pytest.fixture(name="assert_state_equal")
def _assert_state_equal():
    """``assert_state_equal(ref_model_sd, ref_opt_sd, rec)``: bit-exact, torch.equal on every tensor."""
    return assert_state_equal
