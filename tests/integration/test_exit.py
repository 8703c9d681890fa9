"""A wrapper that is never closed: its log is flushed when the interpreter exits or the wrapper is collected."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff.testing import intercept_writes

SCRIPT = textwrap.dedent("""
    import sys, torch, lowdiff
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters()), model,
                       {"run_dir": sys.argv[1], "compressor": {"name": sys.argv[2], "rank": 2, "ratio": 0.25},
                        "snapshot": {"every_steps": 100}, "log": {"batch_steps": 4}})
    for _ in range(7):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    # no opt.close(): steps 5-7 are in the writer's open batch
    if len(sys.argv) > 3:  # as if weakref's own exit hook had run first (it does when registered after ours)
        import weakref
        weakref.finalize._shutdown = True
""")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("weakref_exit_first", [False, True])
def test_exit_without_close_flushes_the_log(tmp_path: Path, weakref_exit_first: bool) -> None:
    for comp in ("topk", "powersgd", "none"):
        run_dir = tmp_path / comp
        p = subprocess.run([sys.executable, "-c", SCRIPT, str(run_dir), comp, *(["x"] if weakref_exit_first else [])],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "terminate" not in p.stderr and "Error" not in p.stderr, p.stderr
        assert lowdiff.recover(run_dir).step == 7


def test_collected_wrapper_flushes_and_unlocks(tmp_path: Path) -> None:
    model = _model()
    cfg = {"run_dir": str(tmp_path / "run"), "compressor": {"name": "topk", "ratio": 0.25},
           "snapshot": {"every_steps": 100}, "log": {"batch_steps": 4}}
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, cfg)
    for _ in range(3):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    del opt
    gc.collect()
    assert lowdiff.recover(tmp_path / "run").step == 3
    # The run directory's lock went with it: the run can be resumed in this process.
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, cfg)
    assert opt.resume() == 3
    opt.close()


def test_collection_on_the_writer_thread_closes_from_another_thread(tmp_path: Path) -> None:
    """A garbage collection can run on any thread; on the writer's, closing there would wait for itself. The
    close is made on the writer thread itself, from inside one of its commits (lowdiff.testing's seam)."""
    model = _model()
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model,
                       {"run_dir": str(tmp_path / "run"), "compressor": {"name": "topk", "ratio": 0.25},
                        "snapshot": {"every_steps": 100}, "log": {"batch_steps": 4, "persistence": "thread"}})
    for _ in range(3):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    on_thread: list[str] = []
    closers: list[threading.Thread] = []

    def close_on_the_writer_thread(path: Path) -> None:
        if not on_thread:
            on_thread.append(threading.current_thread().name)
            opt.close()  # must return at once: the writer thread cannot wait for itself
            # The close goes on in a thread of its own, which waits for this commit to finish.
            closers.extend(t for t in threading.enumerate() if t.name == "lowdiff-close")

    with intercept_writes(before_commit=close_on_the_writer_thread):
        opt.flush()
    for t in closers:
        t.join(timeout=60)
    assert on_thread == ["lowdiff-writer"]
    assert closers and not any(t.is_alive() for t in closers)
    assert lowdiff.recover(tmp_path / "run").step == 3
