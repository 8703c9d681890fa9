"""No compression (LowDiff+): the full gradient is the differential."""

from __future__ import annotations

import torch

from lowdiff._compressors.base import Comm, Compressor, Payload


class IdentityCompressor(Compressor):
    name = "none"

    def compress(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> Payload:
        if comm is None or comm.world_size == 1:
            # The payload aliases the live gradient; the caller copies it off the device before it can change.
            return {"full": grad}
        full = grad.detach().clone()
        comm.allreduce_sum_(full)
        full.div_(comm.world_size)
        return {"full": full}

    def compress_decode(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> tuple[Payload, torch.Tensor]:
        if comm is None or comm.world_size == 1:
            # decode_payload of {"full": grad} is grad itself (reshaped to its own shape): the step keeps its
            # gradient, without a decode call per parameter (hundreds a step, in both lowdiff and enabled: false).
            return {"full": grad}, grad
        payload = self.compress(fqn, grad, comm)
        return payload, payload["full"].reshape(grad.shape)  # decode_payload's "full" branch
