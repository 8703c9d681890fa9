"""Shared fixtures. The training scenarios and the bit-exact comparison live in ``lowdiff_harness`` so the
kill -9 child process can import them too."""

from __future__ import annotations

import os
import signal
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

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # Started in the background by a shell without job control (`cmd &` in a script, nohup), which ignores SIGINT
    # for it and, through exec, for every process it starts: the tests that send a trainer SIGINT (a Ctrl-C) need
    # what a terminal gives a program. A handler (not an ignored signal) reverts to the default in exec'd children.
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _persistence_children() -> list[int]:
    """This process's own persistence processes still running (``python -m lowdiff._persist.child``)."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == me and b"lowdiff._persist.child" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports and the collection made lives as long as the session: out of the collector's sight
    (``gc.freeze``), the collection after each test costs 2 ms instead of 0.25 s (lightning and transformers
    imported), four minutes of CI."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cases marked ``slow`` (long runs whose ground a faster case covers too) run with LOWDIFF_SLOW=1 only, which
    keeps CI's ``python3 -m pytest -q`` under 45 minutes on two cores."""
    if SLOW:
        return
    skip = pytest.mark.skip(reason="a long case: runs with LOWDIFF_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _leaves_nothing_behind(request: pytest.FixtureRequest):
    """After every test: no new file in /dev/shm (lowdiff shares memory through memfd and anonymous mappings), and no
    persistence process of this process still running once the test's optimizers are gone (a process collects
    unclosed ones; module-scoped fixtures may keep theirs open)."""
    import gc
    import time

    before = _shm()
    running = set(_persistence_children())
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while (left := set(_persistence_children()) - running) and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert not left, f"{request.node.nodeid} left persistence process(es) {sorted(left)} running"
    leaked = _shm() - before
    assert not leaked, f"{request.node.nodeid} left files in /dev/shm: {sorted(leaked)[:10]}"
