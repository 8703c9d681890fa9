"""``log.when_behind: replica`` (LowDiff+ with a disk slower than the log): training does not wait for the disk;
the persistence process applies every step to its shadow replica, logs what the disk takes, and covers the rest
with snapshots of the replica. Every step recoverable after the run is exact; a trainer killed at any moment loses
no step whose ``opt.step()`` returned; steps in a gap of the log are refused, never approximated.

The slow disk is lowdiff.testing.intercept_persistence_process's commit delay."""

from __future__ import annotations

import dataclasses
import faulthandler
import signal
from pathlib import Path

import pytest
import torch
from lowdiff_harness import Scenario, assert_state_equal, start, train_run
from test_persist_process import _run_and_signal

import lowdiff
import lowdiff.testing
from lowdiff.errors import ConfigError, StepNotAvailableError

STEPS = 40
PACED = Scenario(model="mlp_bn", optimizer="adamw", groups=2, scheduler=False, clip=True, compressor="none",
                 batch_steps=2, queue_depth=1, every_steps=10, seed=5, persistence="process", shadow=True,
                 when_behind="replica")
DELAY_S = 0.15


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    plain = dataclasses.replace(PACED, persistence="thread", shadow=False, when_behind="wait")
    return train_run(plain, tmp_path_factory.mktemp("ref") / "run", STEPS)


def _slow_run(run_dir: Path, scenario: Scenario, steps: int, delay_s: float = DELAY_S):
    with lowdiff.testing.intercept_persistence_process(commit_delay_s=delay_s):
        t = start(scenario, run_dir)
    t.opt.flush()  # the persistence process has started: what follows is the slow disk alone
    t.train(1, steps)
    t.opt.close()
    return t, t.opt.stats  # after close: the persistence process's last counters have arrived


def test_training_does_not_wait_for_a_slow_disk_and_every_kept_step_is_exact(tmp_path: Path, reference) -> None:
    run = tmp_path / "run"
    t, st = _slow_run(run, PACED, STEPS)
    assert st is not None and st.write_error is None
    # With when_behind: wait the same run waits ~DELAY_S per segment of 2 steps (test below); here it does not.
    assert st.blocked_s < 0.5 and st.steps_skipped > 0, st
    rec = lowdiff.recover(run, workers=1)
    assert rec.step == STEPS
    assert_state_equal(*reference.refs[STEPS], rec)
    kept, refused = [], []
    for k in range(1, STEPS + 1):
        try:
            rec = lowdiff.recover(run, step=k, workers=1)
        except StepNotAvailableError:
            refused.append(k)
            continue
        assert rec.step == k
        assert_state_equal(*reference.refs[k], rec)
        kept.append(k)
    assert refused and len(kept) > 2, (kept, refused)


def test_the_same_run_with_when_behind_wait_waits_for_the_disk(tmp_path: Path, reference) -> None:
    # 6 segments at 0.5 s each: 3 s of disk, far more than 12 steps take even on a loaded machine
    t, st = _slow_run(tmp_path / "run", dataclasses.replace(PACED, when_behind="wait"), 12, delay_s=0.5)
    assert st is not None and st.blocked_s > 0.3 and st.steps_skipped == 0, st
    for k in range(1, 13):
        assert_state_equal(*reference.refs[k], lowdiff.recover(tmp_path / "run", step=k, workers=1))


@pytest.mark.parametrize("sig,kill_after", [(signal.SIGKILL, 7), (signal.SIGKILL, 23), (signal.SIGTERM, 16)])
def test_killed_trainer_loses_no_returned_step(tmp_path: Path, reference, sig: int, kill_after: int) -> None:
    """The steps the disk had not taken live only in the replica when the trainer dies: its persistence process
    writes a last snapshot of the replica before it exits."""
    run = tmp_path / "run"
    with lowdiff.testing.intercept_persistence_process(commit_delay_s=DELAY_S):
        returned = _run_and_signal(run, kill_after, sig, scenario=PACED)
    rec = lowdiff.recover(run, workers=1)
    note = f"signal {sig} after step {returned} returned; recovered {rec.step}"
    assert returned <= rec.step <= returned + 1, note
    assert_state_equal(*reference.refs[rec.step], rec)


@pytest.mark.parametrize("bad", [{"persistence": "thread", "shadow": True},
                                 {"persistence": "process", "shadow": False}])
def test_when_behind_replica_needs_a_persistence_process_and_a_shadow(tmp_path: Path, bad: dict) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="when_behind"):
        lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, {
            "run_dir": str(tmp_path / "run"), "compressor": {"name": "none"},
            "snapshot": {"shadow": bad["shadow"]},
            "log": {"persistence": bad["persistence"], "when_behind": "replica"}})


def test_records_the_slow_writer_holds_do_not_pin_the_ring(tmp_path: Path) -> None:
    """1 MB records in a ring of 6 slots (batch_steps 2, queue_depth 1): the ring is first in, first out, so a
    record the slow writer still holds would block every later slot, dropped ones included, and training would wait
    for the disk again (or for good, with the writer waiting for its batch to fill). The persistence process copies
    the records it logs out of the ring."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512, bias=False)
    with lowdiff.testing.intercept_persistence_process(commit_delay_s=DELAY_S):
        opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model, {
            "run_dir": str(tmp_path / "run"), "compressor": {"name": "none"},
            "snapshot": {"every_steps": 1000, "shadow": True},
            "log": {"batch_steps": 2, "queue_depth": 1, "persistence": "process", "when_behind": "replica"}})
    opt.flush()
    faulthandler.dump_traceback_later(240, exit=True)  # a deadlock fails the run instead of hanging it
    try:
        for k in range(1, 61):
            model(torch.full((4, 512), float(k % 7))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        st = opt.stats  # after close: the persistence process's last counters have arrived (a reading before may not
        # have them yet: steps_skipped still 0 when training ran ahead of the counters' messages)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert st is not None and st.blocked_s < 0.5 and st.steps_skipped > 0, st
    assert lowdiff.recover(tmp_path / "run", workers=1).step == 60
