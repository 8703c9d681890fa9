"""Layer-wise gradient capture (LowDiff+): copy each gradient off the device as soon as backward finishes it.

A post-accumulate-grad hook collects each final ``.grad`` and stages them (lowdiff._transfer.host_copies) in buckets of
BUCKET_BYTES: on a GPU a non-blocking copy into pinned memory on the side stream, so the copies of the last
layers run while backward still computes the first ones, and by the end of backward the differential is
(nearly) on the host. ``step()`` then uses a
captured copy only if it is still the gradient being stepped: the same tensor, not changed in place since
(its version counter). Anything that changes gradients after backward (clipping, a further micro-batch of
gradient accumulation, a user hook) makes the capture stale, and ``step()`` copies that gradient again, so the
log always holds exactly the gradient the optimizer consumed. When every capture of several steps in a row
went stale, the hooks only cost copies: they are removed and gradients are copied in step() from then on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lowdiff._transfer.host_copies import HostCopier

log = logging.getLogger(__name__)

# Steps in a row whose captures were all stale before the hooks are removed.
STALE_STEPS_LIMIT = 3
# Gradients are staged in buckets of at least this many bytes, in the order backward finishes them (as DDP
# buckets its all-reduces): one concatenation and one copy per bucket instead of several CUDA calls per tensor.
BUCKET_BYTES = 16 << 20


class LayerwiseCapture:
    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], stager: HostCopier,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self._stager = stager
        self._bucket_bytes = bucket_bytes
        self._captured: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._pending: list[tuple[str, torch.Tensor, int]] = []
        self._pending_bytes = 0
        self._event: Any = None
        self.hits = 0
        self.misses = 0
        self._stale_steps = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(name)) for name, p in params]

    def _hook_for(self, name: str) -> Any:
        def hook(param: torch.Tensor) -> None:
            g = param.grad
            if g is None or g.is_sparse:
                return
            self._pending.append((name, g, g._version))
            self._pending_bytes += g.numel() * g.element_size()
            if self._pending_bytes >= self._bucket_bytes:
                self._stage_pending()

        return hook

    def _stage_pending(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        # live=True: on the CPU each capture must own a copy; on a GPU the concatenation is the private copy.
        hosts, event, _ = self._stager.stage([g for _, g, _ in pending], [True] * len(pending))
        if event is not None:
            self._event = event
        for (name, g, version), host in zip(pending, hosts):
            self._captured[name] = (g, version, host)

    def take(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{name: (gradient tensor captured, host copy)}`` for captures still valid; clears them all. Gradients
        of the last, partial bucket are left to step(), which stages them with the rest of the step."""
        self._pending, self._pending_bytes = [], 0
        out = {}
        for name, (g, version, host) in self._captured.items():
            if g._version == version:
                out[name] = (g, host)
        self.hits += len(out)
        self.misses += len(self._captured) - len(out)
        self._stale_steps = self._stale_steps + 1 if (self._captured and not out) else 0
        self._captured = {}
        if self._stale_steps >= STALE_STEPS_LIMIT and self.active:
            log.info("lowdiff: gradients changed after backward in %d steps in a row (clipping? accumulation?); "
                     "layer-wise capture is off, gradients are copied in step()", STALE_STEPS_LIMIT)
            self.remove()
        return out

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def ready(self) -> Any:
        """The event the last capture completes at (None on the CPU). Nothing needs to wait for it on the
        training stream: the copies read the stager's private concatenation, or the stager made the training
        stream wait itself when it had no room for one."""
        event, self._event = self._event, None
        return event

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
