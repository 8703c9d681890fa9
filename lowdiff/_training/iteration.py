"""What a training loop keeps besides model and optimizer, and where one iteration ends.

``opt.track(obj, name)`` registers anything with ``state_dict()`` / ``load_state_dict()``: LR schedulers, a
``torch.amp.GradScaler``, data loaders, counters. Its state is logged with every step and comes back in
``opt.resume()`` as it was at the END of the resumed iteration: after the loop's ``sched.step()`` and
``scaler.update()``, which run after ``opt.step()``. So a step's record is complete only when its iteration is over,
and lowdiff holds it (:class:`IterationEnd`) until it sees the next iteration:

* the next ``opt.step()`` begins (before anything of that step happens);
* a tracked GradScaler's ``update()`` runs in an iteration that did not step (the scaler skipped the step): that
  iteration is logged as a step without gradients (``StepRecord.skipped``), so step numbers count iterations;
* ``opt.flush()`` or ``opt.close()`` (the caller says the iteration is over), or the interpreter exits normally.

Then the tracked state and every group's hyperparameters (what the next step starts from) are taken and the record
goes to the checkpointer. An iteration interrupted by an exception is not logged (``close(interrupted=True)``): its
end state is unknown (the exception may have come in an evaluation whose random draws a resumed run would not
repeat), and a resume redoes it.

Data loaders and samplers are the exception: the next iteration draws its batch from them *before* its
``opt.step()``, so their state is taken inside ``opt.step()`` (``at="step"``; by default for anything iterable).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowdiff._storage.format import decode_value, encode_groups, encode_value
from lowdiff._storage.later import Read
from lowdiff._storage.segment import StepRecord
from lowdiff._storage.snapshot import SnapshotState
from lowdiff._transfer.host_copies import Staged
from lowdiff._transfer.scalars import ScalarReader
from lowdiff.errors import LowDiffError, UnsupportedError

log = logging.getLogger(__name__)

AT_STEP = "step"
"""Taken inside ``opt.step()``, after the inner step (data loaders: the batch of the next iteration is drawn before
its step)."""
AT_END = "end"
"""Taken when the iteration ends (schedulers, scalers, counters changed after ``opt.step()``)."""
_AT = ("auto", AT_STEP, AT_END)

ENCODABLE = ("numbers, strings, None, lists, tuples, dicts (string, number or tuple keys), collections.Counter and "
             "one-element tensors")


def is_grad_scaler(obj: Any) -> bool:
    amp = getattr(torch, "amp", None)
    cls = getattr(amp, "GradScaler", None)
    return cls is not None and isinstance(obj, cls)


def default_at(obj: Any) -> str:
    """``step`` for iterables (data loaders and samplers hand out the next batch before the next step), else
    ``end``."""
    return AT_STEP if callable(getattr(type(obj), "__iter__", None)) else AT_END


SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def scaler_state(obj: Any, read: Any) -> dict[str, Any] | None:
    """A GradScaler's ``state_dict()`` with its scale and growth tracker taken by ``read``: its own reads them with
    ``.item()``, which on a GPU makes the host wait for the device at the end of every iteration. None where that
    is not torch's own state_dict (a subclass's), or the scaler is disabled or has not scaled yet (its own
    state_dict() reads no tensor then). ``read``: a lowdiff._transfer.scalars.ScalarReader (or a plain
    :data:`Read`)."""
    cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if cls is None or not getattr(obj, "_enabled", False) or any(
            getattr(type(obj), f, None) is not getattr(cls, f, None)
            for f in ("state_dict", "get_scale", "_get_scale_async", "_get_growth_tracker")):
        return None
    scale, tracker = getattr(obj, "_scale", None), getattr(obj, "_growth_tracker", None)
    if not isinstance(scale, torch.Tensor) or not isinstance(tracker, torch.Tensor):
        return None
    try:
        return {"scale": read(scale), "growth_factor": obj._growth_factor, "backoff_factor": obj._backoff_factor,
                "growth_interval": obj._growth_interval,
                "_growth_tracker": read(tracker, scale) if isinstance(read, ScalarReader) else read(tracker)}
    except AttributeError:  # another torch's GradScaler: its own state_dict()
        return None


def encode_state(obj: Any, name: str, read: Read | None = None) -> Any:
    """``obj.state_dict()`` as logged (tagged JSON), or ``UnsupportedError`` saying what to do. ``read``: how a
    tensor's value is taken (lowdiff._storage.format.encode_value); with it a GradScaler's state is read without
    its ``state_dict()`` (:func:`scaler_state`)."""
    try:
        state = scaler_state(obj, read) if read is not None and is_grad_scaler(obj) else None
        return encode_value(obj.state_dict() if state is None else state, read)
    except TypeError as e:
        raise UnsupportedError(
            f"the state of tracked {name!r} ({type(obj).__name__}.state_dict()) cannot be logged: {e}. lowdiff logs "
            f"{ENCODABLE}; track an object whose state_dict() returns only those (for example a small wrapper "
            "that converts the rest in state_dict() and back in load_state_dict())") from e


class Tracker:
    """The objects ``opt.track`` registered, by name, each with when its state is taken (:data:`AT_STEP` or
    :data:`AT_END`)."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[Any, str]] = {}
        self.end_seen: set[str] = set()
        """Names of objects tracked at the end whose end-of-iteration call lowdiff sees (a GradScaler's update(), an
        LR scheduler's step()): once each has been called, the iteration's end state is known."""
        self._own_state: set[str] = set()
        """GradScalers whose state_dict() has other keys than :data:`SCALER_KEYS`: read by it, not by
        :func:`scaler_state`."""

    def __len__(self) -> int:
        return len(self.objects)

    def add(self, obj: Any, name: str, at: str) -> str:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"opt.track() needs an object with state_dict() and load_state_dict(), got "
                            f"{type(obj).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"opt.track() needs a non-empty string name, got {name!r}")
        if at not in _AT:
            raise ValueError(f"opt.track(at={at!r}): expected one of {', '.join(_AT)}")
        if name in self.objects:
            raise LowDiffError(f"opt.track({name!r}): a name is tracked once")
        own = encode_state(obj, name)  # refused now rather than at the first step
        if is_grad_scaler(obj) and own and set(own) != set(SCALER_KEYS):
            self._own_state.add(name)  # another torch's scaler state: read by its state_dict() (a device sync)
        kind = default_at(obj) if at == "auto" else at
        self.objects[name] = (obj, kind)
        return kind

    def state(self, at: str, read: Read | None = None) -> tuple[dict[str, Any], list[str]]:
        """The encoded state of the objects taken ``at`` that moment, and an error per object that could not be
        encoded (its state is left out). ``read``: as :func:`encode_state`'s."""
        out, errors = {}, []
        for name, (obj, kind) in self.objects.items():
            if kind != at:
                continue
            try:
                out[name] = encode_state(obj, name, None if name in self._own_state else read)
            except UnsupportedError as e:
                errors.append(str(e))
        return out, errors

    def restore(self, values: dict[str, Any], step: int, end_known: bool) -> None:
        """``load_state_dict`` each object with its state logged at ``step`` (already decoded by the reader).
        ``end_known``: the log holds the state at the end of the iteration (2.2); older logs took every object's
        state inside ``opt.step()``."""
        for name, (obj, kind) in self.objects.items():
            if name not in values:
                if step > 0:
                    log.warning("lowdiff: nothing was logged for tracked %r at step %d; %s starts where it is now",
                                name, step, type(obj).__name__)
                continue
            if kind == AT_END and not end_known:
                log.warning("lowdiff: step %d was logged by an older lowdiff, which took the state of %r inside "
                            "opt.step(): it comes back as it was before the loop's own calls after opt.step() (call "
                            "sched.step() once after resume() for this run)", step, name)
            obj.load_state_dict(values[name])

    def scalers(self) -> list[Any]:
        return [obj for obj, _ in self.objects.values() if is_grad_scaler(obj)]


def decode_groups(groups: list[dict[str, Any]], device: str | None = None) -> list[dict[str, Any]]:
    return [{k: v for k, v in decode_value(g, device).items() if k != "params"} for g in groups]


class GroupEncoder:
    """``encode_groups`` of an optimizer's groups, encoded again only when a hyperparameter changed: a step encodes
    them twice (as its step began, and as its iteration ended), and most steps change none, or one (a scheduler's
    ``lr``). A group is taken as unchanged when every value is the very object encoded last time and each of those
    is immutable (numbers, strings, None and tuples of them); a tensor, list or dict (which may change in place)
    is encoded every time. The list returned is then the same object: records share it, and nothing mutates it.
    ``read``: how a tensor's value is taken (lowdiff._storage.format.encode_value)."""

    def __init__(self, read: Read | None = None) -> None:
        self._read = read
        self._seen: list[tuple[tuple[str, ...], tuple[Any, ...]]] | None = None
        self._encoded: list[dict[str, Any]] = []

    def encode(self, groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        seen = self._seen
        if seen is not None and len(seen) == len(groups):
            for (keys, values), g in zip(seen, groups):
                if keys != tuple(g) or not all(map(operator.is_, values, g.values())):
                    break
            else:
                return self._encoded
        encoded = encode_groups(groups, self._read)  # raises for a value that cannot be logged: nothing is remembered
        self._encoded = encoded
        self._seen = [(tuple(g), tuple(g.values())) for g in groups] \
            if all(_immutable(v) for g in groups for k, v in g.items() if k != "params") else None
        return encoded


def _immutable(v: Any) -> bool:
    if v is None or type(v) in (bool, int, float, str):
        return True
    return type(v) is tuple and all(_immutable(x) for x in v)


@dataclass
class Pending:
    """A step staged by ``opt.step()`` whose iteration has not ended yet."""

    record: Staged[StepRecord]
    snapshot: Staged[SnapshotState] | None = None
    snapshot_block_s: float = 0.0
    apply_s: float | None = None


class IterationEnd:
    """Holds the record of the iteration in progress until it ends, then completes it and hands it to the
    checkpointer. Shared by the wrapper and its finalizer (so it never references the wrapper)."""

    def __init__(self, tracker: Tracker, optimizer: torch.optim.Optimizer, checkpointer: Any) -> None:
        self.tracker = tracker
        self.optimizer = optimizer
        self.checkpointer = checkpointer
        self.pending: Pending | None = None
        self._called: set[int] = set()
        self.read = ScalarReader()
        """Tensors' values (a GPU learning rate, a GradScaler's scale) copied without waiting, read by the writer."""
        self._end_read = False  # the held iteration's end state was read at its end calls (copies to reuse)
        self.groups = GroupEncoder(self.read)
        """The optimizer's groups encoded (shared with ``opt.step()``, which encodes them as a step begins)."""

    def hold(self, pending: Pending) -> None:
        assert self.pending is None, "the previous iteration was not sealed"
        self.pending, self._end_read = pending, False
        self._called = set()
        self.checkpointer.on_hold(pending.record, keep_if_orphaned=self.end_free())

    def end_call(self, obj: Any) -> None:
        """A tracked object's end-of-iteration call (``sched.step()``, ``scaler.update()``) has run. Once every
        object tracked at the end has made its call, the held iteration's end state is known before the iteration
        formally ends (at the next ``opt.step()``): it goes to the persistence process, which then commits the
        iteration even if the trainer dies first (a crash loses no step whose ``opt.step()`` returned)."""
        p = self.pending
        if p is None or not self.checkpointer.wants_end_known:  # the writer thread takes records at their end only
            return
        self._called.add(id(obj))
        at_end = [(n, o) for n, (o, kind) in self.tracker.objects.items() if kind == AT_END]
        if not all(n in self.tracker.end_seen and id(o) in self._called for n, o in at_end):
            return
        self._end_known(p)

    def end_all(self) -> None:
        """The loop says it has made the held iteration's last change to tracked objects (``opt.end_iteration()``):
        as if every object tracked at the end had made its call."""
        p = self.pending
        if p is None or not self.checkpointer.wants_end_known:
            return
        self._called.update(id(o) for o, kind in self.tracker.objects.values() if kind == AT_END)
        self._end_known(p)

    def _end_known(self, p: Pending) -> None:
        self.read.fresh()
        self._end_read = True
        try:
            (end, errors), later = self.read.collect(self.tracker.state, AT_END, self.read)
            if errors:
                return  # raised when the iteration ends
            end_groups, more = self.read.collect(self.groups.encode, self.optimizer.param_groups)
        except UnsupportedError:
            return
        self.checkpointer.on_end_known(p.record, {**p.record.item.data, **end}, end_groups, later + more)

    def retake_rng(self, rng: dict[str, Any]) -> bool:
        """The held iteration continues from ``rng`` (taken now, after draws made since its ``opt.step()``): its
        record (and snapshot) log that state instead. False: no iteration is held."""
        p = self.pending
        if p is None:
            return False
        p.record.item.rng = rng
        if p.snapshot is not None:
            p.snapshot.item.rng = dict(rng)
        self.checkpointer.on_rng_retaken(p.record)
        return True

    def end_free(self) -> bool:
        """Nothing is tracked at the end of an iteration: a record is complete when opt.step() returns."""
        return not any(kind == AT_END for _, kind in self.tracker.objects.values())

    def seal(self, strict: bool = True) -> int | None:
        """The held iteration is over: take the tracked state and the hyperparameters now, complete the record
        (and its snapshot) and hand it to the checkpointer. Returns its step (None: nothing held). A tracked state
        that cannot be logged is left out of the record and, when ``strict``, raised afterwards."""
        p = self.pending
        if p is None:
            return None
        self.checkpointer.before_seal()
        if not self._end_read:
            self.read.fresh()
        end, errors = self.tracker.state(AT_END, self.read)
        # Raises for a hyperparameter that cannot be logged: the iteration stays held (its record and snapshot
        # with it, nothing leaks), and the next opt.step() seals it again.
        end_groups = self.groups.encode(self.optimizer.param_groups)
        self.pending, self._end_read = None, False
        rec = p.record.item
        rec.data = {**rec.data, **end}
        rec.end_groups = end_groups
        if p.snapshot is not None:
            p.snapshot.item.extra["data"] = dict(rec.data)
            p.snapshot.item.extra["end_groups"] = rec.end_groups
        self.checkpointer.on_step(p.record, snapshot=p.snapshot, snapshot_block_s=p.snapshot_block_s,
                                  apply_s=p.apply_s)
        for e in errors:
            log.error("lowdiff: step %d: %s", rec.step, e)
        if errors and strict:
            raise UnsupportedError(errors[0])
        return rec.step

    def drop(self) -> int | None:
        """The held iteration was interrupted: its record is not logged (a resume redoes the iteration), unless
        nothing is tracked at the end of an iteration: then its opt.step() returned with the iteration's whole
        state, and it is logged (a crash loses no step whose opt.step() returned)."""
        if self.pending is not None and self.end_free():
            step = self.pending.record.item.step
            try:
                return self.seal(strict=False)
            except Exception as e:  # its end cannot be logged (a hyperparameter): dropped as interrupted
                if self.pending is None:  # sealed: the checkpointer took it and then failed (its error stands)
                    raise
                log.error("lowdiff: the end of iteration %d cannot be logged (%s)", step, e)
        p, self.pending = self.pending, None
        if p is None:
            return None
        p.record.release()
        if p.snapshot is not None:
            p.snapshot.release()
        self.checkpointer.on_drop(p.record.item.step)
        log.info("lowdiff: iteration %d was interrupted before it ended; it is not logged (a resume redoes it)",
                 p.record.item.step)
        return p.record.item.step
