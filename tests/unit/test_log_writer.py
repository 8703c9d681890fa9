"""The background writer's batch-size change: an item in its queue, ordered with the records, no wait."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from lowdiff._persist.thread_writer import BackgroundWriter
from lowdiff._storage.format import LOG_DIR, SNAPSHOT_DIR, list_segments
from lowdiff._storage.run_dir import RetentionPolicy, RunDir
from lowdiff._storage.segment import StepRecord
from lowdiff._transfer.host_copies import Staged


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


def test_cuts_and_batch_size_changes_never_wait_for_a_full_queue(tmp_path: Path) -> None:
    """A full queue (the disk behind), then a smaller batch size whose bound is below what the queue holds, and a
    cut: neither waits. The persistence process's main thread queues them while it applies every step to the
    replica (log.when_behind: replica, batch_steps auto); waiting there would stall training at the disk's pace.
    The cut keeps the batch size the change queued before it set (it used to restore the one in force)."""
    for d in (LOG_DIR, SNAPSHOT_DIR):
        (tmp_path / d).mkdir()
    w = BackgroundWriter(RunDir(tmp_path), batch_steps=2, codec="none", compressor="none", queue_depth=4,
                         retention=RetentionPolicy(), durable_step=0)
    gate = _Gate()
    w.submit_record(_record(1, gate))
    for s in range(2, 11):  # capacity 4 x 2 + 2 = 10: full whether or not the writer has taken step 1 yet
        w.submit_record(_record(s))
    assert w.room() <= 1

    def control() -> None:
        w.set_batch_steps(1)  # bound 4 x 1 + 2 = 6, below the 9 or 10 items queued
        w.cut()

    t = threading.Thread(target=control, daemon=True)
    t.start()
    t.join(30)
    returned = not t.is_alive()
    gate.event.set()  # let the writer go whatever happened, so a failure does not hang the test
    assert returned, "set_batch_steps() or cut() waited for the writer"
    assert w.flush() == 10
    w.close()
    # Pairs up to the change after step 10, which cut the open segment [9, 10]; nothing after it.
    assert [(a, b) for a, b, _ in list_segments(tmp_path)] == [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
    assert w.batch_steps == 1


def test_a_snapshot_that_arrives_after_dropped_records_does_not_resume_the_log(tmp_path: Path) -> None:
    """A persistence process gets a snapshot once its GPU copies complete, after the records of the steps since.
    A write failure in between drops those records: the log may resume only from a snapshot after every dropped
    record, or recovery would find a gap and the writer would report steps durable that are not reachable."""
    import errno

    import lowdiff.testing
    from lowdiff._storage.snapshot import SnapshotState

    for d in (LOG_DIR, SNAPSHOT_DIR):
        (tmp_path / d).mkdir()
    w = BackgroundWriter(RunDir(tmp_path), batch_steps=2, codec="none", compressor="none", queue_depth=4,
                         retention=RetentionPolicy(), durable_step=0)
    full = {"on": True}

    def pwritev(fd: int, bufs: list, offset: int) -> int:
        if full["on"]:
            raise OSError(errno.ENOSPC, "full")
        return lowdiff.testing.real_pwritev(fd, bufs, offset)

    def snapshot(step: int) -> Staged[SnapshotState]:
        return Staged(SnapshotState(step=step, params={"w": torch.full((4,), float(step))},
                                    param_groups=[{"lr": 0.1, "params": ["w"]}]))

    with lowdiff.testing.intercept_writes(pwritev):
        for s in (1, 2, 3, 4):  # [1, 2] fails; 3 and 4 are dropped, the writer broken
            w.submit_record(_record(s))
        assert w.flush() == 0 and w.take_error() is not None
        full["on"] = False
        w.submit_snapshot(snapshot(2))  # written, but steps 3 and 4 are gone: the log does not resume from it
        for s in (5, 6):
            w.submit_record(_record(s))
        assert w.flush() == 2
        w.submit_snapshot(snapshot(6))  # after every dropped record: the log resumes here
        for s in (7, 8):
            w.submit_record(_record(s))
        assert w.flush() == 8
    w.close()
    assert [(a, b) for a, b, _ in list_segments(tmp_path)] == [(7, 8)]
