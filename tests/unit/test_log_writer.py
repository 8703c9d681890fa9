"""The background writer's batch-size change: an item in its queue, ordered with the records, no wait."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from lowdiff.staging import Staged
from lowdiff.storage.format import LOG_DIR, SNAPSHOT_DIR, list_segments
from lowdiff.storage.run_dir import RetentionPolicy, RunDir
from lowdiff.storage.segment import StepRecord
from lowdiff.writer import BackgroundWriter


class _Gate:
    """A ``ready`` event the writer blocks on until the test opens it (keeps records queued)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def synchronize(self) -> None:
        assert self.event.wait(30)


def _record(step: int, ready: object = None) -> Staged[StepRecord]:
    return Staged(StepRecord(step=step, groups=[{"lr": 0.1}], grads={"w": {"g": torch.full((4,), float(step))}}),
                  ready)


def test_set_batch_steps_cuts_in_order_without_waiting(tmp_path: Path) -> None:
    for d in (LOG_DIR, SNAPSHOT_DIR):
        (tmp_path / d).mkdir()
    w = BackgroundWriter(RunDir(tmp_path), batch_steps=2, codec="none", compressor="none", queue_depth=4,
                         retention=RetentionPolicy(), durable_step=0)
    gate = _Gate()
    w.submit_record(_record(1, gate))  # the writer stalls on this record: everything below stays queued
    for s in (2, 3):
        w.submit_record(_record(s))
    w.set_batch_steps(3)  # returns at once although nothing is written yet: the cut goes after step 3
    assert w.capacity == 4 * 3 + 2
    assert list_segments(tmp_path) == []
    for s in range(4, 11):
        w.submit_record(_record(s))
    gate.event.set()
    assert w.flush() == 10
    w.close()
    # [1, 2] with the old size, [3] cut at the change, then 3 per segment; the flush writes the rest.
    assert [(a, b) for a, b, _ in list_segments(tmp_path)] == [(1, 2), (3, 3), (4, 6), (7, 9), (10, 10)]
    assert w.batch_steps == 3
