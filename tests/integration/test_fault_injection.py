"""Write failures injected at the storage seam (lowdiff.testing.intercept_writes): the error surfaces in the
training thread as CheckpointWriteError naming the file, nothing half-written is committed, and what is
committed still recovers exactly."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lowdiff_harness import (
    Scenario,
    Trainer,
    assert_state_equal,
    make_model,
    make_optimizer,
    make_scheduler,
    start,
    train_run,
)

import lowdiff
from lowdiff.testing import fd_path, intercept_writes, real_pwritev

SCENARIO = Scenario(model="mlp_bn", optimizer="adamw", compressor="topk", ratio=0.25, batch_steps=4,
                    every_steps=10, codec="lz4", scheduler=True)
REAL_PWRITE = real_pwritev


class _Disk:
    """What every committed byte goes through in these tests: ``pwritev`` is swapped per test phase."""

    def __init__(self) -> None:
        self.pwritev = REAL_PWRITE

    def __call__(self, fd: int, buffers, offset: int) -> int:  # type: ignore[no-untyped-def]
        return self.pwritev(fd, buffers, offset)


@pytest.fixture
def disk():  # type: ignore[no-untyped-def]
    d = _Disk()
    with intercept_writes(pwritev=d):
        yield d


def _failing(err: int, only: str | None = None):
    """A _pwrite that fails with ``err`` (for files whose path contains ``only``, or all files)."""

    def pwrite(fd: int, buffers, offset: int) -> int:
        if only is None or only in fd_path(fd):
            raise OSError(err, os.strerror(err))
        return REAL_PWRITE(fd, buffers, offset)

    return pwrite


def _assert_nothing_half_written(run_dir: Path) -> None:
    assert not [p for p in run_dir.rglob("*.tmp")], "a failed write left a *.tmp behind"


def _steps_until_error(t: Trainer, first: int, limit: int = 60) -> None:
    """Keep training until a step() raises: the writer fails in the background and reports it later."""
    for k in range(first, first + limit):
        t.step(k)
        time.sleep(0.01)
    raise AssertionError("step() never reported the failed background write")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run. Snapshot and batch sizes do not change the trajectory, only what is written."""
    return train_run(SCENARIO, tmp_path_factory.mktemp("ref") / "run", 20).refs


@pytest.mark.parametrize("surface", ["flush", "close", "step"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_failed_segment_write_is_reported_and_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: _Disk, reference, surface: str, err: int) -> None:
    run_dir = tmp_path / "run"
    t = start(SCENARIO, run_dir)
    t.train(1, 4)
    assert t.opt.flush() == 4
    disk.pwritev = _failing(err)
    t.train(5, 8)  # a full batch: the background writer tries steps-5-8 and fails
    segment = run_dir / "log" / "steps-0000000005-0000000008.h5"
    with pytest.raises(lowdiff.CheckpointWriteError) as e:
        if surface == "flush":
            t.opt.flush()
        elif surface == "close":
            t.opt.close()
        else:
            _steps_until_error(t, 9)
    assert e.value.errno == err
    assert str(segment) in str(e.value)
    assert isinstance(e.value, OSError)
    disk.pwritev = REAL_PWRITE
    t.opt.close()
    _assert_nothing_half_written(run_dir)
    assert not segment.exists()
    rec = lowdiff.recover(run_dir, workers=1)
    assert rec.step == 4
    for k in range(0, 5):
        assert_state_equal(*reference[k], lowdiff.recover(run_dir, step=k, workers=1))
    if surface == "close":
        # close() released the run directory even though it raised.
        again = start(SCENARIO, run_dir, resume=False)
        assert again.opt.resume() == 4
        again.opt.close()


def test_after_a_failure_the_log_resumes_at_the_next_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: _Disk, reference) -> None:
    """The steps whose segment failed leave a hole; the next snapshot restarts checkpointing, and every state
    that is recoverable is exact."""
    run_dir = tmp_path / "run"
    t = start(SCENARIO, run_dir)
    t.train(1, 4)
    t.opt.flush()
    disk.pwritev = _failing(errno.ENOSPC)
    t.train(5, 8)
    with pytest.raises(lowdiff.CheckpointWriteError):
        t.opt.flush()
    disk.pwritev = REAL_PWRITE
    t.train(9, 16)  # snapshot at 10 commits; 11-14 is a segment; 15-16 flushed by close
    t.opt.close()
    _assert_nothing_half_written(run_dir)
    assert lowdiff.recover(run_dir).step == 16
    for k in range(0, 17):
        try:
            rec = lowdiff.recover(run_dir, step=k, workers=1)
        except lowdiff.StepNotAvailableError:
            assert 5 <= k <= 9, f"step {k} should be recoverable"
            continue
        assert_state_equal(*reference[k], rec)


def test_failed_snapshot_write_is_reported(tmp_path: Path, disk: _Disk, reference) -> None:
    run_dir = tmp_path / "run"
    scenario = Scenario(**{**SCENARIO.to_dict(), "every_steps": 6})
    t = start(scenario, run_dir)
    disk.pwritev = _failing(errno.ENOSPC, only="/snapshots/")
    t.train(1, 6)
    snapshot = run_dir / "snapshots" / "step-0000000006.h5"
    with pytest.raises(lowdiff.CheckpointWriteError, match=str(snapshot)):
        t.opt.flush()
    disk.pwritev = REAL_PWRITE
    t.opt.close()
    _assert_nothing_half_written(run_dir)
    assert not snapshot.exists()
    rec = lowdiff.recover(run_dir, workers=1)
    assert 4 <= rec.step <= 6 and rec.report.snapshot_step == 0
    assert_state_equal(*reference[rec.step], rec)


def test_failed_step0_snapshot_at_wrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: _Disk) -> None:
    run_dir = tmp_path / "run"
    disk.pwritev = _failing(errno.ENOSPC)
    with pytest.raises(lowdiff.CheckpointWriteError) as e:
        start(SCENARIO, run_dir, resume=False)
    assert str(run_dir / "snapshots" / "step-0000000000.h5") in str(e.value)
    _assert_nothing_half_written(run_dir)
    assert not (run_dir / "manifest.json").exists()
    with pytest.raises(lowdiff.RunDirNotFoundError):
        lowdiff.recover(run_dir)


def test_failed_manifest_write_at_wrap_is_a_checkpoint_write_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: _Disk) -> None:
    run_dir = tmp_path / "run"
    disk.pwritev = _failing(errno.ENOSPC, only="manifest.json")
    with pytest.raises(lowdiff.CheckpointWriteError, match="manifest.json"):
        start(SCENARIO, run_dir, resume=False)


def test_step_that_raises_a_write_error_was_not_applied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: _Disk) -> None:
    t = start(Scenario(**{**SCENARIO.to_dict(), "scheduler": False}), tmp_path / "run")
    t.train(1, 4)
    t.opt.flush()
    release = threading.Event()

    def blocked_then_failing(fd: int, buffers, offset: int) -> int:
        release.wait(60)  # the writer thread holds here until the training thread is inside inner.step()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    disk.pwritev = blocked_then_failing
    t.train(5, 8)  # the batch 5-8 is handed to the writer, which now blocks in the write
    inner_step = t.inner.step

    def inner_step_while_the_writer_fails(*args, **kwargs):
        out = inner_step(*args, **kwargs)
        release.set()
        deadline = time.monotonic() + 30
        while t.opt.stats.write_error is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return out

    monkeypatch.setattr(t.inner, "step", inner_step_while_the_writer_fails)
    # Step 9 is applied while the writer fails: it must not raise (its effect is already done). The failure
    # is reported by the next step, before that step touches anything.
    t.step(9)
    assert t.opt.step_count == 9
    t.inner.step = inner_step  # type: ignore[method-assign]
    params_before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    with pytest.raises(lowdiff.CheckpointWriteError):
        t.step(10)
    applied = t.opt.step_count != 9 or any(
        not torch.equal(params_before[n], p) for n, p in t.model.named_parameters())
    disk.pwritev = REAL_PWRITE
    t.opt.close()
    assert not applied, "step() raised CheckpointWriteError after applying the step"


def test_on_write_error_warn_keeps_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: _Disk, reference,
                                            caplog: pytest.LogCaptureFixture) -> None:
    model = make_model(SCENARIO.model, SCENARIO.seed)
    inner = make_optimizer(SCENARIO.optimizer, model, SCENARIO.model, SCENARIO.groups)
    sched = make_scheduler(inner)
    cfg = SCENARIO.config(tmp_path / "run") | {"on_write_error": "warn"}
    t = Trainer(SCENARIO, model, inner, lowdiff.wrap(inner, model, cfg), sched)
    t.record(t.opt.resume())
    t.train(1, 4)
    t.opt.flush()
    disk.pwritev = _failing(errno.ENOSPC)
    t.train(5, 8)
    assert t.opt.flush() == 4  # no raise: a warning, and the durable step stays where it was
    disk.pwritev = REAL_PWRITE
    t.train(9, 12)
    t.opt.close()
    assert any("No space left" in r.getMessage() for r in caplog.records)
    for k in range(13):
        assert_state_equal(*reference[k], SimpleNamespace(model=t.refs[k][0], optimizer=t.refs[k][1]))
    rec = lowdiff.recover(tmp_path / "run", workers=1)
    assert rec.step == 12
    assert_state_equal(*reference[12], rec)


def _small_tmpfs(where: Path, size: str) -> Path:
    where.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    return where


@pytest.mark.parametrize(("persistence", "size"), [("thread", "200k"), ("thread", "300k"), ("process", "200k")])
def test_a_disk_that_fills_up_is_a_write_error_not_a_crash(tmp_path: Path, persistence: str, size: str) -> None:
    """A real full disk (a small tmpfs), the loop catching each write error and going on. libhdf5's file close
    failed half done on ENOSPC and the process then died of a segmentation fault at the next write (thread
    persistence at 200k: every run before the free-space check); now each failed write is a CheckpointWriteError
    and what was committed recovers. In a subprocess: a crash must fail this test, not end the test session."""
    small = _small_tmpfs(tmp_path / "small", size)
    script = textwrap.dedent(f"""
        import torch, lowdiff
        torch.set_num_threads(1); torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, {{
            "run_dir": "small/run", "compressor": {{"name": "none"}}, "snapshot": {{"every_steps": 5}},
            "log": {{"batch_steps": 3, "persistence": {persistence!r}}}}})
        errors = []
        for step in range(1, 41):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)
            try:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            except lowdiff.CheckpointWriteError as e:
                errors.append(e.errno)
            opt.zero_grad(set_to_none=True)
        for call in (opt.flush, opt.close):
            try:
                call()
            except lowdiff.CheckpointWriteError as e:
                errors.append(e.errno)
        print("ERRORS", *errors)
        print("DURABLE", lowdiff.recover("small/run").step)
    """)
    try:
        out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(small)], capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = next(line for line in out.stdout.splitlines() if line.startswith("ERRORS")).split()[1:]
    assert errors and set(errors) == {str(errno.ENOSPC)}, out.stdout
    assert any(line.startswith("DURABLE ") for line in out.stdout.splitlines()), out.stdout


def test_no_room_for_a_container_is_refused_before_libhdf5_writes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The check before libhdf5 writes, on a file system that reports 10 kB free: nothing is created."""
    real = os.statvfs

    def full(path: Any) -> Any:
        st = real(path)
        return SimpleNamespace(f_bavail=10, f_bfree=10, f_frsize=1024, f_bsize=st.f_bsize)

    monkeypatch.setattr(os, "statvfs", full)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(lowdiff.CheckpointWriteError, match="No space left on device"):
        lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, {"run_dir": str(tmp_path / "run")})
    assert not list((tmp_path / "run").rglob("*.h5*"))
