"""The compressor interface shared by Top-k, PowerSGD and the identity (LowDiff+) compressor."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

Payload = dict[str, torch.Tensor]


class Comm(Protocol):
    """The collectives a compressor needs in data-parallel training (lowdiff._training.ddp provides one)."""

    world_size: int

    def allreduce_sum_(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


def check_residual(fqn: str, residual: torch.Tensor, grad: torch.Tensor) -> None:
    """A residual is updated in place with its gradient added: it must match it."""
    if residual.shape != grad.shape or residual.dtype != grad.dtype or residual.device != grad.device:
        raise ValueError(f"the error-feedback residual of {fqn!r} is {residual.dtype} {tuple(residual.shape)} on "
                         f"{residual.device}, its gradient {grad.dtype} {tuple(grad.shape)} on {grad.device}: load "
                         "compressor state saved for this model, on its parameters' devices")


@dataclass(frozen=True)
class StepPayloads:
    """A step's payloads as a compressor wrote them between :meth:`Compressor.begin_step` and
    :meth:`Compressor.end_step`: one after the other, in the order of ``names``, each field's tensors into one flat
    tensor per dtype. Packing a step then copies ``flats`` instead of concatenating hundreds of tensors (Top-k's
    values and indices) after checking each one's shape (lowdiff._training.stager)."""

    version: int
    """Changes whenever the sequence of payloads (parameters, sizes, dtypes) differs from the previous step's:
    within one version every step's payloads lie at the same places in ``flats``."""
    names: list[str]
    flats: dict[torch.dtype, torch.Tensor]
    """Per dtype, the 1-D tensor that holds this step's payload tensors of that dtype, one after the other
    (numel: their total). Its memory is written again by the next step's payloads."""


class Compressor(ABC):
    """Turns a gradient into a payload; keeps per-parameter memory (error-feedback residuals, warm starts).

    ``compress`` returns fresh tensors the caller may keep: nothing in a payload is reused or mutated later,
    except between :meth:`begin_step` and the next :meth:`begin_step`, whose payloads may lie in memory the
    compressor writes again at the step after (:class:`StepPayloads`).
    """

    name: str
    rank_local_keys: frozenset[str] = frozenset({"residual"})
    """Keys of :meth:`state_dict` that differ from rank to rank under DDP (error-feedback residuals: each rank's own
    gradient minus what it sent); the rest (PowerSGD's warm-start Q) is the same on every rank."""

    @abstractmethod
    def compress(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> Payload:
        """Compress ``grad`` of parameter ``fqn`` (adds and updates that parameter's residual).

        With ``comm`` the payload is the AGGREGATED one, identical on every rank: what all ranks consume
        (its decode, averaged over ranks) and what the log stores. ``grad`` is read, never written. The residual
        takes ``grad`` in first, in place: a call that raises (a collective failing, out of memory) leaves it
        added there."""

    @abstractmethod
    def compress_decode(self, fqn: str, grad: torch.Tensor, comm: Comm | None = None) -> tuple[Payload, torch.Tensor]:
        """``compress`` and the dense gradient the payload stands for, in one go so a compressor that computes the
        decode anyway (PowerSGD, for its residual) does not compute it twice. The dense gradient is what the
        compressor module's one ``decode`` function makes of the payload, the function recovery calls through
        ``lowdiff._compressors.decode_payload``: the bits the optimizer consumed are the bits replay feeds it."""

    def check_params(self, named: Mapping[str, torch.Tensor]) -> None:
        """Refuse, at ``wrap()``, parameters this compressor cannot compress (raise UnsupportedError naming one)."""
        return None

    def begin_step(self, targets: dict[torch.dtype, torch.Tensor] | None = None) -> None:
        """The ``compress`` calls of one optimizer step follow, single-process (no ``comm``): a compressor may
        write their payloads into buffers it reuses at the next step (:meth:`end_step` says where). ``targets``:
        1-D tensors, by dtype, it may write them into instead, one after the other from the start (the step's
        flats are then views of them)."""
        return None

    def end_step(self) -> StepPayloads | None:
        """Where this step's payloads lie, if they were all written one after the other into reused buffers
        (None: fresh tensors, as outside :meth:`begin_step`)."""
        return None

    def payload_nbytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        """Expected payload bytes per step for a parameter (used to balance sharded log writes)."""
        n = 1
        for s in shape:
            n *= s
        return n * itemsize

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter memory, keyed by parameter name; saved in every full snapshot. The tensors are the
        compressor's own: the next ``compress`` updates them in place (copy what must outlive it)."""
        return {}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore memory saved by :meth:`state_dict` (missing parameters start from zero)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got entries for {sorted(state)[:3]}")
