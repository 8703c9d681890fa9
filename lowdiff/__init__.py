"""lowdiff: checkpoint every training iteration by logging the gradient the optimizer consumes.

>>> import lowdiff                                                                       # doctest: +SKIP
>>> opt = lowdiff.wrap(torch.optim.AdamW(model.parameters()), model, {"run_dir": "runs/a"})  # doctest: +SKIP
>>> start = opt.resume()                                                                 # doctest: +SKIP
>>> rec = lowdiff.recover("runs/a")                                                      # doctest: +SKIP
>>> lowdiff.verify("runs/a").ok, lowdiff.inspect("runs/a").latest_step                   # doctest: +SKIP

The public surface is this module's names and the modules ``lowdiff.config``, ``lowdiff.errors``,
``lowdiff.data``, ``lowdiff.rng``, ``lowdiff.testing`` and ``lowdiff.integrations``. Everything under a leading
underscore (``lowdiff._storage``, ``lowdiff._training``, ...) is internal and may change without notice
(docs/reference/design.md, section 2).

Importing lowdiff loads only the configuration and the errors: the training side (``lowdiff.wrap``) and the
recovery side (``lowdiff.recover``) are imported on first use, so a recovery never loads the training code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lowdiff.config import CompressorConfig, Config, LogConfig, RemoteConfig, SnapshotConfig, TunerConfig
from lowdiff.errors import (
    CheckpointWriteError,
    ConfigError,
    CorruptFileError,
    LowDiffError,
    ModelMismatchError,
    RemoteStoreError,
    RunDirNotFoundError,
    RunLockedError,
    StepNotAvailableError,
    UnsupportedError,
)

if TYPE_CHECKING:  # the static view of the names loaded lazily below
    from lowdiff import data as data
    from lowdiff import rng as rng
    from lowdiff._persist.checkpointer import CheckpointStats as CheckpointStats
    from lowdiff._recovery import Recovered as Recovered
    from lowdiff._recovery import RecoveryReport as RecoveryReport
    from lowdiff._recovery import ReplayOptions as ReplayOptions
    from lowdiff._recovery import recover as recover
    from lowdiff._recovery.compact import compact as compact
    from lowdiff._recovery.run_info import inspect as inspect
    from lowdiff._recovery.verify import verify as verify
    from lowdiff._training.optimizer import LowDiffOptimizer as LowDiffOptimizer
    from lowdiff._training.optimizer import wrap as wrap

__version__ = "0.1.0"

_LAZY = {
    "wrap": "lowdiff._training.optimizer",
    "LowDiffOptimizer": "lowdiff._training.optimizer",
    "CheckpointStats": "lowdiff._persist.checkpointer",
    "recover": "lowdiff._recovery",
    "Recovered": "lowdiff._recovery",
    "RecoveryReport": "lowdiff._recovery",
    "ReplayOptions": "lowdiff._recovery",
    "compact": "lowdiff._recovery.compact",
    "inspect": "lowdiff._recovery.run_info",
    "verify": "lowdiff._recovery.verify",
}
_MODULES = ("data", "rng", "testing", "integrations")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"lowdiff.{name}")
    else:
        raise AttributeError(f"module 'lowdiff' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))


__all__ = [
    "wrap", "recover", "verify", "inspect", "compact", "LowDiffOptimizer", "CheckpointStats", "Recovered",
    "RecoveryReport", "ReplayOptions", "Config", "CompressorConfig", "SnapshotConfig", "LogConfig", "TunerConfig",
    "RemoteConfig", "LowDiffError", "RemoteStoreError", "ConfigError", "CorruptFileError", "CheckpointWriteError",
    "ModelMismatchError",
    "RunDirNotFoundError", "RunLockedError", "StepNotAvailableError", "UnsupportedError", "__version__",
]
