"""A step's record whose copies into the persistence process's ring are still running on the GPU when ``opt.step()``
returns (issue 35): the training thread does not wait for them, which would cost it its lead over the GPU.

:class:`CopyingRecord` holds such a record until its copies are seen complete, checked without waiting
(``send(block=False)``) at every later call into the writer: the iteration's end state becoming known
(``sched.step()``), a later ``opt.step()``. At the end of its iteration (the next ``opt.step()``) it goes in any
case (``send(block=True)``; the copies are long done by then), and before any other message, so the persistence
process sees every message in step order. A trainer that dies before the record is handed over loses that one step,
which recovery does not replay (docs/guide/durability.md).

The end state of an iteration (``EndKnown``: from then on the persistence process commits the record should the
trainer die) may hold values still being copied from the device (a learning rate a scheduler changed on the GPU, a
GradScaler's scale): it waits here the same way, behind its record, until they are seen complete."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lowdiff._storage.later import Later
from lowdiff._storage.segment import StepRecord
from lowdiff._transfer.host_copies import Slot, Staged
from lowdiff._transfer.packing import PackedStep, StepPacker, pack_host

HandOver = Callable[[Staged[StepRecord], bool], None]
EndKnown = Callable[[Staged[StepRecord], dict[str, Any], list[dict[str, Any]]], None]


class CopyingRecord:
    """At most one record waiting for its copies, and the end state of the latest record's iteration waiting for
    its own (a GPU learning rate, a GradScaler's scale: lowdiff._transfer.scalars): ``hand_over(record,
    keep_if_orphaned)`` sends the one, ``end_known(record, data, end_groups)`` the other, each once its copies
    are seen complete, the record first."""

    def __init__(self, hand_over: HandOver, end_known: EndKnown) -> None:
        self._hand_over = hand_over
        self._end_known = end_known
        self._record: Staged[StepRecord] | None = None
        self._keep = False
        self._end: tuple[Staged[StepRecord], dict[str, Any], list[dict[str, Any]], list[Later]] | None = None

    def holds(self, record: Staged[StepRecord]) -> bool:
        return self._record is record

    def put(self, record: Staged[StepRecord], keep_if_orphaned: bool) -> None:
        """``record`` is handed over now if its copies are complete, else later."""
        self.send(block=True)  # an earlier one (its iteration ended without a seal: not in a steady loop)
        self._record, self._keep, self._end = record, keep_if_orphaned, None
        self.send(block=False)

    def end_known(self, record: Staged[StepRecord], data: dict[str, Any], end_groups: list[dict[str, Any]],
                  later: Sequence[Later] = ()) -> None:
        """The end state of ``record``'s iteration is known: it goes after the record, once ``later`` (the values
        in it still being copied from a device) are complete."""
        self._end = (record, data, end_groups, list(later))
        self.send(block=False)

    def send(self, *, block: bool) -> None:
        """Hand the record over, then its end state, if their copies have completed (with ``block``: once they
        have)."""
        record = self._record
        if record is not None:
            if record.ready is not None:
                if record.ready.query():
                    record.ready = None  # complete: handed over without a synchronize()
                elif not block:
                    return
            self._record = None
            try:
                self._hand_over(record, self._keep)
            except BaseException:  # a KeyboardInterrupt inside the send: the record stays held, handed over later
                self._record = record
                raise
        end = self._end
        if end is not None and (block or all(x.ready() for x in end[3])):
            self._end = None
            try:
                self._end_known(*end[:3])  # with block, pickling its values waits for their copies
            except BaseException:
                self._end = end
                raise

    def discard(self, step: int | None = None) -> bool:
        """Give the held record's slot back without handing it over (``step``: only if it is that step's); whether
        one was held. Its copies end first: the slot may be reused or unmapped next. An end state waiting for its
        copies is forgotten with it (or, without ``step``, in any case)."""
        end = self._end
        if end is not None and (step is None or end[0].item.step == step):
            self._end = None
        record = self._record
        if record is None or (step is not None and record.item.step != step):
            return False
        self._record = None
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
