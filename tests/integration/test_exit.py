"""A wrapper that is never closed: its log is flushed when the interpreter exits or the wrapper is collected."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import lowdiff

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
""")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def test_exit_without_close_flushes_the_log(tmp_path: Path) -> None:
    for comp in ("topk", "powersgd", "none"):
        run_dir = tmp_path / comp
        p = subprocess.run([sys.executable, "-c", SCRIPT, str(run_dir), comp], capture_output=True, text=True,
                           timeout=120)
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
