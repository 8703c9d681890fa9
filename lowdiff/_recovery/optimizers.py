"""The optimizer a run directory names, checked before it is built or stepped (docs/reference/FORMAT.md §8).

Only torch.optim's own optimizer classes are resolved from a manifest, by looking them up, never by importing a
module a file names; any other class must be passed in by the caller. The manifest's defaults must be ones that
class has, and a snapshot's optimizer state must have exactly the keys, shapes, dtypes and finite counters that
class keeps for the group's hyperparameters: a probe instance of the class is stepped once on a tiny parameter to
learn them, so the rules follow the installed torch instead of a table.
"""

from __future__ import annotations

import inspect
import math
from functools import lru_cache
from typing import Any

import torch

from lowdiff._storage.format import DTYPES, MANIFEST, decode_value
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.snapshot import SnapshotState
from lowdiff.errors import CorruptFileError, UnsupportedError

# Flags that change how, not what, an optimizer computes (and need devices or autograd a probe does not have).
# Optimizers whose update of a tensor reads only that tensor's gradient and state, plus group scalars.
ELEMENTWISE_OPTIMIZERS = frozenset(
    f"torch.optim.{m}.{c}" for m, c in [
        ("sgd", "SGD"), ("adam", "Adam"), ("adamw", "AdamW"), ("adagrad", "Adagrad"), ("rmsprop", "RMSprop"),
        ("adamax", "Adamax"), ("nadam", "NAdam"), ("radam", "RAdam"), ("adadelta", "Adadelta"),
    ]
)

_FLAGS_OFF = {"foreach": False, "fused": None, "capturable": False, "differentiable": False}


@lru_cache(maxsize=1)
def allowed_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """torch.optim's optimizer classes by the name a manifest records (``module.qualname``). LBFGS (closures) and
    SparseAdam (sparse gradients) are left out: lowdiff refuses to train with them."""
    out = {}
    for c in vars(torch.optim).values():
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer \
                and c.__name__ not in ("LBFGS", "SparseAdam"):
            out[f"{c.__module__}.{c.__qualname__}"] = c
    return out


def resolve_optimizer_class(path: str, allowed: type | None = None, where: str = MANIFEST
                            ) -> type[torch.optim.Optimizer]:
    """The optimizer class named in a manifest: one of torch.optim's, or ``allowed`` (the class itself, passed by
    the caller) when the run used another one."""
    if allowed is not None:
        # A class defined in the training script is recorded as __main__.NAME, which no other program can import
        # under that name: the caller's class of that name stands for it.
        if f"{allowed.__module__}.{allowed.__qualname__}" != path and path != f"__main__.{allowed.__qualname__}":
            raise UnsupportedError(f"{where}: the run used optimizer {path}, not "
                                   f"{allowed.__module__}.{allowed.__qualname__}")
        return allowed
    cls = allowed_optimizers().get(path)
    if cls is None:
        raise UnsupportedError(f"{where}: the run used optimizer {path[:200]}, which is not one of torch.optim's "
                               "optimizers; lowdiff imports nothing else named in a run directory. Pass "
                               "optimizer_class=<the class> to recover() (or verify(), compact()) to allow it, or "
                               "--optimizer-class MODULE:CLASS to lowdiff-recover and lowdiff verify / compact")
    return cls


def _accepted_defaults(cls: type, manifest: Manifest) -> dict[str, Any]:
    accepted = inspect.signature(cls).parameters
    return {k: v for k, v in manifest.defaults_decoded.items() if k in accepted}


def _probe_param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(2, 3))


def check_manifest_optimizer(manifest: Manifest, cls: type, where: Any) -> None:
    """The manifest's optimizer defaults must be ones ``cls`` has, and values its constructor accepts (a manifest
    whose class was edited, or whose defaults belong to another optimizer, is refused here)."""
    try:
        probe = cls([_probe_param()], **{**_accepted_defaults(cls, manifest),
                                         **{k: v for k, v in _FLAGS_OFF.items()
                                            if k in inspect.signature(cls).parameters}})
    except (TypeError, ValueError, RuntimeError) as e:
        raise CorruptFileError(f"{where}: {manifest.optimizer_class} rejects the manifest's defaults ({e})",
                               path=where) from e
    unknown = sorted(set(manifest.optimizer_defaults) - set(probe.defaults))
    if unknown:
        raise CorruptFileError(f"{where}: the manifest's optimizer defaults {unknown[:5]} are not "
                               f"{manifest.optimizer_class}'s; its optimizer class or defaults were edited",
                               path=where)


def _expected_state(cls: type, manifest: Manifest, group: dict[str, Any]) -> dict[str, str]:
    """Key -> "param" (shaped like the parameter), "scalar" (one element) or "other", as ``cls`` keeps them after a
    step with ``group``'s hyperparameters. Raises ValueError/TypeError if the class rejects them."""
    hyper = {k: v for k, v in decode_value(group).items() if k != "params"}
    hyper.update({k: v for k, v in _FLAGS_OFF.items() if k in hyper})
    p = _probe_param()
    opt = cls([{"params": [p], **hyper}], **_accepted_defaults(cls, manifest))
    p.grad = torch.ones_like(p)
    opt.step()
    out = {}
    for k, v in opt.state[p].items():
        if isinstance(v, torch.Tensor) and v.shape == p.shape:
            out[k] = "param"
        elif (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, (int, float)):
            out[k] = "scalar"
        else:
            out[k] = "other"
    return out


def check_snapshot_state(manifest: Manifest, cls: type, snap: SnapshotState) -> None:
    """A snapshot's optimizer state and group hyperparameters, checked against the optimizer class itself.

    torch.optim's element-wise optimizers only (the replayer's list): their state keys do not depend on the
    parameter's shape, and their constructors accept any hyperparameters a run can log. A snapshot captured from a
    live model (``snap.source`` None) is trusted."""

    if snap.source is None or f"{cls.__module__}.{cls.__qualname__}" not in ELEMENTWISE_OPTIMIZERS \
            or allowed_optimizers().get(manifest.optimizer_class) is not cls:
        return
    path = snap.source.paths[0]
    where = f"{snap.source} (step {snap.step})"
    for gi, (names, group) in enumerate(zip(manifest.param_groups, snap.param_groups)):
        try:
            expected = _expected_state(cls, manifest, group)
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as e:
            raise CorruptFileError(f"{where}: group {gi}'s hyperparameters are rejected by "
                                   f"{manifest.optimizer_class} ({e})", path=path, step=snap.step) from e
        for name in names:
            st = snap.optimizer_state.get(name)
            if st:
                _check_param_state(name, st, expected, manifest, where, path, snap.step)


def _check_param_state(name: str, st: dict[str, Any], expected: dict[str, str], manifest: Manifest, where: str,
                       path: Any, step: int) -> None:
    def fail(what: str) -> CorruptFileError:
        return CorruptFileError(f"{where}: optimizer state of {name!r} {what}", path=path, step=step)

    if set(st) != set(expected):
        raise fail(f"has keys {sorted(st)[:8]}, {manifest.optimizer_class} keeps {sorted(expected)} (a snapshot of "
                   "another optimizer?)")
    spec = manifest.param(name)
    for key, kind in expected.items():
        v = st[key]
        if kind == "param":
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != spec.shape or v.dtype != DTYPES[spec.dtype]:
                got = f"{v.dtype}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise fail(f"{key!r} is {got}, expected {spec.dtype}{list(spec.shape)}")
        elif kind == "scalar":
            x = v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise fail(f"{key!r} = {str(x)[:40]} is not a finite number")
