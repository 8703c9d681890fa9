"""A disk slower than training blocks step() (bounded memory) and says so; nothing is lost."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

import lowdiff
import lowdiff.optimizer
import lowdiff.storage.log_writer as log_writer


def test_slow_disk_blocks_and_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    real = log_writer.write_segment

    def slow_write_segment(*a, **kw):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return real(*a, **kw)

    monkeypatch.setattr(log_writer, "write_segment", slow_write_segment)
    monkeypatch.setattr(lowdiff.optimizer, "BACKPRESSURE_REPORT_S", 0.1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model,
                       {"run_dir": str(tmp_path / "run"), "log": {"batch_steps": 1, "queue_depth": 1}})
    with caplog.at_level(logging.WARNING, logger="lowdiff.optimizer"):
        for _ in range(12):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            # At most queue_depth x batch_steps records (+2 control slots) wait in memory.
            assert opt._checkpointer is not None and opt._checkpointer._writer is not None
            assert opt._checkpointer._writer._queue.qsize() <= 3
    opt.close()
    assert opt._checkpointer.stats.blocked_s > 0
    assert any("waited" in r.getMessage() and "faster than the disk" in r.getMessage() for r in caplog.records)
    assert lowdiff.recover(tmp_path / "run").step == 12
