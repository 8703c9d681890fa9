"""Top-k sparsification per tensor with error feedback.

Selection is exact (the k largest |g|), but on large CPU tensors it first keeps only candidates above a
threshold estimated from a small sample, because ``torch.topk`` over tens of millions of elements dominates
a CPU iteration. If the estimate keeps fewer than k candidates the full ``torch.topk`` runs instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from lowdiff._compressors.base import Comm, Compressor, Payload, StepPayloads, check_residual
from lowdiff._compressors.step_buffers import StepBuffers
from lowdiff._storage.segment import KEEP
from lowdiff.errors import CorruptFileError, UnsupportedError

# Below this many elements torch.topk is already cheap.
_SAMPLED_MIN_NUMEL = 1 << 16
_SAMPLE_SIZE = 1 << 14


def k_for(numel: int, ratio: float) -> int:
    return max(1, min(numel, math.ceil(ratio * numel)))


class Workspace:
    """Scratch buffers reused from call to call (one per dtype, grown to the largest tensor seen): a fresh
    temporary as large as a parameter is a fresh mapping on the CPU whose pages fault in every step."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get((dtype, device))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(dtype, device)] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


def select_topk(flat: torch.Tensor, k: int, generator: torch.Generator | None = None,
                workspace: Workspace | None = None) -> torch.Tensor:
    """Flat int64 indices of the k largest |flat|, sorted ascending."""
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    cpu = flat.device.type == "cpu"
    mag = torch.abs(flat, out=workspace.take(n, flat.dtype, flat.device)) if workspace is not None and cpu \
        else flat.abs()
    # On a GPU torch.topk is fast, and the sampled path's candidate count would synchronize with the host.
    if cpu and n >= _SAMPLED_MIN_NUMEL and k * 8 < n:
        sample_idx = torch.randint(0, n, (_SAMPLE_SIZE,), device=flat.device, generator=generator)
        sample = mag.index_select(0, sample_idx)
        # Aim for ~2k candidates so one pass almost always has at least k: the sample's value of that rank.
        keep = min(_SAMPLE_SIZE, max(1, math.ceil(2.0 * k / n * _SAMPLE_SIZE)))
        threshold = torch.kthvalue(sample, _SAMPLE_SIZE - keep + 1).values
        mask = torch.ge(mag, threshold, out=workspace.take(n, torch.bool, flat.device)) \
            if workspace is not None else mag >= threshold
        candidates = nonzero_flat(mask)  # ascending
        if candidates.numel() >= k:
            top = torch.topk(mag.index_select(0, candidates), k, sorted=False).indices
            # still ascending, without a sort
            return torch.masked_select(candidates, _positions_mask(top, candidates.numel()))
    return torch.sort(torch.topk(mag, k, sorted=False).indices).values


def nonzero_flat(mask: torch.Tensor) -> torch.Tensor:
    """``torch.nonzero(mask).flatten()`` for a sparse 1-D bool mask, about twice as fast on the CPU: the mask is
    read 8 bytes at a time and only the words holding a True are looked into."""
    n = mask.numel()
    if mask.device.type != "cpu" or n < 64:
        return torch.nonzero(mask).flatten()
    pad = (-n) % 8
    aligned = mask.is_contiguous() and mask.storage_offset() % 8 == 0
    padded = mask if aligned and not pad else torch.cat([mask, mask.new_zeros(pad)])
    words = torch.nonzero(padded.view(torch.int64)).flatten()
    hits = torch.nonzero(padded.view(-1, 8)[words])
    return words[hits[:, 0]] * 8 + hits[:, 1]


def _positions_mask(positions: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.bool, device=positions.device).index_fill_(0, positions, True)


class TopKCompressor(Compressor):
    name = "topk"

    def __init__(self, *, ratio: float, error_feedback: bool = True) -> None:
        self.ratio = ratio
        self.error_feedback = error_feedback
        self._residual: dict[str, torch.Tensor] = {}
        self._generator: dict[str, torch.Generator] = {}
        self._workspace = Workspace()
        self._step = StepBuffers()

    def check_params(self, named: Mapping[str, torch.Tensor]) -> None:
        complex_params = [n for n, p in named.items() if p.dtype.is_complex]
        if complex_params:  # torch.topk has no complex kernel: it failed with torch's error at the first step
            raise UnsupportedError(f"compressor topk cannot select from complex parameters ({complex_params[0]!r}"
                                   f"{' and more' if len(complex_params) > 1 else ''}); use compressor powersgd or "
                                   "none for this model")

    def begin_step(self, targets: dict[torch.dtype, torch.Tensor] | None = None) -> None:
        self._step.begin(targets)

    def end_step(self) -> StepPayloads | None:
        return self._step.end()

    def compress(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> Payload:
        return self._compress(fqn, grad, comm)[0]

    def compress_decode(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> tuple[Payload, torch.Tensor]:
        payload, dense = self._compress(fqn, grad, comm)
        if dense is not None:  # aggregated across ranks: the merge made the dense average the payload decodes to
            return payload, dense.view(grad.shape)
        # Just made here, so not checked (the range checks would each synchronize a GPU); the same bits either way.
        return payload, decode(payload["values"], payload["indices"], grad.shape, check_range=False)

    def _compress(self, fqn: str, grad: torch.Tensor, comm: Comm | None) -> tuple[Payload, torch.Tensor | None]:
        flat = grad.reshape(-1)
        residual = self._residual.get(fqn) if self.error_feedback else None
        if residual is not None:
            check_residual(fqn, residual, flat)
        # grad + residual (the same bits as residual + grad) in the residual's own memory, which then becomes
        # the new residual in place: no temporary as large as the parameter.
        acc = residual.add_(flat) if residual is not None else flat.clone()
        gen = self._generator.get(fqn)
        if gen is None or gen.device != acc.device:
            gen = torch.Generator(device=acc.device)
            gen.manual_seed(0x10D1FF)
            self._generator[fqn] = gen
        idx = select_topk(acc, k_for(acc.numel(), self.ratio), gen, self._workspace)
        # index_select and index_fill_ rather than acc[idx]: the same bits without the Python indexing machinery
        # (3.3 -> 1.9 us and 3.8 -> 2.8 us a call here; a step makes one of each per parameter).
        single = comm is None or comm.world_size == 1
        if single and self._step.active:  # into the step's reused buffers (StepBuffers): the same bits
            k = idx.numel()
            values, indices = self._step.take(fqn, k, acc.dtype, acc.device), self._step.take(fqn, k, torch.int32,
                                                                                               acc.device)
            torch.index_select(acc, 0, idx, out=values)
            indices.copy_(idx)
        else:
            values, indices = acc.index_select(0, idx), idx.to(torch.int32)
        if self.error_feedback:
            acc.index_fill_(0, idx, 0)  # acc becomes what this step dropped
            if not single:
                # Under DDP this runs in backward, before a GradScaler sees an overflow and skips the step: inf or
                # NaN kept here would make every later step overflow too (training stalls, every step skipped).
                acc.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            self._residual[fqn] = acc
        if comm is None or single:
            return {"values": values, "indices": indices}, None
        return merge_gathered(comm.all_gather(values), comm.all_gather(indices), flat.numel(), comm.world_size)

    def payload_nbytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        return k_for(math.prod(shape), self.ratio) * (itemsize + 4)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {fqn: {"residual": r} for fqn, r in self._residual.items()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self._residual = {fqn: s["residual"].clone().reshape(-1) for fqn, s in state.items() if "residual" in s}


def merge_gathered(values: list[torch.Tensor], indices: list[torch.Tensor], numel: int,
                   world_size: int) -> tuple[Payload, torch.Tensor]:
    """Coalesce every rank's selection: the sum over ranks (added in rank order, so every rank gets the same bits)
    divided by the world size, as a dense tensor, and the payload that decodes to it.

    The payload holds every rank's indices, sorted (world_size x k entries), the dense values at each, and ``keep``
    (:data:`lowdiff._storage.segment.KEEP`, uint8): 1 at the first of equal indices, 0 at a repeat. How many indices
    the ranks share only the device knows: dropping the repeats here (``torch.unique``) would make the host wait for
    it, once per parameter per step, in backward. The segment writer drops them (``kept``), so the log holds the
    sorted union (FORMAT.md section 5); a repeat carries the same value as its first, so the entries kept do not
    depend on which is first."""
    dense = torch.zeros(numel, dtype=values[0].dtype, device=values[0].device)
    for v, i in zip(values, indices):
        dense.index_add_(0, i.long(), v)  # indices within one rank are unique: no atomics race on GPU
    dense.div_(world_size)
    idx = torch.sort(torch.cat(indices).long()).values
    keep = torch.ones(idx.numel(), dtype=torch.uint8, device=idx.device)
    if idx.numel() > 1:
        torch.ne(idx[1:], idx[:-1], out=keep[1:].view(torch.bool))
    return {"values": dense.index_select(0, idx), "indices": idx.to(torch.int32), KEEP: keep}, dense


def decode(values: torch.Tensor, indices: torch.Tensor, shape: torch.Size | tuple[int, ...],
           check_range: bool = True, *, out: torch.Tensor | None = None,
           previous: torch.Tensor | None = None) -> torch.Tensor:
    """Dense gradient from Top-k values and flat indices (shared by training and recovery).

    ``out``: a flat buffer of the tensor's size and the values' dtype to write into instead of a new one (the
    replayer reuses one per parameter across steps); ``previous``: the indices last written into ``out``, so
    only those are zeroed again (None: all of it). The result is the same tensor either way."""
    numel = math.prod(int(s) for s in shape)
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise CorruptFileError(f"top-k payload has {values.numel()} values but {indices.numel()} indices")
    if check_range and indices.numel():
        # Read from a file: integer, in range, and strictly increasing (sorted, unique: FORMAT.md section 5). A
        # repeated index would make the scatter below keep one of its values, which one being unspecified.
        if indices.dtype not in (torch.int32, torch.int64):
            raise CorruptFileError(f"top-k indices of dtype {indices.dtype}, not an integer type")
        lo, hi = torch.aminmax(indices)
        if int(lo) < 0 or int(hi) >= numel:
            raise CorruptFileError(f"top-k index out of range for a tensor of {numel} elements")
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise CorruptFileError("top-k indices are not strictly increasing (repeated or unsorted)")
    if out is None:
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    elif previous is None:
        out.zero_()
    else:
        out.index_fill_(0, previous, 0)
    # Indices are unique (one selection per tensor, or coalesced across ranks), so the scatter is exact.
    out.index_copy_(0, indices.long(), values)
    return out.view(shape)
