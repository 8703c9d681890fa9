"""Error hierarchy. Every lowdiff error is a ``LowDiffError`` and also the builtin it resembles, so callers
can catch either (``except FileNotFoundError`` keeps working for a missing run directory)."""

from __future__ import annotations


class LowDiffError(Exception):
    """Base class of every error lowdiff raises on purpose."""


class ConfigError(LowDiffError, ValueError):
    """A configuration key is unknown, has the wrong type or is out of range."""


class RunDirNotFoundError(LowDiffError, FileNotFoundError):
    """The run directory does not exist or holds no committed lowdiff run."""


class StepNotAvailableError(LowDiffError, LookupError):
    """The requested step is not covered by any snapshot plus a contiguous log."""


class CorruptFileError(LowDiffError, ValueError):
    """A file in the run directory fails a checksum, is truncated, or is structurally invalid.

    ``path`` names the damaged file when one file is to blame (recovery then steps around it)."""

    path: object = None


class ModelMismatchError(LowDiffError, ValueError):
    """The model or optimizer does not match the one recorded in the run directory."""


class CheckpointWriteError(LowDiffError, OSError):
    """Writing a checkpoint file failed (disk full, permission denied, I/O error)."""


class RunLockedError(LowDiffError, RuntimeError):
    """Another live process holds the run directory's writer lock."""


class UnsupportedError(LowDiffError, NotImplementedError):
    """A feature combination lowdiff cannot checkpoint exactly."""
