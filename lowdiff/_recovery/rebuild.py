"""Rebuilding an optimizer from a run directory and redoing one logged step on it: shared by recovery's replay
(lowdiff/_recovery/replayer.py, stepper.py) and the shadow replica (lowdiff/_persist/shadow.py), so both follow
training the same way."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lowdiff._recovery import optimizers
from lowdiff._storage.format import decode_value
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.named_state import to_indexed
from lowdiff._storage.snapshot import SnapshotState
from lowdiff.errors import CorruptFileError


def construct_like(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Another instance of ``opt``'s class over ``groups``, with exactly ``opt``'s defaults and group settings."""
    cls = type(opt)
    new = cls.__new__(cls)
    torch.optim.Optimizer.__init__(new, [{"params": g["params"]} for g in groups], dict(opt.defaults))
    for g_new, g in zip(new.param_groups, groups):
        g_new.clear()
        g_new.update(g)
    for k, v in vars(opt).items():  # class-specific attributes set by the constructor (e.g. flags)
        if k not in vars(new) and k not in ("state", "param_groups"):
            setattr(new, k, v)
    return new


def apply_step(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], groups: list[dict[str, Any]],
               grads: dict[str, torch.Tensor], device: str) -> None:
    """Redo one optimizer step: the logged hyperparameters of every group, the decoded gradients (None for
    parameters without one that step), then the optimizer's own ``step()``. Shared by recovery and the shadow
    replica, so both follow training the same way."""
    for g_opt, g_log in zip(opt.param_groups, groups):
        for k, v in decode_value(g_log, device).items():
            if k != "params":
                g_opt[k] = v
    for n, p in params.items():
        p.grad = grads.get(n)
    opt.step()


def build_optimizer(manifest: Manifest, snap: SnapshotState, params: dict[str, torch.nn.Parameter],
                     wanted: list[str], optimizer_class: type | None, device: str) -> torch.optim.Optimizer:
    cls = optimizers.resolve_optimizer_class(manifest.optimizer_class, optimizer_class)
    optimizers.check_snapshot_state(manifest, cls, snap)  # keys, shapes, dtypes: the class's own, or refused
    # Pass only the defaults the constructor takes (AdamW records `decoupled_weight_decay` but does not take
    # it); group hyperparameters are then set exactly by load_state_dict from the snapshot.
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in decode_value(manifest.optimizer_defaults, device).items() if k in accepted}
    group_specs = [[n for n in g if n in params] for g in manifest.param_groups]
    try:
        opt = cls([{"params": [params[n] for n in g]} for g in group_specs], **defaults)
    except (TypeError, ValueError) as e:
        raise CorruptFileError(f"cannot rebuild {manifest.optimizer_class} from the manifest's defaults: {e}") from e
    hyper = [decode_value(g, device) for g in snap.param_groups]
    opt.load_state_dict(to_indexed(snap.optimizer_state, group_specs, hyper))
    return opt


def unscale(grads: list[torch.Tensor], inv_scale: float) -> None:
    """Multiply ``grads`` in place by a logged ``grad_scale`` with the kernel GradScaler's ``unscale_`` uses, so
    every element is rounded as it was when training consumed it."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
