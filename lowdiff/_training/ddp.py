"""DDP: a communication hook that compresses, aggregates and hands lowdiff the aggregated payload (so
checkpointing adds no compression work and no communication). The coordination of sharded writes is
lowdiff._persist.coordinator.

The payload a hook produces is identical on every rank; each rank persists only the tensors it owns
(balanced by bytes), and the log is keyed by parameter name, so recovery works at any world size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from lowdiff._compressors import Compressor, Payload
from lowdiff.errors import LowDiffError

log = logging.getLogger(__name__)

class ProcessGroupComm:
    """The two collectives compressors use, over a torch.distributed process group."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return out


class HookState:
    """Shared by the communication hook (producer) and the optimizer wrapper (consumer) of payloads."""

    def __init__(self, compressor: Compressor, names: dict[int, str], comm: ProcessGroupComm) -> None:
        self.compressor = compressor
        self.names = names
        self.comm = comm
        self.payloads: dict[str, Payload] = {}

    def take(self) -> dict[str, Payload]:
        out, self.payloads = self.payloads, {}
        return out


def lowdiff_comm_hook(state, bucket):
    # No annotations: DDP compares them against dist.GradBucket and rejects the string form that
    # `from __future__ import annotations` produces.
    """Compress each gradient in the bucket, aggregate across ranks, write decode(payload) back into the
    bucket (DDP copies it into ``.grad``) and keep the payload for the optimizer step to log."""
    buffer = bucket.buffer()
    offset = 0
    for p in bucket.parameters():
        n = p.numel()
        grad = buffer[offset : offset + n].view(p.shape)
        offset += n
        name = state.names.get(id(p))
        if name is None:
            raise LowDiffError("DDP bucket holds a parameter lowdiff does not know; wrap the same model")
        payload, decoded = state.compressor.compress_decode(name, grad, state.comm)
        grad.copy_(decoded)
        state.payloads[name] = payload
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def unscaled_by(optimizer: Any, scalers: list[Any]) -> torch.Tensor | None:
    """The factor a GradScaler multiplied this step's gradients by before ``optimizer`` consumed them (its
    ``1 / scale``), None when none unscaled them. Under DDP the hook compresses the gradients during backward,
    before the scaler unscales them, so the log holds the scaled ones and replay needs the factor
    (StepRecord.grad_scale). ``scalers``: the tracked ones, and the one whose ``step()`` called ``optimizer.step()``.
    The factor is computed as ``GradScaler.unscale_`` computes it, as a 0-d host tensor: on a GPU its copy is queued
    without waiting (into pinned memory, on the training stream), and the record's copies, queued after it, complete
    after it; the writer reads it once they have (a ``float()`` here would wait for the device every step)."""
    from torch.amp.grad_scaler import OptState

    for scaler in scalers:
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
        if state is not None and state.get("stage") is OptState.UNSCALED:
            factor = scaler._scale.double().reciprocal().float()
            if factor.device.type != "cuda":
                return factor.cpu()
            host = torch.empty((), dtype=factor.dtype, pin_memory=True)
            host.copy_(factor, non_blocking=True)
            return host
    return None


def calling_scaler(frame: Any) -> Any:
    """The GradScaler whose ``step()`` made this call (``frame``: the caller of ``opt.step()``), or None."""
    if frame is not None and frame.f_code.co_name == "_maybe_opt_step":
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "GradScaler":
            return owner
    return None
