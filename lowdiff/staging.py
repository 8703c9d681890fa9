"""Getting tensors off the training device without making training wait (the "snapshot" phase).

On the CPU a staged tensor is the tensor itself, or a clone when it aliases live state the caller may change
later. On a GPU, each tensor is copied into pinned host memory by a non-blocking copy on a side stream; the
training thread never waits. The batch of copies completes at a CUDA event that travels with the record or
snapshot, and the background writer waits for it before reading (``StepRecord.wait_ready``).

Live tensors (parameters, optimizer state, a gradient the user may zero in place) are first cloned on the
device, which takes microseconds, so the copy reads a private tensor and training may change the original at
once. When the device has too little spare memory for such clones, the copy reads the live tensor directly
and the training stream waits (on the GPU, not on the host) until the copy is done before running anything
that could change it: the next step waits only for the copy, never for the disk.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

# Device clones of live tensors may use at most this fraction of the device's free memory.
SPARE_FRACTION = 0.5


class Stager:
    """Stages tensors of one device to host memory. ``stage`` returns host tensors and a ready event."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        self.device: torch.device | None = None
        self.stream: Any = None
        if len(devices) == 1:
            self.device = next(iter(devices))
            self.stream = torch.cuda.Stream(device=self.device)
        elif len(devices) > 1:
            log.warning("lowdiff: parameters span %d GPUs; their copies to host memory are synchronous",
                        len(devices))

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def stage(self, tensors: list[torch.Tensor], live: list[bool]) -> tuple[list[torch.Tensor], Any]:
        """Host copies of ``tensors`` the caller owns, and an event they are complete at (None: complete now).

        ``live[i]``: the tensor may be changed in place after this call (a parameter, optimizer state, a
        gradient); otherwise it is a fresh tensor nothing else writes to (a compressor's payload)."""
        if not self.asynchronous or not any(t.device.type == "cuda" for t in tensors):
            return [_host_copy(t, lv) for t, lv in zip(tensors, live)], None
        main = torch.cuda.current_stream(self.device)
        cuda_live = sum(t.numel() * t.element_size() for t, lv in zip(tensors, live) if lv and t.is_cuda)
        clone = cuda_live == 0 or cuda_live <= SPARE_FRACTION * torch.cuda.mem_get_info(self.device)[0]
        sources = [t.detach().clone() if (lv and clone and t.is_cuda) else t.detach() for t, lv in zip(tensors, live)]
        self.stream.wait_stream(main)
        out: list[torch.Tensor] = []
        with torch.cuda.stream(self.stream):
            for src, lv in zip(sources, live):
                if not src.is_cuda:
                    out.append(_host_copy(src, lv))
                    continue
                dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                dst.copy_(src, non_blocking=True)
                # The caching allocator must not hand src's memory out again before the copy has read it.
                src.record_stream(self.stream)
                out.append(dst)
        event = torch.cuda.Event()
        event.record(self.stream)
        if not clone:
            main.wait_event(event)  # no spare memory: nothing on the training stream may change them before
        return out, event


def _host_copy(t: torch.Tensor, live: bool) -> torch.Tensor:
    if t.device.type != "cpu":
        return t.detach().to("cpu", copy=True)
    return t.detach().clone() if live else t.detach()
