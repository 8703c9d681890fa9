"""Recovery: rebuild state from a run directory. Imports nothing from the training side."""

from lowdiff.recovery.api import Recovered, RecoveryReport, recover
from lowdiff.recovery.options import ReplayOptions

__all__ = ["Recovered", "RecoveryReport", "ReplayOptions", "recover"]
