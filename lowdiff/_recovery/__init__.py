"""Recovery: rebuild state from a run directory. Imports nothing from the training side."""

from lowdiff._recovery.api import Recovered, RecoveryReport, recover
from lowdiff._recovery.options import ReplayOptions

__all__ = ["Recovered", "RecoveryReport", "ReplayOptions", "recover"]
