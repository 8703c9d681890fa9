"""No compression (LowDiff+): the full gradient is the differential."""

from __future__ import annotations

import torch

from lowdiff.compressors.base import Compressor, Payload


class IdentityCompressor(Compressor):
    name = "none"

    def compress(self, fqn: str, grad: torch.Tensor) -> Payload:
        # The payload aliases the live gradient; the caller copies it off the device before it can change.
        return {"full": grad}
