"""A disk slower than training blocks step() (bounded memory) and says so; nothing is lost."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff.testing import intercept_writes


def test_slow_disk_blocks_and_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model,
                       {"run_dir": str(tmp_path / "run"),
                        "log": {"batch_steps": 1, "queue_depth": 1, "backpressure_warn_s": 0.1,
                                "persistence": "thread"}})
    slow_disk = intercept_writes(before_commit=lambda path: time.sleep(0.05))
    with slow_disk, caplog.at_level(logging.WARNING, logger="lowdiff._training.optimizer"):
        for _ in range(12):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            # At most queue_depth x batch_steps records (+2 control slots) wait in memory.
            st = opt.stats
            assert st is not None and st.queued <= 3
    blocked_s = opt.stats.blocked_s
    opt.close()
    assert blocked_s > 0
    assert any("waited" in r.getMessage() and "faster than the disk" in r.getMessage() for r in caplog.records)
    assert lowdiff.recover(tmp_path / "run").step == 12
