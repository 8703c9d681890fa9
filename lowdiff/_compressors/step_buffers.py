"""A step's payloads written one after the other into flat buffers reused from step to step.

Top-k (values and int32 indices) and PowerSGD (its factors P and Q, and the tensors it sends whole) write each
payload tensor into a slice of one flat buffer per dtype (:class:`lowdiff._compressors.base.StepPayloads`): packing
a step for the writer then copies a few flats instead of walking hundreds of tensors (lowdiff._training.stager).
"""

from __future__ import annotations

import torch

from lowdiff._compressors.base import StepPayloads

_Take = tuple[str, int, torch.dtype, torch.device]


class StepBuffers:
    """Flat buffers, one per dtype, that a step's payload tensors are sliced from in the order they are taken.

    A buffer too small for a step's payloads (the first step, more parameters with gradients) is not grown
    during the step, whose earlier payloads are views of it: the rest of that step's payloads are fresh tensors,
    and the buffer is replaced at the step's end by one of the size the step needed (the old one is then only
    kept alive by those views, never written again)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self._own: dict[torch.dtype, torch.Tensor] = {}
        self._used: dict[torch.dtype, int] = {}
        self._seq: list[_Take] = []
        self._last: list[_Take] = []
        self._names: list[str] = []
        self._devices: set[torch.device] = set()
        self._whole = True
        self._version = 0
        self.active = False
        """Between :meth:`begin` and :meth:`end`: payloads are taken from the buffers."""

    def begin(self, targets: dict[torch.dtype, torch.Tensor] | None = None) -> None:
        """A step's payloads follow; ``targets``: 1-D tensors, by dtype, to write them into this step instead of the
        buffers kept here (a writer's slot, so packing the step copies nothing; lowdiff._training.stager)."""
        self._used, self._seq, self._devices, self._whole, self.active = {}, [], set(), True, True
        self._bufs = targets if targets else self._own

    def take(self, fqn: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements for a payload tensor of parameter ``fqn``: the next slice of the
        ``dtype`` buffer, or a fresh tensor where the buffer is too small. A parameter's takes are consecutive."""
        self._seq.append((fqn, numel, dtype, device))
        self._devices.add(device)
        at = self._used.get(dtype, 0)
        self._used[dtype] = at + numel
        buf = self._bufs.get(dtype)
        if buf is None or buf.device != device or buf.numel() < at + numel:
            self._whole = False
            return torch.empty(numel, dtype=dtype, device=device)
        return buf[at:at + numel]

    def end(self) -> StepPayloads | None:
        """Where this step's payloads lie (None: some are fresh tensors, or they span devices)."""
        self.active = False
        seq, devices = self._seq, self._devices
        if seq != self._last:
            self._version += 1
            self._last, self._names = seq, list(dict.fromkeys(fqn for fqn, *_ in seq))
        if not seq:
            return None
        if not self._whole or len(devices) != 1:
            if len(devices) == 1:
                device = next(iter(devices))
                self._own = {dt: torch.empty(n, dtype=dt, device=device) for dt, n in self._used.items()}
            else:
                self._own = {}
            return None
        return StepPayloads(self._version, self._names, {dt: self._bufs[dt][:n] for dt, n in self._used.items()})
