"""Optimizer state between torch's index keys and lowdiff's parameter names.

``torch.optim.Optimizer.state_dict()`` keys per-parameter state by position (0, 1, ... over the groups'
parameters in order) and lists positions in each group; lowdiff stores everything by parameter name, so a run
survives any re-ordering and any number of ranks. ``order`` is the list of parameter names in that position
order (the manifest's ``optimized_params``).

>>> to_named({0: {"step": 1}}, ["w"])
{'w': {'step': 1}}
>>> to_indexed({"w": {"step": 1}}, [["w"]], [{"lr": 0.1}])
{'state': {0: {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': [0]}]}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def to_named(state: Mapping[int, Mapping[str, Any]], order: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``state_dict()["state"]`` keyed by parameter name instead of position (each entry a new dict)."""
    return {order[i]: dict(st) for i, st in state.items()}


def to_indexed(named: Mapping[str, Mapping[str, Any]], group_names: Sequence[Sequence[str]],
               group_hyper: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A torch optimizer ``state_dict`` from state by name, the names of each group (in position order) and
    each group's hyperparameters (without ``params``). Names without state are left out of ``state``."""
    index = {n: i for i, n in enumerate(n for names in group_names for n in names)}
    groups = [{**{k: v for k, v in hyper.items() if k != "params"}, "params": [index[n] for n in names]}
              for names, hyper in zip(group_names, group_hyper)]
    return {"state": {index[n]: st for n, st in named.items() if n in index}, "param_groups": groups}
