"""Semantic checks of the metadata a run directory holds (docs/reference/FORMAT.md section 8).

A checksum proves a file is intact, not that it is sane: every value read from a run directory is checked for
type, range and finiteness before it is used, and for belonging to this run (its run id). Every failure is a
:class:`~lowdiff.errors.CorruptFileError` (:class:`~lowdiff.errors.ForeignFileError` for a file of another run)
that says where (``where``: the file, and the step or entry) and what is wrong.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from lowdiff._storage.format import decode_value
from lowdiff._storage.history import History, check_id, span
from lowdiff.errors import CorruptFileError, ForeignFileError

# Hyperparameters torch.optim's own constructors bound (they raise "Invalid ... value" outside these ranges).
_RANGES: dict[str, tuple[float, float]] = {
    "lr": (0.0, math.inf), "eps": (0.0, math.inf), "weight_decay": (0.0, math.inf), "momentum": (0.0, math.inf),
    "lr_decay": (0.0, math.inf), "initial_accumulator_value": (0.0, math.inf), "alpha": (0.0, math.inf),
    "momentum_decay": (0.0, math.inf), "rho": (0.0, 1.0), "betas": (0.0, 1.0),
}


def check_run_id(value: Any, where: str) -> str | None:
    """A run id as stored, or None (a run written before run ids existed)."""
    return check_id(value, where, "run id")


def check_belongs(meta: dict[str, Any], run_id: str | None, path: Path, history: History | None = None,
                  states: tuple[int, int] | None = None) -> None:
    """The file's run id must be the manifest's (both absent in a run written before run ids existed); with
    ``history`` (the manifest's) and ``states`` (the first and last step whose state the file needs or gives: a
    segment of steps F-L needs the state of F-1), its branch must be one of that history whose span holds them
    (lowdiff._storage.history)."""
    mine = check_run_id(meta.get("run_id"), str(path))
    if mine != run_id:
        if run_id is None:
            what = f"belongs to run {mine}, but this run directory predates run ids"
        elif mine is None:
            what = "names no run, but every file of this run names run " + run_id
        else:
            what = f"belongs to run {mine}, not to this run ({run_id})"
        raise ForeignFileError(f"{path}: {what}; it was copied or linked in from elsewhere (remove it)", path=path)
    if history is None or states is None:
        return
    branch = check_id(meta.get("branch"), str(path), "branch")
    steps = span(history, branch)
    name = "the run's first history" if branch is None else f"branch {branch}"
    if steps is None:
        raise ForeignFileError(f"{path}: written by {name}, which a resume of this run went back from and discarded "
                               "(a file put back from quarantine/ or from a backup); remove it", path=path)
    first, last = steps
    held = f"step {states[1]}" if states[0] == states[1] else f"steps {states[0] + 1}-{states[1]}"
    if last is not None and states[1] > last:
        raise ForeignFileError(f"{path}: holds {held} of {name}, which a resume of this run left at step {last}: "
                               "the file is from the discarded part of that history (put back from quarantine/ or "
                               "from a backup); remove it", path=path)
    if states[0] < first:
        raise ForeignFileError(f"{path}: holds {held}, before step {first} where {name} began; remove it", path=path)


def check_shard(meta: dict[str, Any], index: int, count: int, path: Path) -> None:
    """A file that names its shard (format 2.1) must be the shard its name says."""
    if "shard" not in meta:
        return
    shard = meta["shard"]
    if shard != [index, count]:
        raise ForeignFileError(f"{path}: holds shard {str(shard)[:40]}, its name says shard {index} of {count}",
                               path=path)


def as_int(value: Any, where: str, what: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise CorruptFileError(f"{where}: invalid {what} {str(value)[:40]!r}")
    return value


def _decode(value: Any, where: str) -> Any:
    try:
        return decode_value(value)
    except CorruptFileError as e:
        raise CorruptFileError(f"{where}: {e}") from e


def _number(v: Any) -> float | None:
    """The value of a real number, a one-element real tensor included; None for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype != torch.bool and not v.dtype.is_complex:
        return float(v.item())
    return None


def _check_value(key: str, default: Any, value: Any, where: str) -> None:
    """``value`` must have the kind of ``default`` (what the optimizer was built with), be finite and in range."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        want = "true or false"
    elif isinstance(default, tuple):
        if not isinstance(value, tuple) or len(value) != len(default):
            raise CorruptFileError(f"{where}: hyperparameter {key!r} is {str(value)[:40]!r}, expected a tuple of "
                                   f"{len(default)}")
        for d, v in zip(default, value):
            _check_value(key, d, v, where)
        return
    elif isinstance(default, (int, float, torch.Tensor)):
        x = _number(value)
        if x is None:
            raise CorruptFileError(f"{where}: hyperparameter {key!r} is {str(value)[:40]!r}, not a number")
        lo, hi = _RANGES.get(key, (-math.inf, math.inf))
        if not math.isfinite(x) or not lo <= x <= hi:
            raise CorruptFileError(f"{where}: hyperparameter {key!r} = {x!r} is not a finite number in "
                                   f"[{lo}, {hi}]")
        return
    elif default is None:
        if _number(value) is not None and not isinstance(value, bool):
            _check_value(key, 0.0, value, where)  # a number where the default is none: finite and in range all the same
            return
        ok = value is None or isinstance(value, (bool, str))
        want = "none, a flag or a number"
    elif isinstance(default, str):
        ok = isinstance(value, str)
        want = "a string"
    else:
        ok = type(value) is type(default)
        want = f"a {type(default).__name__}"
    if not ok:
        raise CorruptFileError(f"{where}: hyperparameter {key!r} is {str(value)[:40]!r}, expected {want}")


def decoded_defaults(defaults: dict[str, Any], where: str) -> dict[str, Any]:
    """The manifest's optimizer defaults decoded and checked against themselves (finite, in range)."""
    out = {}
    for key, enc in defaults.items():
        value = _decode(enc, where)
        # The bounded keys are numbers (betas: a pair) in torch.optim's optimizers. Adafactor's eps is a pair whose
        # first element may be None, and transformers' Adafactor has lr None (relative steps): the range applies to
        # the numbers.
        if key == "betas":
            reference: Any = (0.0, 0.0)
        elif key == "eps" and isinstance(value, tuple) and len(value) == 2:
            reference = tuple(None if v is None else 0.0 for v in value)
        elif key in _RANGES:
            reference = None if value is None else 0.0
        else:
            reference = value
        _check_value(key, reference, value, where)
        out[key] = value
    return out


def check_group(group: Any, defaults: dict[str, Any], where: str, names: list[str] | None = None) -> None:
    """One optimizer group's encoded hyperparameters (a snapshot's, or a logged step's): every key the optimizer
    was built with is present, of its kind, finite and in range; the others decode. ``names``: the group's
    parameter names, which a snapshot stores under "params"."""
    if not isinstance(group, dict):
        raise CorruptFileError(f"{where}: an optimizer group is {type(group).__name__}, not an object")
    for key, default in defaults.items():
        if key not in group:
            raise CorruptFileError(f"{where}: lacks hyperparameter {key!r} that the run's optimizer has")
        _check_value(key, default, _decode(group[key], where), where)
    for key, value in group.items():
        if key == "params":
            if names is None or value != names:
                raise CorruptFileError(f"{where}: group parameters {str(value)[:80]} are not the manifest's")
        elif key not in defaults:
            _decode(value, where)
    if names is not None and "params" not in group:
        raise CorruptFileError(f"{where}: an optimizer group lacks its parameter names")


def check_groups(groups: Any, manifest: Any, where: str, with_names: bool) -> None:
    if not isinstance(groups, list) or len(groups) != len(manifest.param_groups):
        n = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise CorruptFileError(f"{where}: has {n} optimizer groups, the manifest {len(manifest.param_groups)}")
    defaults = manifest.defaults_decoded
    for i, (g, names) in enumerate(zip(groups, manifest.param_groups)):
        check_group(g, defaults, f"{where} group {i}", names if with_names else None)


def check_scalar_state(state: Any, where: str) -> dict[str, Any]:
    """Non-tensor optimizer state of one parameter (e.g. a Python step count): decoded, numbers finite."""
    if not isinstance(state, dict):
        raise CorruptFileError(f"{where}: scalar optimizer state is {type(state).__name__}, not an object")
    out = {}
    for k, enc in state.items():
        v = _decode(enc, where)
        x = _number(v)
        if x is not None and not math.isfinite(x):
            raise CorruptFileError(f"{where}: optimizer state {k!r} = {x!r} is not finite")
        out[k] = v
    return out


def check_json_object(value: Any, where: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptFileError(f"{where}: {what} is {type(value).__name__}, not an object")
    return value


def check_tracked_state(value: Any, where: str) -> dict[str, Any]:
    """The state of the objects ``opt.track`` registered, by name (FORMAT.md section 7): a JSON object whose values
    decode (tagged forms well-formed, nesting bounded). Returns it decoded."""
    check_json_object(value, where, "the tracked state")
    return {k: _decode(v, f"{where} tracked {k[:40]!r}") for k, v in value.items()}
