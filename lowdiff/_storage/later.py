"""A value taken now and read later: how the training thread encodes a tensor's value without waiting for its
device (issue 35), and how that value is written once it is there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Later:
    """A number whose value is read later: a one-element tensor's value whose copy to host memory was queued
    without waiting for the device (lowdiff._transfer.scalars). It stands in an encoded value (the ``value`` of a
    ``__tensor__`` form, or a number of its own, as a GradScaler's scale) until the value is written: JSON
    (:func:`json_value`) and pickle (a persistence process's message) write the number, waiting for the copy if
    it is still running."""

    __slots__ = ()

    def ready(self) -> bool:
        """Whether the value can be read without waiting."""
        raise NotImplementedError

    def get(self) -> bool | int | float:
        """The value (waits for the copy to complete)."""
        raise NotImplementedError

    def __reduce__(self) -> tuple[Any, ...]:
        value = self.get()
        return type(value), (value,)


Read = Callable[[torch.Tensor], "Later | bool | int | float"]
"""How a one-element tensor's value is taken when encoded: by default at once (``.item()``: on a GPU the host
waits for the device); the training thread passes lowdiff._transfer.scalars.ScalarReader, which returns a
:class:`Later`."""


def json_value(obj: Any) -> Any:
    """``json.dumps``'s ``default``: a :class:`Later` is written as its number."""
    if isinstance(obj, Later):
        return obj.get()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def pending(obj: Any) -> bool:
    """Whether ``obj`` (an encoded value, or a message of them: lists, tuples, dicts) holds a :class:`Later` whose
    value is not there yet."""
    if isinstance(obj, Later):
        return not obj.ready()
    if isinstance(obj, (list, tuple)):
        return any(pending(x) for x in obj)
    if isinstance(obj, dict):
        return any(pending(x) for x in obj.values())
    return False
