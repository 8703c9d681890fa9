"""lowdiff: checkpoint every training iteration by logging the gradient the optimizer consumes.

>>> import lowdiff                                                                       # doctest: +SKIP
>>> opt = lowdiff.wrap(torch.optim.AdamW(model.parameters()), model, {"run_dir": "runs/a"})  # doctest: +SKIP
>>> start = opt.resume()                                                                 # doctest: +SKIP
>>> rec = lowdiff.recover("runs/a")                                                      # doctest: +SKIP
>>> lowdiff.verify("runs/a").ok, lowdiff.inspect("runs/a").latest_step                   # doctest: +SKIP
"""

from lowdiff import data as data  # lowdiff.data.ResumableLoader & co. (by module path)
from lowdiff import rng as rng  # lowdiff.rng.capture / restore
from lowdiff.checkpointer import CheckpointStats
from lowdiff.config import CompressorConfig, Config, LogConfig, SnapshotConfig, TunerConfig
from lowdiff.errors import (
    CheckpointWriteError,
    ConfigError,
    CorruptFileError,
    LowDiffError,
    ModelMismatchError,
    RunDirNotFoundError,
    RunLockedError,
    StepNotAvailableError,
    UnsupportedError,
)
from lowdiff.optimizer import LowDiffOptimizer, wrap
from lowdiff.recovery import Recovered, RecoveryReport, ReplayOptions, recover
from lowdiff.recovery.compact import compact
from lowdiff.recovery.run_info import inspect
from lowdiff.recovery.verify import verify

__version__ = "0.1.0"

__all__ = [
    "wrap", "recover", "verify", "inspect", "compact", "LowDiffOptimizer", "CheckpointStats", "Recovered",
    "RecoveryReport", "ReplayOptions", "Config", "CompressorConfig", "SnapshotConfig", "LogConfig", "TunerConfig",
    "LowDiffError", "ConfigError", "CorruptFileError", "CheckpointWriteError", "ModelMismatchError",
    "RunDirNotFoundError", "RunLockedError", "StepNotAvailableError", "UnsupportedError", "__version__",
]
