"""A step's record whose copies into the persistence process's ring are still running on the GPU when ``opt.step()``
returns (issue 35): the training thread does not wait for them, which would cost it its lead over the GPU.

:class:`CopyingRecord` holds such a record until its copies are seen complete, checked without waiting
(``send(block=False)``) at every later call into the writer: the iteration's end state becoming known
(``sched.step()``), a later ``opt.step()``. At the end of its iteration (the next ``opt.step()``) it goes in any
case (``send(block=True)``; the copies are long done by then), and before any other message, so the persistence
process sees every message in step order. A trainer that dies before the record is handed over loses that one step,
which recovery does not replay (docs/guide/durability.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowdiff._storage.segment import StepRecord
from lowdiff._transfer.host_copies import Slot, Staged
from lowdiff._transfer.packing import PackedStep, StepPacker, pack_host

HandOver = Callable[[Staged[StepRecord], bool], None]
EndKnown = Callable[[Staged[StepRecord], dict[str, Any], list[dict[str, Any]]], None]


class CopyingRecord:
    """At most one record waiting for its copies: ``hand_over(record, keep_if_orphaned)`` sends it, ``end_known``
    the end state of its iteration when that became known meanwhile."""

    def __init__(self, hand_over: HandOver, end_known: EndKnown) -> None:
        self._hand_over = hand_over
        self._end_known = end_known
        self._record: Staged[StepRecord] | None = None
        self._keep = False
        self._end: tuple[dict[str, Any], list[dict[str, Any]]] | None = None

    def holds(self, record: Staged[StepRecord]) -> bool:
        return self._record is record

    def put(self, record: Staged[StepRecord], keep_if_orphaned: bool) -> None:
        """``record`` is handed over now if its copies are complete, else later."""
        self.send(block=True)  # an earlier one (its iteration ended without a seal: not in a steady loop)
        self._record, self._keep, self._end = record, keep_if_orphaned, None
        self.send(block=False)

    def end_known(self, data: dict[str, Any], end_groups: list[dict[str, Any]]) -> None:
        """The held record's end state is known: it goes with the record."""
        self._end = (data, end_groups)
        self.send(block=False)

    def send(self, *, block: bool) -> None:
        """Hand the record over if its copies have completed (with ``block``: once they have)."""
        record = self._record
        if record is None:
            return
        if record.ready is not None:
            if record.ready.query():
                record.ready = None  # complete: handed over without a synchronize()
            elif not block:
                return
        end, self._record, self._end = self._end, None, None
        try:
            self._hand_over(record, self._keep)
        except BaseException:  # a KeyboardInterrupt inside the send: the record stays held, handed over later
            self._record, self._end = record, end
            raise
        if end is not None:
            self._end_known(record, *end)

    def discard(self, step: int | None = None) -> bool:
        """Give the held record's slot back without handing it over (``step``: only if it is that step's); whether
        one was held. Its copies end first: the slot may be reused or unmapped next."""
        record = self._record
        if record is None or (step is not None and record.item.step != step):
            return False
        self._record, self._end = None, None
        try:
            record.wait()
        except Exception:
            pass
        record.release()
        return True


def pack_here(rec: StepRecord, packer: StepPacker, alloc: Callable[[int, bool], Slot | None]) -> PackedStep | None:
    """A record the stager did not pack into the ring (layer-wise captures, a replaced ring), packed now into a slot
    from ``alloc``; None when the persistence process is gone."""
    rec.unpack()
    keys = [(n, f) for n, p in rec.grads.items() for f in p] + [("", n) for n in rec.buffers]
    tensors = [t for p in rec.grads.values() for t in p.values()] + list(rec.buffers.values())
    layout, _ = packer.plan(keys, tensors)
    assert layout is not None  # host tensors
    slot = alloc(layout.nbytes, False)
    if slot is None:
        return None
    pack_host(layout, tensors, slot.buf)
    return PackedStep(slot.buf, layout, slot.handle)
