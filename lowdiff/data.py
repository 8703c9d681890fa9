"""Resumable data order: samplers whose position (epoch, seed, offset) is logged with every step and restored by
``opt.resume()``, so a resumed run sees exactly the batches the uninterrupted run would have seen, each sample
once per epoch, without re-reading the samples it skips.

>>> sampler = lowdiff.data.ResumableSampler(len(dataset), seed=0)                          # doctest: +SKIP
>>> loader = lowdiff.data.ResumableLoader(DataLoader(dataset, batch_size=32, sampler=sampler,
...                                                  num_workers=4))                        # doctest: +SKIP
>>> opt.track(loader)                  # before opt.resume()                                # doctest: +SKIP
>>> start = opt.resume()               # also puts the loader back where step `start` left it # doctest: +SKIP
>>> for epoch in range(loader.epoch, num_epochs):                                           # doctest: +SKIP
...     for x, y in loader: ...        # the first epoch after a resume starts mid-way

Why the loader wrapper: a DataLoader with workers (or pinned memory) draws indices from the sampler ahead of
the training loop (``prefetch_factor`` x ``num_workers`` batches), so the sampler's own count runs ahead of
what the optimizer has consumed. :class:`ResumableLoader` counts the batches handed to the loop instead:
position = start + batches consumed x batch_size. It also makes ``iter(loader)`` leave torch's global RNG
alone (the DataLoader otherwise draws its workers' base seed from it on every ``iter()``, so a resume,
which starts an iterator mid-epoch, would shift every later dropout mask). A bare sampler's state counts the
indices it has yielded: exact with ``num_workers=0`` and a DataLoader built with ``generator=``, or a manual
loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

log = logging.getLogger(__name__)
T = TypeVar("T")


def _check_position(state: Mapping[str, Any], where: str) -> tuple[int, int, int]:
    if not isinstance(state, Mapping) or set(state) != {"epoch", "seed", "offset"}:
        raise ValueError(f"{where}: a data position must be {{'epoch', 'seed', 'offset'}}, got {state!r}")
    vals = [state["epoch"], state["seed"], state["offset"]]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals) or vals[0] < 0 or vals[2] < 0:
        raise ValueError(f"{where}: epoch and offset must be integers >= 0 and seed an integer, got {state!r}")
    return vals[0], vals[1], vals[2]


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The index order of one epoch: ``torch.randperm`` seeded with seed + epoch (as DistributedSampler)."""
    if not shuffle:
        return list(range(length))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(length, generator=g).tolist()


class _PositionedSampler(Sampler[int]):
    """Shared position bookkeeping: ``offset`` counts the epoch's samples already consumed (across all
    replicas for the distributed sampler) and the epoch advances when an iteration runs to its end."""

    seed: int
    epoch: int
    offset: int
    shuffle: bool
    replicas_per_step: int = 1
    """Global samples one local index stands for (num_replicas for the distributed sampler)."""

    def _local(self) -> list[int]:
        raise NotImplementedError

    @property
    def epoch_samples(self) -> int:
        """Global samples in a full epoch (the largest offset)."""
        raise NotImplementedError

    def remaining(self) -> int:
        """Indices this sampler will yield (on this rank) before its epoch ends."""
        return len(self._local())

    def offset_after(self, start: int, consumed: int) -> int:
        """The offset after ``consumed`` of the indices an iteration starting at ``start`` yields."""
        return min(start + consumed * self.replicas_per_step, max(self.epoch_samples, start))

    def _roll_over(self) -> None:
        """A fully consumed epoch is the start of the next one (a consumer that stops after ``len()`` items never
        resumes the iterator past its last item, so the end-of-epoch code below would not run)."""
        if 0 < self.epoch_samples <= self.offset:
            self.epoch, self.offset = self.epoch + 1, 0

    def __iter__(self) -> Iterator[int]:
        self._roll_over()
        epoch, start = self.epoch, self.offset
        for i, index in enumerate(self._local()):
            # Counted before the index is handed out: after fetching batch b, offset = b x batch_size.
            self.offset = self.offset_after(start, i + 1)
            yield index
        if self.epoch == epoch:
            self.epoch, self.offset = epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its position (so a training loop's
        ``set_epoch(e)`` after a resume into epoch e does not rewind it)."""
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "seed": self.seed, "offset": self.offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch, seed, offset = _check_position(state, type(self).__name__)
        self.epoch, self.seed, self.offset = epoch, seed, offset
        # A position at the end of an epoch (taken before the loop asked past its last index) is the next
        # epoch's start: ``epoch`` then names the epoch to run, as a loop over range(sampler.epoch, E) expects.
        self._roll_over()


class ResumableSampler(_PositionedSampler):
    """Indices ``0..data_source_len-1`` in a per-epoch permutation (``torch.randperm`` seeded with seed + epoch),
    starting at ``offset``. ``state_dict()`` is ``{"epoch", "seed", "offset"}``; an exhausted epoch moves on
    to the next one by itself, so ``set_epoch`` is optional."""

    def __init__(self, data_source_len: int, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(data_source_len, int) or data_source_len < 0:
            raise ValueError(f"data_source_len must be an integer >= 0, got {data_source_len!r}")
        self.length = data_source_len
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0

    @property
    def epoch_samples(self) -> int:
        return self.length

    def _local(self) -> list[int]:
        return epoch_order(self.length, self.seed, self.epoch, self.shuffle)[self.offset :]

    def __len__(self) -> int:
        return self.length


class DistributedResumableSampler(_PositionedSampler):
    """``torch.utils.data.DistributedSampler`` with a resumable position: the same indices for the same
    (num_replicas, rank, seed, shuffle, drop_last, epoch), plus ``state_dict()`` / ``load_state_dict()``.

    ``offset`` counts samples consumed by ALL ranks (local count x num_replicas), so every rank logs the same
    position. Resumed at another world size, the rest of the epoch (the padded permutation from ``offset``
    on) is dealt out to the new ranks: every sample not yet seen is still seen in that epoch, though not in
    the order the old world size would have used.
    """

    def __init__(self, data_source_len: int, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            dist = torch.distributed
            initialized = dist.is_available() and dist.is_initialized()
            num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if initialized else 1)
            rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} for num_replicas {num_replicas}")
        if not isinstance(data_source_len, int) or data_source_len < 0:
            raise ValueError(f"data_source_len must be an integer >= 0, got {data_source_len!r}")
        self.length = data_source_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.replicas_per_step = num_replicas
        self.epoch = 0
        self.offset = 0
        # The same arithmetic as torch.utils.data.DistributedSampler.
        if drop_last and data_source_len % num_replicas != 0:
            self.num_samples = math.ceil((data_source_len - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(data_source_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    @property
    def epoch_samples(self) -> int:
        return self.total_size

    def _global(self) -> list[int]:
        indices = epoch_order(self.length, self.seed, self.epoch, self.shuffle)
        if self.drop_last:
            return indices[: self.total_size]
        return _pad(indices, self.total_size)

    def _local(self) -> list[int]:
        rest = self._global()[self.offset :]
        if len(rest) % self.num_replicas:
            # Only after a world-size change: deal the remainder out evenly, as DistributedSampler would.
            whole = len(rest) // self.num_replicas * self.num_replicas
            rest = rest[:whole] if self.drop_last else _pad(rest, whole + self.num_replicas)
        return rest[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return self.num_samples


def _pad(indices: list[int], size: int) -> list[int]:
    padding = size - len(indices)
    if padding <= 0 or not indices:
        return indices
    if padding <= len(indices):
        return indices + indices[:padding]
    return indices + (indices * math.ceil(padding / len(indices)))[:padding]


class ResumableLoader(Generic[T]):
    """Wraps a ``DataLoader`` built with ``sampler=`` a resumable sampler and a fixed ``batch_size``, and
    counts the batches the training loop has CONSUMED (workers prefetch ahead; that does not count).

    Iterating it iterates the DataLoader from the consumed position; when an iteration runs to its end the
    epoch advances. ``state_dict()`` is the sampler's ``{"epoch", "seed", "offset"}`` at the consumed
    position. If the DataLoader has no ``generator``, the loader gives it one, seeded from (seed, epoch) before
    every ``iter()``, so creating an iterator never draws from torch's global RNG and worker base seeds are
    the same in a resumed run. (Randomness drawn inside workers, e.g. augmentation, is only reproduced if
    it is seeded per sample, since a resumed epoch deals batches to workers from a different start.)
    """

    def __init__(self, loader: DataLoader[T]) -> None:
        sampler = loader.sampler
        if not isinstance(sampler, _PositionedSampler):
            raise TypeError("ResumableLoader needs DataLoader(..., sampler=lowdiff.data.ResumableSampler(...)) or "
                            f"DistributedResumableSampler; got sampler {type(sampler).__name__}")
        if loader.batch_size is None or isinstance(loader.dataset, IterableDataset):
            raise TypeError("ResumableLoader needs a map-style dataset and DataLoader(batch_size=N): the position "
                            "is batches consumed x batch_size")
        self.loader = loader
        self.sampler: _PositionedSampler = sampler
        self.batch_size: int = loader.batch_size
        self._epoch, self._offset = sampler.epoch, sampler.offset
        self._generator: torch.Generator | None = None
        if loader.generator is None:
            self._generator = torch.Generator()
            loader.generator = self._generator

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (after a completed epoch: the next one)."""
        return self._epoch + 1 if 0 < self.sampler.epoch_samples <= self._offset else self._epoch

    @property
    def offset(self) -> int:
        """Samples of the current epoch consumed by the training loop (all ranks together)."""
        return self._offset

    def set_epoch(self, epoch: int) -> None:
        """As the samplers' ``set_epoch``: only a different epoch rewinds to its start."""
        if epoch != self._epoch:
            self._epoch, self._offset = epoch, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[T]:
        s = self.sampler
        s.epoch, s.offset = self._epoch, self._offset
        s._roll_over()  # an epoch consumed to its last batch but not to StopIteration (Lightning stops at len())
        self._epoch, self._offset = s.epoch, s.offset
        start, epoch = self._offset, self._epoch
        remaining = s.remaining()
        # With drop_last the epoch's last batch leaves the partial one unread: it ends the epoch all the same.
        last = remaining // self.batch_size if self.loader.drop_last else -1
        if self._generator is not None:
            self._generator.manual_seed((s.seed * 1_000_003 + epoch) % (1 << 63))
        consumed = 0
        if remaining:
            for batch in self.loader:
                consumed += 1
                if consumed == last:
                    self._offset = max(s.epoch_samples, start)
                else:
                    self._offset = s.offset_after(start, min(consumed * self.batch_size, remaining))
                yield batch
        if self._epoch == epoch:
            self._epoch, self._offset = epoch + 1, 0
        s.epoch, s.offset = self._epoch, self._offset

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "seed": self.sampler.seed, "offset": self._offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._epoch, self._offset = self.sampler.epoch, self.sampler.offset
