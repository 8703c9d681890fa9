"""Readers looking at a run's locks (``lowdiff.recover`` waiting for a dead trainer's persistence process) never make
a trainer starting at the same moment fail with RunLockedError."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lowdiff._storage.lock import WriterLock, live_trainer, take_persistence_lock, wait_for_persistence

ROOT = Path(__file__).resolve().parents[2]

LOOKER = """
import sys, time
from pathlib import Path
from lowdiff._storage.lock import live_trainer, wait_for_persistence
run, what = Path(sys.argv[1]), sys.argv[2]
(run / "looking").touch()
n = 0
while not (run / "stop").exists():
    for _ in range(200):
        if what == "writer":
            live_trainer(run)
        else:
            wait_for_persistence(run, 5.0, lambda: None, refuse_live_trainer=False)
        n += 1
print(n)
"""


def _looking(run: Path, what: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", LOOKER, str(run), what], text=True, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not (run / "looking").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the looking process did not start"
        time.sleep(0.01)
    return proc


def _stop(run: Path, proc: subprocess.Popen[str]) -> int:
    (run / "stop").touch()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return int(out)


def _take_writer_lock(run: Path) -> None:
    WriterLock(run).release()


def _take_persistence_lock(run: Path) -> None:
    os.close(take_persistence_lock(run, 0))


@pytest.mark.parametrize(("looking", "take"), [("writer", _take_writer_lock), ("persist", _take_persistence_lock)],
                         ids=["live-trainer-test-on-writer.lock", "flock-test-on-persist.lock"])
def test_a_reader_looking_at_the_locks_does_not_refuse_a_starting_trainer(tmp_path: Path, looking: str,
                                                                         take: Callable[[Path], None]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    take(run)  # the lock file exists, as after a trainer
    proc = _looking(run, looking)
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # a trainer taking the lock while the other process looks, again and again
            take(run)
    finally:
        looks = _stop(run, proc)
    assert looks >= 200  # it looked all along


def test_a_live_trainer_is_named_and_a_gone_one_is_not(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from lowdiff._storage.lock import WriterLock\n"
        "WriterLock(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"), str(run)],
        text=True, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert live_trainer(run) == f"pid {holder.pid} on {os.uname().nodename}"
        lock_fd = take_persistence_lock(run, 0)  # a persistence process of that live trainer
        try:
            t0 = time.monotonic()
            try:
                wait_for_persistence(run, 5.0, lambda: None)
            except Exception as e:  # refused at once: the trainer is alive
                assert "in use by another trainer" in str(e) and time.monotonic() - t0 < 2
            else:
                raise AssertionError("a live trainer's persistence process was not refused")
        finally:
            os.close(lock_fd)
    finally:
        holder.kill()
        holder.wait()
    assert live_trainer(run) is None
    WriterLock(run).release()
