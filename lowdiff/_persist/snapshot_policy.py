"""Snapshot policies: when to take a full snapshot and how many steps go into one log segment.

The checkpointer asks its policy at every step and applies what it answers to the writer; a policy never calls
back into the checkpointer or the writer (it is handed the writer's counters as data). Two policies exist:
:class:`FixedInterval` (``snapshot.every_steps`` and ``log.batch_steps`` set to integers) and
:class:`lowdiff._persist.tuner.policy.TunedPolicy` (either of them ``auto``).

Call order, per step ``s``: ``observe_step(s, ...)``; then, if ``wants_snapshot(s)``: ``at_snapshot(s)`` (a batch
size to cut at, if any), the snapshot, ``observe_snapshot(...)``; then ``after_step(s, writer_stats)`` (a batch
size to cut at, if any).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lowdiff._persist.writer import WriterStats


class SnapshotPolicy(Protocol):
    @property
    def every_steps(self) -> int:
        """Snapshot interval in force."""

    @property
    def batch_steps(self) -> int:
        """Steps per log segment in force."""

    last_snapshot_step: int

    def start(self, durable_step: int) -> None:
        """Training (re)starts after ``durable_step`` (0 for a new run)."""

    def wants_snapshot(self, step: int) -> bool: ...

    def observe_step(self, step: int, *, apply_s: float | None, record_bytes: float) -> None: ...

    def at_snapshot(self, step: int) -> int | None:
        """Called when ``step`` is a snapshot step, before the snapshot: a batch size to switch to after this
        step's record (the open segment is cut there), or None."""

    def observe_snapshot(self, step: int, *, nbytes: float, block_s: float) -> None: ...

    def after_step(self, step: int, writer: WriterStats) -> int | None:
        """After the step's record (and snapshot): a batch size to switch to now (cutting the open segment), or
        None."""

    def on_flush(self, last_step: int) -> None:
        """A flush wrote the partial segment: the writer's next segment starts after ``last_step``."""

    @property
    def probing(self) -> bool: ...

    @property
    def settled(self) -> bool: ...

    @property
    def decisions(self) -> tuple[Any, ...]: ...


@dataclass
class FixedInterval:
    """A snapshot every ``every_steps`` steps (at multiples of it), ``batch_steps`` steps per segment."""

    every_steps: int
    batch_steps: int
    last_snapshot_step: int = 0

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.batch_steps < 1:
            raise ValueError(f"every_steps and batch_steps must be >= 1, got {self.every_steps}, "
                             f"{self.batch_steps}")

    def start(self, durable_step: int) -> None:
        self.last_snapshot_step = durable_step

    def wants_snapshot(self, step: int) -> bool:
        return step % self.every_steps == 0

    def observe_step(self, step: int, *, apply_s: float | None, record_bytes: float) -> None:
        return None

    def at_snapshot(self, step: int) -> int | None:
        self.last_snapshot_step = step
        return None

    def observe_snapshot(self, step: int, *, nbytes: float, block_s: float) -> None:
        return None

    def after_step(self, step: int, writer: WriterStats) -> int | None:
        return None

    def on_flush(self, last_step: int) -> None:
        return None

    @property
    def probing(self) -> bool:
        return False

    @property
    def settled(self) -> bool:
        return True

    @property
    def decisions(self) -> tuple[Any, ...]:
        return ()
