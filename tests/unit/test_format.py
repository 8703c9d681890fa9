"""format.py: JSON value encoding round trip (through real JSON), names, tensor bytes."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowdiff import CorruptFileError
from lowdiff._storage import format as fmt

SCALAR_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool]


@st.composite
def scalar_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(SCALAR_DTYPES))
    shape = draw(st.sampled_from([(), (1,), (1, 1)]))
    if dtype.is_floating_point:
        value = draw(st.floats(allow_nan=True, allow_infinity=True, width=16 if dtype == torch.float16 else 32))
        if dtype == torch.float64:
            value = draw(st.floats(allow_nan=True, allow_infinity=True))
    elif dtype == torch.bool:
        value = draw(st.booleans())
    else:
        info = torch.iinfo(dtype)
        value = draw(st.integers(info.min, info.max))
    return torch.tensor(value, dtype=dtype).reshape(shape)


leaves = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
          | st.text(max_size=8) | scalar_tensors())
keys = st.text(max_size=8).filter(lambda k: k not in ("__tensor__", "__tuple__"))
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(keys, inner, max_size=3),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        if a.dtype.is_floating_point and bool(a.isnan().all()):
            assert bool(b.isnan().all())
        else:
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (a, b)
    elif isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b)
        else:
            assert struct.pack("<d", a) == struct.pack("<d", b), (a, b)  # -0.0 stays -0.0
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


@given(value=values)
def test_encode_decode_round_trip_through_json(value: Any) -> None:
    encoded = fmt.encode_value(value)
    text = json.dumps(encoded)  # what the manifest / snapshot / segment metadata actually stores
    _same(value, fmt.decode_value(json.loads(text)))


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -0.0, 5e-324, 1.7976931348623157e308,
                                   0.1, (0.9, 0.999), ((1, 2.5), [3, (True, None)])])
def test_encode_decode_special_values(value: Any) -> None:
    _same(value, fmt.decode_value(json.loads(json.dumps(fmt.encode_value(value)))))


def test_typical_optimizer_group_round_trips() -> None:
    group = {"lr": torch.tensor(0.01), "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "foreach": None, "initial_lr": 0.001, "step": torch.tensor(3.0)}
    _same(group, fmt.decode_value(json.loads(json.dumps(fmt.encode_value(group)))))


@pytest.mark.parametrize("bad", [torch.zeros(2), object(), b"bytes", {1, 2}, {object(): 1}])
def test_encode_rejects_what_it_cannot_store(bad: Any) -> None:
    with pytest.raises(TypeError):
        fmt.encode_value(bad)


@pytest.mark.parametrize("value", [
    {1: "int key"}, {"__tensor__": 1}, {"__tuple__": []}, {"__items__": [[1, 2]]}, {(1, "a"): None, 2.5: True},
    Counter({3: 1, 80: 2}), {"milestones": Counter({30: 1}), "gamma": 0.1, "nested": [{5: (1, 2)}]},
    {None: 1, True: 2},
])
def test_encode_decode_keys_and_counters_losslessly(value: Any) -> None:
    """Tracked state (a MultiStepLR's milestones are a Counter with int keys) comes back with the same types."""
    decoded = fmt.decode_value(json.loads(json.dumps(fmt.encode_value(value))))
    assert decoded == value and type(decoded) is type(value)
    for k, v in value.items():
        assert type(decoded[k]) is type(v)
    assert [type(k) for k in decoded] == [type(k) for k in value]


def test_multisteplr_state_round_trips() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2, 4], 0.1)
    for _ in range(3):
        opt.step()
        sched.step()
    state = fmt.decode_value(json.loads(json.dumps(fmt.encode_value(sched.state_dict()))))
    fresh = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                                                 [9], 0.5)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == sched.state_dict() and isinstance(fresh.milestones, Counter)


def test_decode_rejects_unknown_dtypes() -> None:
    with pytest.raises(CorruptFileError):
        fmt.decode_value({"__tensor__": {"dtype": "float8", "shape": [], "value": 1.0, "device": "cpu"}})
    with pytest.raises(CorruptFileError):
        fmt.decode_value({"__tensor__": {"dtype": "float32", "shape": "x", "value": 1.0, "device": "cpu"}})


def test_names_round_trip_and_reject_foreign_files(tmp_path: Path) -> None:
    assert fmt.snapshot_name(42) == "step-0000000042.h5"
    assert fmt.parse_snapshot_name(fmt.snapshot_name(42)) == (42, fmt.Shard())
    assert fmt.segment_name(3, 9) == "steps-0000000003-0000000009.h5"
    assert fmt.parse_segment_name(fmt.segment_name(3, 9)) == (3, 9, fmt.Shard())
    for bad in ("step-42.h5", "step-0000000042.h5.tmp", "steps-0000000009-0000000003.h5", "notes.txt"):
        assert fmt.parse_snapshot_name(bad) is None and fmt.parse_segment_name(bad) is None
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "log").mkdir()
    for name in ("step-0000000005.h5", "step-0000000000.h5", "step-0000000010.h5.tmp", "README"):
        (tmp_path / "snapshots" / name).touch()
    for name in ("steps-0000000004-0000000006.h5", "steps-0000000001-0000000003.h5",
                 "steps-0000000007-0000000009.h5.tmp"):
        (tmp_path / "log" / name).touch()
    assert list(fmt.list_snapshots(tmp_path)) == [0, 5]
    assert fmt.list_snapshots(tmp_path)[5].paths == (tmp_path / "snapshots" / "step-0000000005.h5",)
    assert [(a, b) for a, b, _ in fmt.list_segments(tmp_path)] == [(1, 3), (4, 6)]


@given(dtype=st.sampled_from(list(fmt.DTYPES.values())), shape=st.lists(st.integers(1, 4), max_size=3).map(tuple),
       seed=st.integers(0, 1000))
def test_tensor_bytes_round_trip(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 50).to(dtype)
    back = fmt.tensor_from_bytes(bytes(fmt.tensor_bytes(t)), dtype, list(shape), "w")
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    with pytest.raises(CorruptFileError, match="w"):
        fmt.tensor_from_bytes(bytes(fmt.tensor_bytes(t)) + b"\x00", dtype, list(shape), "w")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_tensor_bytes_round_trip_zero_elements(dtype: torch.dtype) -> None:
    t = torch.empty((0,), dtype=dtype)
    back = fmt.tensor_from_bytes(bytes(fmt.tensor_bytes(t)), dtype, [0], "w")
    assert back.dtype == dtype and back.shape == (0,)
