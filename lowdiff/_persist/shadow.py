"""Shadow snapshots (``snapshot.shadow: true``): a CPU replica that applies every logged step with the same
optimizer class, in the background writer, so full snapshots are written from it and the training thread
never copies its state for them (Checkmate's shadow, without a second cluster). With ``log.when_behind: replica``
the persistence process applies every step to it as the step arrives, logged or not, and writes snapshots of it
when the disk has room (lowdiff._persist.child).

Bit-exact when training runs on the CPU: the replica executes exactly what replay executes, and replay is
exact. Training on a GPU would make the CPU replica drift in the last bits, so lowdiff refuses the shadow
there (the snapshot-then-persist path already keeps the GPU's own copy exact). Error-feedback residuals
are not in the log, so the shadow requires ``compressor.name: none``.
"""

from __future__ import annotations

from typing import Any

import torch

from lowdiff._compressors import decode_payload
from lowdiff._recovery.rebuild import apply_step, build_optimizer
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.named_state import to_named
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState


class ShadowReplica:
    """Model parameters, buffers and optimizer state on the CPU, advanced one logged step at a time."""

    def __init__(self, manifest: Manifest, initial: SnapshotState, optimizer_class: type) -> None:
        self.manifest = manifest
        self.step = initial.step
        names = manifest.optimized_params
        self._names = names
        self.params = {n: torch.nn.Parameter(initial.params[n].clone(),
                                             requires_grad=manifest.param(n).requires_grad) for n in names}
        self.others = {n: t.clone() for n, t in initial.params.items() if n not in self.params}
        self.buffers = {n: t.clone() for n, t in initial.buffers.items()}
        self.optimizer = build_optimizer(manifest, initial, self.params, names, optimizer_class, "cpu")
        self.groups: list[dict[str, Any]] = [dict(g) for g in initial.param_groups]
        self.rng: dict[str, Any] = dict(getattr(initial, "rng", {}) or {})
        self.extra: dict[str, Any] = dict(initial.extra)

    def apply(self, record: StepRecord) -> None:
        if record.step != self.step + 1:
            raise RuntimeError(f"shadow replica is at step {self.step}, got the record of step {record.step}")
        if not record.skipped:  # an iteration the GradScaler skipped: no optimizer step
            grads = {n: decode_payload(pl, self.params[n].shape) for n, pl in record.grads.items()}
            apply_step(self.optimizer, self.params, record.groups, grads, "cpu")
            for p in self.params.values():
                p.grad = None
        # Copies: a record's tensors are views of a host slot (or a ring slot of the persistence process) that is
        # reused for a later step once the record is written.
        self.buffers.update({n: t.clone() for n, t in record.buffers.items()})
        self.groups = [dict(g) | {"params": names} for g, names in zip(record.groups, self.manifest.param_groups)]
        rng = getattr(record, "rng", None)
        if rng:
            self.rng = dict(rng)
        data = getattr(record, "data", None)
        if data:
            self.extra["data"] = data
        self.extra["end_groups"] = record.end_groups
        self.step = record.step

    def snapshot(self) -> SnapshotState:
        """The replica's state now. Tensors are its live ones: write them before the next ``apply``."""
        state = self.optimizer.state_dict()["state"]
        snap = SnapshotState(
            step=self.step,
            params={**{n: p.detach() for n, p in self.params.items()}, **self.others},
            buffers=dict(self.buffers),
            optimizer_state=to_named(state, self._names),
            param_groups=self.groups,
            compressor_name="none",
            extra=dict(self.extra) | {"shadow": True},
        )
        if self.rng and hasattr(snap, "rng"):
            snap.rng = dict(self.rng)
        return snap


def make_shadow(spec: Any, state: SnapshotState, optimizer_class: type, *, world_size: int) -> ShadowReplica:
    """The replica behind ``snapshot.shadow: true``, refused where it cannot be exact."""
    from lowdiff.errors import UnsupportedError

    if world_size > 1:
        raise UnsupportedError("snapshot.shadow is not supported with DDP yet; use the default snapshots")
    if any(p.device.type != "cpu" for p in spec.params.values()):
        raise UnsupportedError("snapshot.shadow is bit-exact only when training on the CPU (a CPU replica of "
                               "GPU training drifts in the last bits); turn it off on GPUs")
    return ShadowReplica(spec.manifest, state, optimizer_class)
