"""Recovery: rebuild state from a run directory. Imports nothing from the training side."""

from lowdiff.recovery.api import Recovered, RecoveryReport, recover

__all__ = ["Recovered", "RecoveryReport", "recover"]
