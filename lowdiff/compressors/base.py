"""The compressor interface shared by Top-k, PowerSGD and the identity (LowDiff+) compressor."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

Payload = dict[str, torch.Tensor]


class Compressor(ABC):
    """Turns a gradient into a payload; keeps per-parameter memory (error-feedback residuals, warm starts).

    ``compress`` returns fresh tensors the caller may keep: nothing in a payload is reused or mutated later.
    """

    name: str

    @abstractmethod
    def compress(self, fqn: str, grad: torch.Tensor) -> Payload:
        """Compress ``grad`` of parameter ``fqn`` (adds and updates that parameter's residual)."""

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter memory, keyed by parameter name; saved in every full snapshot."""
        return {}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore memory saved by :meth:`state_dict` (missing parameters start from zero)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got entries for {sorted(state)[:3]}")
