"""Error hierarchy. Every lowdiff error is a ``LowDiffError`` and also the builtin it resembles, so callers
can catch either (``except FileNotFoundError`` keeps working for a missing run directory)."""

from __future__ import annotations

from typing import Any


class LowDiffError(Exception):
    """Base class of every error lowdiff raises on purpose."""


class ConfigError(LowDiffError, ValueError):
    """A configuration key is unknown, has the wrong type or is out of range."""


class RunDirNotFoundError(LowDiffError, FileNotFoundError):
    """The run directory does not exist or holds no committed lowdiff run."""


class StepNotAvailableError(LowDiffError, LookupError):
    """The requested step is not covered by any snapshot plus a contiguous log."""


class CorruptFileError(LowDiffError, ValueError):
    """A file in the run directory fails a checksum, is truncated, or is structurally or semantically invalid.

    ``path`` names the file when one file is to blame (recovery then steps around it), ``step`` the step (or the
    file's first step) when the failure concerns one."""

    path: Any = None
    step: int | None = None

    def __init__(self, *args: Any, path: Any = None, step: int | None = None) -> None:
        super().__init__(*args)
        if path is not None:
            self.path = path
        if step is not None:
            self.step = step


class ForeignFileError(CorruptFileError):
    """An intact file that does not belong where it lies: another run's (run id), or another step's (its name)."""


class UnsafeFileError(CorruptFileError):
    """A name in the run directory that lowdiff will not read: not a regular file (a FIFO, a device, a directory),
    a symbolic link, unreadable, or an HDF5 file reaching outside itself (external storage or links, virtual
    datasets)."""


class FileVanishedError(LowDiffError, FileNotFoundError):
    """A file listed a moment ago is gone (retention or compaction deleted it meanwhile); readers list again."""

    path: Any = None

    def __init__(self, *args: Any, path: Any = None) -> None:
        super().__init__(*args)
        self.path = path


class ReplayWorkerError(LowDiffError, RuntimeError):
    """A replay worker process died before sending its result (killed, out of memory)."""


class ModelMismatchError(LowDiffError, ValueError):
    """The model or optimizer does not match the one recorded in the run directory."""


class CheckpointWriteError(LowDiffError, OSError):
    """Writing a checkpoint file failed (disk full, permission denied, I/O error)."""


class RunLockedError(LowDiffError, RuntimeError):
    """Another live process holds the run directory's writer lock."""


class UnsupportedError(LowDiffError, NotImplementedError):
    """A feature combination lowdiff cannot checkpoint exactly."""


class RemoteStoreError(LowDiffError, OSError):
    """The remote store (``remote.url``, or a URL given to recovery) cannot be reached, listed or read, or holds
    no usable run."""
