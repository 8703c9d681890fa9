"""The tuner: picks the snapshot interval and the log batch size from costs measured while training.

- :mod:`lowdiff._persist.tuner.model`: the cost model (pure arithmetic: waste per hour of a (F, B) choice);
- :mod:`lowdiff._persist.tuner.solve`: the solver and its logged :class:`Decision`;
- :mod:`lowdiff._persist.tuner.profiler`: online measurement of the model's inputs;
- :mod:`lowdiff._persist.tuner.auto`: the controller that re-solves when conditions drift and probes the writer;
- :mod:`lowdiff._persist.tuner.policy`: the snapshot policy that puts the controller's decisions in force during
  training (the checkpointer asks it when to snapshot and how to batch the log).

The derivation is docs/reference/tuner-model.md.
"""

from lowdiff._persist.tuner.auto import AutoTuner
from lowdiff._persist.tuner.model import Breakdown, Costs, Limits, evaluate, min_batch_steps, young_daly_interval
from lowdiff._persist.tuner.profiler import PROBE_BATCH_STEPS, PROBE_STEPS, Profiler, WriteFit, fit_write_cost
from lowdiff._persist.tuner.solve import CLOSEST_MARGIN, Decision, inputs_line, solve
from lowdiff._recovery.run_info import format_decisions
from lowdiff._storage.run_dir import DECISIONS_FILE

__all__ = ["AutoTuner", "Breakdown", "CLOSEST_MARGIN", "Costs", "DECISIONS_FILE", "Decision", "Limits",
           "PROBE_BATCH_STEPS",
           "PROBE_STEPS", "Profiler", "WriteFit", "evaluate", "fit_write_cost", "format_decisions", "inputs_line",
           "min_batch_steps", "solve", "young_daly_interval"]
