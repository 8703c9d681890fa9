"""Steps whose payloads lie in the compressor's flats (lowdiff._compressors.step_buffers): their packing plan, and
on the CPU the writer slot the compressor writes them into, so packing a step copies none of its payloads.

A step's layout is planned once per payload version (lowdiff._compressors.base.StepPayloads) and set of changed
buffers (lowdiff._transfer.packing.from_flats); a step then checks its buffers alone, not its hundreds of payload
tensors. Once a step was packed that way, the next one's payloads are written straight into a slot laid out as it
was (:meth:`FlatSteps.targets`); a step laid out otherwise is copied out of that slot into one of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from lowdiff._compressors.base import StepPayloads
from lowdiff._transfer.host_copies import Slot
from lowdiff._transfer.packing import StepLayout, from_flats, layout_of, region_view

Grads = dict[str, dict[str, torch.Tensor]]
_TARGETS = "_lowdiff_flat_targets"
"""The attribute of a slot's buffer that holds the payload targets built on it, with their layout."""
Planned = tuple[StepLayout, list[torch.Tensor]]


class FlatSteps:
    def __init__(self) -> None:
        # (payload version, buffer keys, shapes and dtypes, the layout and its flats' dtypes or None where the
        # payloads do not lie that way, the flats' sizes)
        self._plan: tuple[int, list[str], list[torch.Size], list[torch.dtype],
                          tuple[StepLayout, list[torch.dtype]] | None, dict[torch.dtype, int]] | None = None
        # the slot targets() handed the compressor, its layout and the targets
        self._preslot: tuple[Slot, StepLayout, dict[torch.dtype, torch.Tensor]] | None = None

    def plan(self, grads: Grads, buffers: dict[str, torch.Tensor], payloads: StepPayloads) -> Planned | None:
        """The layout of a step whose payloads lie in the compressor's flats, and the tensors to pack by it: the
        flats, then the changed buffers; None when the payloads do not lie that way."""
        bkeys, btensors = list(buffers), list(buffers.values())
        shapes, dtypes = [t.shape for t in btensors], [t.dtype for t in btensors]
        plan = self._plan
        if plan is None or plan[0] != payloads.version or plan[1:4] != (bkeys, shapes, dtypes):
            planned = None
            sizes = {dt: f.numel() for dt, f in payloads.flats.items()}
            if list(grads) == payloads.names:
                keys, tensors = keyed(grads, buffers)
                n_payload = len(keys) - len(bkeys)
                layout = layout_of(keys, tensors, flat=n_payload)
                if layout is not None:
                    planned = from_flats(layout, n_payload, sizes)
            plan = self._plan = (payloads.version, bkeys, shapes, dtypes, planned, sizes)
        if plan[4] is None:
            return None
        layout, order = plan[4]
        return layout, [payloads.flats[dt] for dt in order] + btensors

    def targets(self, slots: Any) -> dict[torch.dtype, torch.Tensor] | None:
        """Where the compressor may write this step's payloads (``Compressor.begin_step``): on the CPU, once a step
        was packed from the compressor's flats, each flat's place in a slot of ``slots`` (lowdiff._training.stager.
        Slots) laid out as that step was. None: where the compressor keeps them."""
        self.drop()
        plan = self._plan
        if slots is None or plan is None or plan[4] is None:
            return None
        layout, order = plan[4]
        if layout.device.type != "cpu":  # a GPU's payloads are copied to host memory in any case
            return None
        slot = slots.alloc(layout.nbytes, pinned=False)
        if slot is None:
            return None
        # Built once per slot buffer and layout: a ring hands out the same buffer tensor for the same range
        # (lowdiff._transfer.ring.Arena.view), a pool its same buffers; kept on the buffer, so it goes with it.
        cached = getattr(slot.buf, _TARGETS, None)
        if cached is not None and cached[0] is layout:
            out = cached[1]
        else:
            out = {}
            for r, pieces in enumerate(layout.members):
                if pieces and pieces[0] < len(order):  # the region of a flat begins with it
                    dt = order[pieces[0]]
                    out[dt] = region_view(slot.buf, layout, r, flat=True)[:plan[5][dt]]
            setattr(slot.buf, _TARGETS, (layout, out))
        self._preslot = (slot, layout, out)
        return out

    def take_slot(self, planned: Planned | None, grads: Grads
                  ) -> tuple[Slot | None, Planned | None, Grads, bool]:
        """The slot :meth:`targets` handed out, if this step is laid out as it is (the payloads lie in it: packing
        leaves them in place), with ``planned`` and ``grads``, and whether every tensor of the step lies in it
        already (no buffers: nothing to pack). Otherwise None, and ``planned`` and ``grads`` with what lay in that
        slot copied out of it, which is given back (a rare step: the parameters with gradients changed)."""
        pre, self._preslot = self._preslot, None
        if pre is None:
            return None, planned, grads, False
        slot, layout, targets = pre
        if planned is not None and planned[0] is layout:
            tensors = planned[1]
            whole = len(tensors) == len(targets) and all(
                (to := targets.get(t.dtype)) is not None and t.data_ptr() == to.data_ptr() for t in tensors)
            return slot, planned, grads, whole
        held = slot.buf
        if planned is not None:
            planned = planned[0], [_own_copy(t, held) for t in planned[1]]
        grads = {n: {f: _own_copy(t, held) for f, t in p.items()} for n, p in grads.items()}
        if slot.release is not None:
            slot.release()
        return None, planned, grads, False

    def drop(self) -> None:
        """Give back the slot :meth:`targets` handed out for a step that never got packed (it raised)."""
        pre, self._preslot = self._preslot, None
        if pre is not None and pre[0].release is not None:
            pre[0].release()


def keyed(grads: Grads, buffers: dict[str, torch.Tensor]) -> tuple[list[tuple[str, str]], list[torch.Tensor]]:
    """A step's tensors to pack and their keys: (parameter, field) for payloads, then ("", name) for buffers."""
    keys = [(n, f) for n, p in grads.items() for f in p]
    tensors = [t for p in grads.values() for t in p.values()]
    if buffers:
        keys += [("", n) for n in buffers]
        tensors += buffers.values()
    return keys, tensors


def _own_copy(t: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it lies in ``held`` (a slot about to be given back)."""
    start, end = held.data_ptr(), held.data_ptr() + held.numel()
    return t.clone() if start <= t.data_ptr() < end else t
