"""What the checkpointer drives: the :class:`Writer` protocol, implemented by the writer thread
(:class:`lowdiff._persist.thread_writer.BackgroundWriter`) and by the persistence process's trainer side
(:class:`lowdiff._persist.process_writer.ProcessWriter`), and the counters both keep.

Call order (the checkpointer's, lowdiff/_persist/checkpointer.py): ``take_error`` before each step;
``submit_early`` when ``opt.step()`` returns (the iteration has not ended), ``retake_rng`` if the loop retakes the
RNG state before the iteration ends, ``end_known`` once the loop's end-of-iteration calls have run, then
``submit_record`` when it ends (or ``drop`` when an exception interrupted it); at snapshot steps, after that step's
record, ``submit_snapshot`` or ``submit_shadow_snapshot``; ``set_batch_steps`` to cut a segment; ``flush`` / ``close``
at the end. Items are :class:`lowdiff._transfer.host_copies.Staged`: the writer waits for their copies, persists them
through the run directory and releases them. A writer never raises a background failure from these calls: it keeps it
for ``take_error``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from lowdiff._storage.later import Later
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Staged


@dataclass
class WriterStats:
    segments: int = 0
    snapshots: int = 0
    log_bytes: int = 0
    log_steps: int = 0
    """Steps in the committed segments (bumped before ``log_bytes``)."""
    snapshot_bytes: int = 0
    write_s: float = 0.0
    blocked_s: float = 0.0
    """Time the training thread waited because the queue was full (the disk is slower than training)."""
    steps_skipped: int = 0
    """``log.when_behind: replica``: records left out of the log because the disk was behind; a snapshot of the
    replica written after them covers them."""
    cpu_s: float = 0.0
    """CPU time the writer has used: its thread's, or the whole persistence process's (as of its last report)."""
    remote_durable_step: int = -1
    """``remote.url``: the newest step whose files are all uploaded (lowdiff/_persist/mirror.py); -1: none yet."""
    remote_lag_bytes: int = 0
    """Bytes of committed files the mirror has still to upload (as of its last pass)."""
    remote_behind_since: float = 0.0
    """Wall-clock time (``time.time()``) since which a committed file waits for the mirror; 0: caught up."""


@dataclass
class WriterEvents:
    """What a writer thread tells whoever runs it, as callbacks (the persistence process reports to its trainer
    through them, lowdiff/_persist/child.py)."""

    committed: Callable[[], None] = lambda: None
    """After each segment or snapshot the writer committed (or failed to)."""
    failed: Callable[[BaseException], None] | None = None
    """A write failed with this error; when set, the error counts as reported once this returns."""
    writing_segment: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    """Entered around each segment's write (the persistence process gathers the slots it frees into one message)."""
    cpu_clock: Callable[[], float] = field(default=time.thread_time)
    """The writer's CPU time: its thread's, or the whole process's (``time.process_time``) in a persistence
    process."""


class Writer(Protocol):
    """The call order is the module's docstring."""

    batch_steps: int

    @property
    def stats(self) -> WriterStats: ...

    @property
    def shadow_ok(self) -> bool:
        """Whether snapshots come from a healthy shadow replica (``snapshot.shadow``)."""

    @property
    def slots(self) -> Any:
        """Where the stager packs step records and snapshots (lowdiff._training.stager.Slots)."""

    @property
    def durable_step(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Items the writer holds before ``submit_record`` blocks (back-pressure)."""

    @property
    def queued(self) -> int: ...

    @property
    def error(self) -> BaseException | None:
        """The background failure in force (reported or not), None while healthy."""

    def take_error(self) -> BaseException | None:
        """The first background failure not yet reported (each is reported once)."""

    def on_thread(self) -> bool:
        """Whether the caller runs on the writer's own thread."""

    def submit_early(self, record: Staged[StepRecord], keep_if_orphaned: bool) -> None: ...

    def retake_rng(self, record: Staged[StepRecord]) -> None: ...

    def before_seal(self) -> None: ...

    def end_known(self, record: Staged[StepRecord], data: dict[str, Any], end_groups: list[dict[str, Any]],
                  later: Sequence[Later] = ()) -> None: ...

    def submit_record(self, record: Staged[StepRecord]) -> None: ...

    def drop(self, step: int) -> None: ...

    def submit_snapshot(self, state: Staged[SnapshotState]) -> None: ...

    def submit_shadow_snapshot(self, step: int) -> None: ...

    def set_batch_steps(self, steps: int) -> None: ...

    def flush(self) -> int:
        """Wait until everything handed over is committed (or failed); returns the durable step."""

    def close(self) -> None: ...
