"""One-element tensors read without waiting for their device (lowdiff._transfer.scalars, issue 35): the value a
copy gives is exactly ``.item()``'s, written as that number by JSON and by pickle, taken without any operator that
reads a value on the calling thread, and copied again when the tensor changed."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lowdiff.testing
from lowdiff._storage import format as fmt
from lowdiff._storage.later import json_value
from lowdiff._training.iteration import scaler_state
from lowdiff._transfer.scalars import ScalarCopy, ScalarReader, host_number

VALUES = [0.0, -0.0, 1e-3, 3.0e-4, 1.0 / 3.0, 65504.0, -2.5, 1e30, math.inf, -math.inf, math.nan]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
def test_host_number_is_item_for_floats(dtype: torch.dtype, value: float) -> None:
    t = torch.tensor(value, dtype=dtype)
    assert _same(host_number(t), t.item())
    assert _same(host_number(t.reshape(1, 1)), t.item())


@pytest.mark.parametrize("dtype", INTS + [torch.bool])
@pytest.mark.parametrize("value", [0, 1, 7, 100])
def test_host_number_is_item_for_integers_and_bools(dtype: torch.dtype, value: int) -> None:
    t = torch.tensor(value, dtype=dtype)
    assert _same(host_number(t), t.item())


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


READS = {"aten::item", "aten::_local_scalar_dense", "aten::eq", "aten::equal", "aten::is_nonzero"}


def test_a_copy_holds_the_value_it_was_made_with_and_writes_it_as_the_number() -> None:
    lr = torch.tensor(3e-4)
    with _Ops() as seen:
        copy = ScalarCopy(lr)
        copy.ready()
    assert not READS & set(seen.ops), seen.ops
    lr.fill_(1.0)  # changed in place right after (a scheduler's next step)
    assert copy.ready()
    expected = torch.tensor(3e-4).item()
    assert _same(copy.get(), expected)
    assert _same(pickle.loads(pickle.dumps(copy)), expected)
    assert json.loads(json.dumps({"lr": copy}, default=json_value)) == {"lr": expected}


def test_encoded_with_a_reader_the_log_holds_what_item_gives() -> None:
    group = {"lr": torch.tensor(1e-3, dtype=torch.float32), "betas": (0.9, torch.tensor(0.999, dtype=torch.float64)),
             "step": torch.tensor(7), "weight_decay": 0.01, "foreach": None}
    eager = fmt.encode_value(group)
    with _Ops() as seen, lowdiff.testing.copies_in_flight(lambda kind: _Done()):
        lazy = fmt.encode_value(group, ScalarReader())
    assert not READS & set(seen.ops), seen.ops
    written = json.loads(json.dumps(lazy, default=json_value))
    assert written == json.loads(json.dumps(eager))
    assert pickle.loads(pickle.dumps(lazy)) == eager
    back = fmt.decode_value(lazy)  # a shadow replica decodes records made in its own process
    assert back["lr"].item() == group["lr"].item() and back["betas"][1].item() == group["betas"][1].item()


def test_on_the_cpu_a_value_is_read_at_once_without_an_operator() -> None:
    lr = torch.tensor(3e-4)
    with _Ops() as seen:
        got = ScalarReader()(lr)
    assert not READS & set(seen.ops), seen.ops
    assert _same(got, lr.item())


@lowdiff.testing.copies_in_flight(lambda kind: _Done())  # CPU copies as on a GPU: Laters
def test_a_reader_copies_a_changed_tensor_again_and_everything_after_fresh() -> None:
    read = ScalarReader()
    lr = torch.tensor(1e-3)
    first, used = read.collect(read, lr)
    assert used == [first]
    again, used = read.collect(read, lr)
    assert again is first and used == [first]  # the seal reuses what the end calls read
    lr.fill_(2e-3)  # a scheduler's fill_: its version counter moves
    changed = read(lr)
    assert changed is not first and changed.get() == torch.tensor(2e-3).item()  # type: ignore[union-attr]
    lr.data.fill_(5e-3)  # through .data: the version counter stays
    assert read(lr) is changed
    read.fresh()  # the next iteration's end: read again whatever the counter says
    assert read(lr).get() == torch.tensor(5e-3).item()  # type: ignore[union-attr]


def test_a_copy_in_flight_is_ready_when_its_event_says_and_get_waits_for_it() -> None:
    class Event:
        done = False
        waited = 0

        def query(self) -> bool:
            return Event.done

        def synchronize(self) -> None:
            Event.waited += 1

    with lowdiff.testing.copies_in_flight(lambda kind: Event()):
        copy = ScalarCopy(torch.tensor(0.5))
    assert not copy.ready()
    Event.done = True
    assert copy.ready() and copy.get() == 0.5 and Event.waited == 0
    Event.done = False
    with lowdiff.testing.copies_in_flight(lambda kind: Event()):
        pending = ScalarCopy(torch.tensor(0.25))
    assert pending.get() == 0.25 and Event.waited == 1


def test_a_grad_scalers_state_read_without_its_state_dict_is_its_state_dict() -> None:
    """Through growth (every 2 steps) and a backoff (an inf gradient): the growth tracker is read at the scale's
    version, which ``_amp_update_scale_`` moves (it leaves the tracker's own counter alone)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    read = ScalarReader()
    for it in range(7):
        loss = model(torch.randn(3, 4)).sum() * (math.inf if it == 4 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        state = scaler_state(scaler, read)
        assert state is not None
        assert pickle.loads(pickle.dumps(fmt.encode_value(state, read))) == fmt.encode_value(scaler.state_dict())
