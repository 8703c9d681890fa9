"""The coordination sharded writes need under torch.distributed (DDP, FSDP2): rank identity, barriers, a few
integers broadcast from rank 0, and which rank persists which tensors. A no-op in a single process."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from lowdiff._storage.sharding import partition_by_size
from lowdiff.errors import LowDiffError

BARRIER_TIMEOUT_S = 300.0


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
    all_names = set(spec.params)
    if coord.world_size == 1 or sharded is not None:
        return all_names
    sizes = {n: size_of(p) for n, p in spec.optimized}
    owned = set(partition_by_size(sizes, coord.world_size)[coord.rank])
    if coord.rank == 0:
        owned |= all_names - set(sizes)
    return owned
