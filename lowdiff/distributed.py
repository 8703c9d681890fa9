"""torch.distributed support: a DDP communication hook that compresses, aggregates and hands lowdiff the
aggregated payload (so checkpointing adds no compression work and no communication), plus the small
amount of coordination sharded writes need.

The payload a hook produces is identical on every rank; each rank persists only the tensors it owns
(balanced by bytes), and the log is keyed by parameter name, so recovery works at any world size.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from lowdiff.compressors import Compressor, Payload
from lowdiff.errors import LowDiffError

log = logging.getLogger(__name__)

BARRIER_TIMEOUT_S = 300.0


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


class Coordinator:
    """Rank identity and barriers for sharded writes; a no-op in a single process."""

    def __init__(self, ddp: bool) -> None:
        self.active = ddp and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self._group: Any = None
        if self.active and self.world_size > 1:
            # A separate gloo group: barriers work whatever the training backend (NCCL included), and
            # monitored_barrier names the rank that did not arrive.
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=BARRIER_TIMEOUT_S))

    def barrier(self, what: str) -> None:
        if self._group is None:
            return
        try:
            dist.monitored_barrier(group=self._group, timeout=datetime.timedelta(seconds=BARRIER_TIMEOUT_S),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            raise LowDiffError(f"rank {self.rank}: barrier '{what}' failed ({e}); a rank is gone or stuck. "
                               "Restart the job and resume with opt.resume()") from e

    def broadcast_ints(self, values: list[int], what: str) -> list[int]:
        """Rank 0's ``values`` on every rank (a few int64 over the gloo group; in one process: ``values``)."""
        if self._group is None:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        try:
            dist.broadcast(t, src=0, group=self._group)
        except RuntimeError as e:
            raise LowDiffError(f"rank {self.rank}: broadcast '{what}' failed ({e}); a rank is gone or stuck. "
                               "Restart the job and resume with opt.resume()") from e
        return [int(v) for v in t.tolist()]


def owned_names(spec: Any, coord: Coordinator, size_of: Any, sharded: Any = None) -> set[str]:
    """Parameter names this rank persists, a share balanced by ``size_of`` (snapshots: tensor bytes; log: the
    compressor's payload bytes, which are not proportional to them); rank 0 also keeps the parameters no optimizer
    group holds (buffers are rank 0's too). Under fully_shard (``sharded``) each rank persists its own shard of
    every parameter: every name of its spec."""
    from lowdiff.storage.sharding import partition_by_size

    all_names = set(spec.params)
    if coord.world_size == 1 or sharded is not None:
        return all_names
    sizes = {n: size_of(p) for n, p in spec.optimized}
    owned = set(partition_by_size(sizes, coord.world_size)[coord.rank])
    if coord.rank == 0:
        owned |= all_names - set(sizes)
    return owned
