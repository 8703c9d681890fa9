"""Replay worker processes (lowdiff/_recovery/procs.py): forked only when that is safe, their failures reach the
caller, and any number of them gives the one-process result bit for bit."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import threading

import pytest
import torch
from lowdiff_harness import Scenario, assert_state_equal, train_run

import lowdiff
from lowdiff._recovery import ReplayOptions, procs

SCENARIO = Scenario(model="branch", optimizer="adamw", groups=2, clip=True, compressor="topk", ratio=0.25,
                    batch_steps=3, every_steps=4)


@pytest.fixture(autouse=True)
def _forkable() -> None:
    if torch.cuda.is_initialized():  # GPU tests ran earlier in this process: recovery replays in one process
        pytest.skip("CUDA is initialized in this process, so replay workers are not forked (see test_gpu.py)")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("workers") / "run"
    return root, train_run(SCENARIO, root, 9).refs


def test_another_thread_in_the_process_means_one_process(run) -> None:
    """Forking while another thread may hold a lock (h5py's, the allocator's) could deadlock the child."""
    root, refs = run
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="user-thread")
    other.start()
    try:
        rec = lowdiff.recover(root, step=7, workers=2)
    finally:
        stop.set()
        other.join()
    assert rec.report.workers == 1
    assert rec.report.mode.startswith("sequential") and "user-thread" in rec.report.mode
    assert_state_equal(*refs[7], rec)
    assert lowdiff.recover(root, step=7, workers=2).report.mode == "parallel"


def test_a_worker_process_that_dies_is_an_error_not_a_wrong_state(run) -> None:
    def killed(index: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RuntimeError, match=r"replay worker process 1 .* died \(killed by signal 9\)"):
        lowdiff.recover(run[0], workers=2, options=ReplayOptions(on_worker_start=killed))


def test_a_worker_process_error_is_raised_in_the_caller(run) -> None:
    def fails(index: int) -> None:
        raise lowdiff.UnsupportedError("no such thing in this share")

    with pytest.raises(lowdiff.UnsupportedError, match="no such thing"):
        lowdiff.recover(run[0], workers=2, options=ReplayOptions(on_worker_start=fails))


@pytest.mark.parametrize("workers", [2, 5, 64])
def test_more_workers_than_tensors_is_exact(run, workers: int) -> None:
    """Shares are contiguous runs of chunks; with more workers than chunks some would be empty: not started."""
    root, refs = run
    for target in (2, 9):  # from the step-0 snapshot (no optimizer state yet) and from the step-8 one
        rec = lowdiff.recover(root, step=target, workers=workers)
        assert 2 <= rec.report.workers <= workers
        assert rec.report.mode == "parallel"
        assert_state_equal(*refs[target], rec)


def test_recovered_tensors_stay_valid_after_the_workers_exit(run) -> None:
    """Parameters and optimizer state live in the shared mapping the workers wrote; the result keeps it alive."""
    root, refs = run
    rec = lowdiff.recover(root, workers=2)
    one = lowdiff.recover(root, workers=1)
    gc.collect()
    for k, v in one.model.items():
        assert torch.equal(rec.model[k], v), k
        rec.model[k].add_(0)  # writable
    assert_state_equal(*refs[9], rec)


def test_default_is_one_worker_for_a_few_steps(run) -> None:
    """Step 9 replays one step after the snapshot of step 8: forking workers would cost more than it saves."""
    root, refs = run
    rec = lowdiff.recover(root)
    assert rec.report.workers == 1
    if procs.default_workers() > 1:
        assert rec.report.mode.startswith(f"sequential (1 step(s) to replay: below {procs.PARALLEL_MIN_STEPS}")
    assert lowdiff.recover(root, workers=2).report.workers == 2  # asked for: as asked
    assert_state_equal(*refs[9], rec)


def test_default_is_one_worker_per_cpu(tmp_path) -> None:
    """A replay of PARALLEL_MIN_STEPS steps or more after its snapshot: one worker per CPU."""
    steps = procs.PARALLEL_MIN_STEPS + 1
    long = dataclasses.replace(SCENARIO, every_steps=1000)
    refs = train_run(long, tmp_path / "run", steps).refs
    rec = lowdiff.recover(tmp_path / "run")
    expected = procs.default_workers()
    assert 1 <= expected <= procs.MAX_DEFAULT_WORKERS
    assert rec.report.steps_replayed == steps
    assert rec.report.workers == expected or (expected > 1 and 2 <= rec.report.workers < expected)
    assert rec.report.mode == ("parallel" if rec.report.workers > 1 else "sequential")
    assert_state_equal(*refs[steps], rec)


def test_state_created_mid_replay_in_a_tensor_split_over_workers(run) -> None:
    """head_b gets its first gradient at step 2, after the fork: its optimizer state is born in per-chunk pieces in
    several processes (4-element chunks split it over all three) and must be joined exactly at the end."""
    root, refs = run
    for target in (1, 2, 9):
        rec = lowdiff.recover(root, step=target, workers=3, options=ReplayOptions(chunk_elems=4))
        assert rec.report.workers == 3 or target == 1
        assert_state_equal(*refs[target], rec)


def test_a_programs_frozen_heap_stays_frozen_through_a_parallel_replay(run) -> None:
    """The workers leave what they inherited out of their collections (freezing in each child); the program's own
    ``gc.freeze()`` is not undone in the parent, nor its heap frozen for it."""
    root, refs = run
    frozen = gc.get_freeze_count()  # the program's freeze: tests/conftest.py froze what the collection made
    assert frozen > 0
    garbage = [[]]
    garbage[0].append(garbage)  # a cycle made after the freeze: the parent still collects it
    rec = lowdiff.recover(root, step=7, workers=2)
    assert rec.report.mode == "parallel"
    assert gc.get_freeze_count() > 0.9 * frozen  # less only by frozen objects freed since (reference counts)
    del garbage
    assert gc.collect() > 0
    assert_state_equal(*refs[7], rec)
