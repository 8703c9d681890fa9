"""PowerSGD (Vogels et al. 2019): rank-r factors with a warm-started Q and error feedback.

Matrices are viewed as (shape[0], numel / shape[0]). 1-D tensors, and matrices where the factors would not
be smaller than the matrix, are sent uncompressed as in PyTorch's reference hook.
"""

from __future__ import annotations

import zlib

import torch

from lowdiff.compressors.base import Comm, Compressor, Payload
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

    def __init__(self, *, rank: int, error_feedback: bool = True) -> None:
        self.rank = rank
        self.error_feedback = error_feedback
        self._residual: dict[str, torch.Tensor] = {}
        self._q: dict[str, torch.Tensor] = {}

    def initial_q(self, fqn: str, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        # Seeded by the parameter name so every rank (and a resumed run) starts from the same Q.
        gen = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
        return torch.randn(m, r, generator=gen).to(device=like.device, dtype=like.dtype)

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
        if dims is None:
            full = grad.detach().clone()
            if comm is not None and world > 1:
                comm.allreduce_sum_(full)
                full.div_(world)
            return {"full": full}, full
        n, m, r = dims
        residual = self._residual.get(fqn) if self.error_feedback else None
        matrix = grad.reshape(n, m)
        if residual is not None:
            matrix = matrix + residual
        q = self._q.get(fqn)
        if q is None or q.shape != (m, r):
            q = self.initial_q(fqn, m, r, matrix)
        p = matrix @ q
        if comm is not None and world > 1:
            comm.allreduce_sum_(p)
        orthogonalize(p)
        q = matrix.T @ p
        if comm is not None and world > 1:
            # As in PyTorch's hook: the averaged approximation is P (sum of M_i Q)^T / N; dividing Q keeps
            # decode() a plain product.
            comm.allreduce_sum_(q)
            q.div_(world)
        self._q[fqn] = q.clone()
        # decode() with the parameter's own shape gives these bits too (it reshapes the same (n, m) product).
        decoded = decode(p, q, (n, m)) if (self.error_feedback or want_decoded) else None
        if self.error_feedback:
            assert decoded is not None
            self._residual[fqn] = matrix - decoded
        return {"p": p, "q": q}, (decoded.reshape(grad.shape) if decoded is not None else None)

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
    out = p[:, 0:1] * q[:, 0].unsqueeze(0)
    for i in range(1, p.shape[1]):
        out = out + p[:, i : i + 1] * q[:, i].unsqueeze(0)
    return out.reshape(shape)
