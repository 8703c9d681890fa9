"""A clean stop resumes bit for bit (issue 34): a job that ends cleanly between two snapshots (``opt.close()``, the
interpreter's exit with the optimizer open, a scheduler's SIGTERM) and is run again with ``opt.resume()`` continues
exactly as the uninterrupted run, Top-k's and PowerSGD's error-feedback residuals included (the stop file,
FORMAT.md section 4a). Each run is a fresh interpreter (tests/integration/clean_stop_child.py): an LR scheduler, a
GradScaler that skips three iterations, dropout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowdiff

CHILD = Path(__file__).with_name("clean_stop_child.py")
TOTAL = 16
STOP_AT = 11  # snapshots every 5 steps: 11 is between two
_refs: dict[str, dict] = {}


def run_child(tmp_path: Path, run_dir: Path, compressor: str, persistence: str, stop_at: int, total: int = TOTAL,
              ending: str = "close", expect: int = 0, ranks: int = 0) -> dict:
    """The loop in a fresh interpreter (``ranks``: under torchrun with that many gloo ranks, DDP)."""
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.pt"
    launch = [sys.executable]
    if ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
                   "--master_port", str(port)]
    proc = subprocess.run([*launch, str(CHILD), str(run_dir), compressor, persistence, str(stop_at),
                           str(total), str(out), ending], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.returncode == expect, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return torch.load(out, weights_only=True) | {"stderr": proc.stderr}


def reference(tmp_path_factory: pytest.TempPathFactory, compressor: str, ranks: int = 0) -> dict:
    key = f"{compressor}-{ranks}"
    if key not in _refs:
        d = tmp_path_factory.mktemp(f"ref-{key}")
        _refs[key] = run_child(d, d / "run", compressor, "thread", 0, ranks=ranks) | {"run_dir": d / "run"}
    return _refs[key]


def assert_same(ref: dict, got: dict) -> None:
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), f"parameter {k} differs from the uninterrupted run's"
    for i, st in ref["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["optimizer"]["state"][i][k]), f"optimizer state {i}/{k} differs"
    assert ref["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]


ENDINGS = [("default", "close"), ("thread", "close"), ("default", "exit"), ("default", "sigterm"),
           ("thread", "sigterm")]


# Each ending with Top-k; PowerSGD's memory (its Q and residuals) with the default ending in CI, the rest with
# LOWDIFF_SLOW=1: how the stop is reached does not depend on the compressor.
@pytest.mark.parametrize(("compressor", "persistence", "ending"), [
    *[("topk", p, e) for p, e in ENDINGS],
    ("powersgd", "default", "close"),
    *[pytest.param("powersgd", p, e, marks=pytest.mark.slow) for p, e in ENDINGS if (p, e) != ("default", "close")]])
def test_a_clean_stop_between_snapshots_resumes_bit_for_bit(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                             compressor: str, persistence: str, ending: str) -> None:
    ref = reference(tmp_path_factory, compressor)
    run_dir = tmp_path / "run"
    run_child(tmp_path, run_dir, compressor, persistence, STOP_AT, ending=ending,
              expect=143 if ending == "sigterm" else 0)
    assert lowdiff.inspect(run_dir).stop_steps == [STOP_AT]
    got = run_child(tmp_path, run_dir, compressor, persistence, 0)
    assert got["start"] == STOP_AT
    assert "restart at zero" not in got["stderr"]
    assert_same(ref, got)


def test_after_a_crash_the_residuals_restart_and_say_so(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The stop file is what makes the difference: without it (a crash at the same step) the run resumes there,
    warns that the residuals restart at zero, and ends elsewhere than the uninterrupted run."""
    ref = reference(tmp_path_factory, "topk")
    run_dir = tmp_path / "run"
    run_child(tmp_path, run_dir, "topk", "default", STOP_AT)
    for p in (run_dir / "stops").iterdir():
        p.unlink()
    got = run_child(tmp_path, run_dir, "topk", "default", 0)
    assert got["start"] == STOP_AT and "restart at zero" in got["stderr"]
    assert not all(torch.equal(v, got["model"][k]) for k, v in ref["model"].items())


def test_a_stop_file_is_for_its_own_step_only(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A stop at step 11, then a resume that trains to 14 and crashes (no clean stop): recovery at 14 has no exact
    compressor memory, and at 11 it has; the next clean stop replaces the older stop file."""
    run_dir = tmp_path / "run"
    run_child(tmp_path, run_dir, "topk", "default", STOP_AT)
    assert lowdiff.recover(run_dir, step=STOP_AT, workers=1).compressor_state_exact
    run_child(tmp_path, run_dir, "topk", "default", 14)
    assert lowdiff.inspect(run_dir).stop_steps == [14]
    assert lowdiff.recover(run_dir, step=14, workers=1).compressor_state_exact
    assert not lowdiff.recover(run_dir, step=13, workers=1).compressor_state_exact


@pytest.mark.distributed
@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_a_clean_stop_on_two_ddp_ranks_resumes_bit_for_bit(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                            compressor: str) -> None:
    """The same on 2 gloo ranks under DDP: each rank's own residuals go into its shard of the stop file. Under DDP
    lowdiff's hook compresses the gradients before the GradScaler unscales them (the log holds the scale it used:
    recovery was wrong by up to 2e-3 without it) and before it finds an overflow (the hook's memory stays finite:
    every step after the first overflow was skipped before)."""
    ref = reference(tmp_path_factory, compressor, ranks=2)
    rec = lowdiff.recover(ref["run_dir"], workers=1)
    assert rec.step == TOTAL
    assert_same(ref, {"model": rec.model, "optimizer": rec.optimizer})
    after_overflow = lowdiff.recover(ref["run_dir"], step=5, workers=1).model
    assert not all(torch.equal(v, rec.model[k]) for k, v in after_overflow.items()), "training stalled"
    run_dir = tmp_path / "run"
    run_child(tmp_path, run_dir, compressor, "default", STOP_AT, ranks=2)
    assert lowdiff.inspect(run_dir).stop_steps == [STOP_AT]
    assert len(list((run_dir / "stops").iterdir())) == 2
    got = run_child(tmp_path, run_dir, compressor, "default", 0, ranks=2)
    assert got["start"] == STOP_AT and "restart at zero" not in got["stderr"]
    assert_same(ref, got)
