"""PowerSGD (Vogels et al. 2019): rank-r factors with a warm-started Q and error feedback.

Matrices are viewed as (shape[0], numel / shape[0]). 1-D tensors, and matrices where the factors would not
be smaller than the matrix, are sent uncompressed as in PyTorch's reference hook.
"""

from __future__ import annotations

import zlib

import torch

from lowdiff._compressors.base import Comm, Compressor, Payload, StepPayloads, check_residual
from lowdiff._compressors.step_buffers import StepBuffers
from lowdiff.errors import CorruptFileError


def factor_shapes(shape: torch.Size | tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
    """(n, m, r) of the factors for a parameter shape, or None when it is sent uncompressed."""
    if len(shape) < 2:
        return None
    n = int(shape[0])
    m = 1
    for s in shape[1:]:
        m *= int(s)
    r = min(rank, n, m)
    if (n + m) * r >= n * m:
        return None
    return n, m, r


def orthogonalize(matrix: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt over the columns, in place (as PyTorch's powerSGD_hook)."""
    cols = matrix.shape[1]
    for i in range(cols):
        col = matrix[:, i : i + 1]
        col /= torch.linalg.vector_norm(col) + eps
        if i + 1 < cols:
            rest = matrix[:, i + 1 :]
            rest -= torch.sum(col * rest, dim=0) * col


class PowerSGDCompressor(Compressor):
    name = "powersgd"

    def __init__(self, *, rank: int, error_feedback: bool = True, block_elems: int | None = None) -> None:
        self.rank = rank
        self.error_feedback = error_feedback
        self.block_elems = CPU_BLOCK_ELEMS if block_elems is None else block_elems
        """Elements per block of rows decoded at once on the CPU (the bits do not depend on it)."""
        self._residual: dict[str, torch.Tensor] = {}
        self._q: dict[str, torch.Tensor] = {}
        self._q0: dict[str, torch.Tensor] = {}
        self._step = StepBuffers()

    def begin_step(self, targets: dict[torch.dtype, torch.Tensor] | None = None) -> None:
        self._step.begin(targets)

    def end_step(self) -> StepPayloads | None:
        return self._step.end()

    def initial_q(self, fqn: str, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        # Seeded by the parameter name so every rank (and a resumed run) starts from the same Q.
        gen = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
        q = torch.randn(m, r, generator=gen)
        if like.device.type == "cuda":  # a pageable host-to-device copy would make the host wait for it
            return q.pin_memory().to(device=like.device, dtype=like.dtype, non_blocking=True)
        return q.to(device=like.device, dtype=like.dtype)

    def _first_q(self, fqn: str, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        """:meth:`initial_q`, made once per parameter and device (a host-to-device copy, not one per step)."""
        q0 = self._q0.get(fqn)
        if q0 is None or q0.shape != (m, r) or q0.device != like.device or q0.dtype != like.dtype:
            q0 = self._q0[fqn] = self.initial_q(fqn, m, r, like)
        return q0

    def compress(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> Payload:
        return self._compress(fqn, grad, comm, want_decoded=False)[0]

    def compress_decode(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> tuple[Payload, torch.Tensor]:
        payload, decoded = self._compress(fqn, grad, comm, want_decoded=True)
        assert decoded is not None
        return payload, decoded

    def _compress(self, fqn: str, grad: torch.Tensor, comm: Comm | None,
                  want_decoded: bool) -> tuple[Payload, torch.Tensor | None]:
        world = 1 if comm is None else comm.world_size
        dims = factor_shapes(grad.shape, self.rank)
        # Single-process inside begin_step/end_step: P, Q and the tensors sent whole go into the step's reused flat
        # buffers (StepBuffers), P then Q per parameter; the same bits as fresh tensors.
        step = self._step if self._step.active and world == 1 else None
        if dims is None:
            if step is not None:
                # The payload is a copy in the step's buffers; the gradient itself stays what the optimizer consumes
                # (a .grad aliasing the buffers would be overwritten by another parameter's payload next step).
                full = step.take(fqn, grad.numel(), grad.dtype, grad.device).view(grad.shape)
                full.copy_(grad)
                return {"full": full}, grad
            full = grad.detach().clone()
            if comm is not None and world > 1:
                comm.allreduce_sum_(full)
                full.div_(world)
            return {"full": full}, full
        n, m, r = dims
        g = grad.reshape(n, m)
        residual = self._residual.get(fqn) if self.error_feedback else None
        if residual is not None:
            check_residual(fqn, residual, g)
            # grad + residual (the same bits as residual + grad), in the residual's own memory: after the factors
            # are taken, the new residual (matrix - decoded) overwrites it in place, block by block.
            matrix = residual.add_(g)
        else:
            matrix = g
        q = self._q.get(fqn)
        if q is None or q.shape != (m, r):
            q = self._first_q(fqn, m, r, matrix)
        if step is not None:
            p = torch.matmul(matrix, q, out=step.take(fqn, n * r, matrix.dtype, matrix.device).view(n, r))
        else:
            p = matrix @ q
        if comm is not None and world > 1:
            comm.allreduce_sum_(p)
        orthogonalize(p)
        if step is not None:
            q = torch.matmul(matrix.T, p, out=step.take(fqn, m * r, matrix.dtype, matrix.device).view(m, r))
        else:
            q = matrix.T @ p
        if comm is not None and world > 1:
            # As in PyTorch's hook: the averaged approximation is P (sum of M_i Q)^T / N; dividing Q keeps
            # decode() a plain product.
            comm.allreduce_sum_(q)
            q.div_(world)
        if world > 1:
            # Under DDP this runs in backward, before a GradScaler sees an overflow and skips the step: a Q or a
            # residual left inf or NaN would make every later step overflow too. Without a synchronization: the
            # starting Q comes back where Q is not finite, and the residual's non-finite elements are dropped.
            self._q[fqn] = torch.where(torch.isfinite(q).all(), q, self._first_q(fqn, m, r, matrix))
        else:
            self._q[fqn] = q.clone()
        if not (self.error_feedback or want_decoded):
            return {"p": p, "q": q}, None
        # decode() with the parameter's own shape gives these bits too (the same block-wise products and sums).
        decoded = torch.empty((n, m), dtype=torch.promote_types(p.dtype, q.dtype), device=p.device)
        if self.error_feedback:
            if residual is None:
                residual = torch.empty_like(matrix)
            self._residual[fqn] = residual
            _decode_into(p, q, decoded, minus=(matrix, residual), block_elems=self.block_elems)
            if world > 1:
                residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        else:
            _decode_into(p, q, decoded, block_elems=self.block_elems)
        return {"p": p, "q": q}, decoded.reshape(grad.shape)

    def payload_nbytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        dims = factor_shapes(shape, self.rank)
        if dims is None:
            return super().payload_nbytes(shape, itemsize)
        n, m, r = dims
        return (n + m) * r * itemsize

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for fqn, q in self._q.items():
            out.setdefault(fqn, {})["q"] = q
        for fqn, res in self._residual.items():
            out.setdefault(fqn, {})["residual"] = res
        return out

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self._q = {fqn: s["q"].clone() for fqn, s in state.items() if "q" in s}
        self._residual = {fqn: s["residual"].clone() for fqn, s in state.items() if "residual" in s}


# Rows of a CPU decode computed at a time: one block's r products and r - 1 sums then stay in cache, where a whole
# matrix (6.5 MB for 2560 x 640) makes each of them a pass over memory.
CPU_BLOCK_ELEMS = 1 << 16


def decode(p: torch.Tensor, q: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """p @ q.T reshaped to ``shape`` (shared by training and recovery).

    Computed as a sum of rank-1 outer products with separate multiply and add, in a fixed order: every
    element is then rounded identically whatever the BLAS library or thread count, so replay in a worker
    process with one thread reproduces training bit for bit (a BLAS matmul does not promise that).
    """
    if p.dim() != 2 or q.dim() != 2 or p.shape[1] != q.shape[1] or p.shape[1] < 1:
        raise CorruptFileError(f"PowerSGD factors have incompatible shapes {tuple(p.shape)} and {tuple(q.shape)}")
    numel = 1
    for s in shape:
        numel *= int(s)
    if p.shape[0] * q.shape[0] != numel:
        raise CorruptFileError(f"PowerSGD factors {tuple(p.shape)} x {tuple(q.shape)} do not make shape {tuple(shape)}")
    out = torch.empty((p.shape[0], q.shape[0]), dtype=torch.promote_types(p.dtype, q.dtype), device=p.device)
    _decode_into(p, q, out)
    return out.reshape(shape)


def _decode_into(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                 minus: tuple[torch.Tensor, torch.Tensor] | None = None, block_elems: int = CPU_BLOCK_ELEMS) -> None:
    """out = p[:, 0] q[:, 0]^T + p[:, 1] q[:, 1]^T + ... (each product and each sum rounded on its own, left to
    right). ``minus=(matrix, res)``: also res = matrix - out (``res`` may be ``matrix`` itself).

    On the CPU, by blocks of rows: every element goes through the same operations in the same order as without
    blocks, so the bits do not depend on the block size."""
    n, m = out.shape
    rows = n if out.device.type != "cpu" else max(1, min(n, block_elems // max(1, m)))
    rank = p.shape[1]
    # Columns made contiguous: a strided (n, 1) column broadcast over a row is ~3x slower to multiply.
    pt, qt = p.t().contiguous(), q.t().contiguous()
    scratch = torch.empty((rows, m), dtype=out.dtype, device=out.device) if rank > 1 else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        o = out[r0:r1]
        torch.mul(pt[0, r0:r1].unsqueeze(1), qt[0], out=o)
        if scratch is not None:
            t = scratch[: r1 - r0]
            for i in range(1, rank):
                torch.mul(pt[i, r0:r1].unsqueeze(1), qt[i], out=t)
                o.add_(t)
        if minus is not None:
            matrix, res = minus
            if res is matrix:
                res[r0:r1].sub_(o)
            else:
                torch.sub(matrix[r0:r1], o, out=res[r0:r1])
