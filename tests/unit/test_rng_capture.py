"""numpy's generator state as lowdiff captures it is exactly what ``np.random.get_state()`` says, in every state."""

from __future__ import annotations

import copy
import logging
import pickle
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowdiff.rng as lowdiff_rng


def expected_numpy_bytes() -> bytes:
    _, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return key.astype("<u4").tobytes() + int(pos).to_bytes(8, "little", signed=True) \
        + int(has_gauss).to_bytes(8, "little", signed=True) + np.float64(cached).astype("<f8").tobytes()


def captured_numpy_bytes() -> bytes:
    return bytes(lowdiff_rng.capture()[lowdiff_rng.NUMPY].numpy())


@pytest.fixture(autouse=True)
def keep_numpy_state():
    saved = np.random.get_state()
    yield
    np.random.set_state(saved)


OPS = st.one_of(
    st.tuples(st.just("seed"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("normal"), st.integers(0, 5)),  # odd counts leave a cached gaussian
    st.tuples(st.just("uniform"), st.integers(0, 700)),  # past 624 words: the key is regenerated
    st.tuples(st.just("set"), st.tuples(st.integers(0, 624), st.booleans(), st.floats(-5, 5))),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(OPS, min_size=1, max_size=12))
def test_capture_matches_get_state_after_any_draws(ops: list[tuple[str, object]]) -> None:
    for op, arg in ops:
        if op == "seed":
            np.random.seed(arg)
        elif op == "normal":
            np.random.standard_normal(arg)
        elif op == "uniform":
            np.random.random_sample(arg)
        else:
            pos, has_gauss, cached = arg
            key = np.random.default_rng(pos).integers(0, 2**32, 624, dtype=np.uint32)
            np.random.set_state(("MT19937", key, pos, int(has_gauss), cached))
        assert captured_numpy_bytes() == expected_numpy_bytes()


def test_restoring_a_capture_with_a_cached_gaussian_repeats_the_draws() -> None:
    np.random.seed(7)
    np.random.standard_normal(3)  # one gaussian cached
    state = lowdiff_rng.capture()
    first = np.random.standard_normal(4).tolist()
    lowdiff_rng.restore(state)
    assert np.random.standard_normal(4).tolist() == first


def test_another_threads_draw_during_the_periodic_check_is_not_a_disagreement(monkeypatch: pytest.MonkeyPatch,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Every few hundred captures the direct read is compared with ``get_state()``. A draw by another thread between
    the two (a data-loading thread augmenting with ``np.random``) made them differ, and lowdiff logged an error and
    gave up the direct read for good; now it looks again before it concludes."""
    real = np.random.get_state
    drew = []

    def racing_get_state(self: np.random.RandomState, legacy: bool = True) -> object:
        if not drew:  # the other thread draws once, just before this call
            drew.append(real.__self__.random_sample())
        return real(legacy=legacy)

    monkeypatch.setattr(np.random, "get_state", types.MethodType(racing_get_state, real.__self__))
    with caplog.at_level(logging.ERROR, logger="lowdiff"):
        for _ in range(1025):  # two of the direct reader's periodic checks (one per 512 reads) at least
            captured_numpy_bytes()
    assert drew and "disagreed" not in caplog.text
    assert captured_numpy_bytes() == expected_numpy_bytes()


PY_OPS = st.one_of(
    st.tuples(st.just("seed"), st.integers(0, 2**64)),
    st.tuples(st.just("random"), st.integers(0, 700)),  # past 624 words: the state is regenerated
    st.tuples(st.just("gauss"), st.integers(0, 3)),  # leaves gauss_next set (or clears it)
    st.tuples(st.just("bits"), st.integers(1, 20000)),
)


@pytest.fixture()
def keep_python_state():
    saved = random.getstate()
    yield
    random.setstate(saved)


@settings(max_examples=60, deadline=None)
@given(st.lists(PY_OPS, min_size=1, max_size=12))
def test_python_capture_matches_getstate_after_any_draws(keep_python_state: None,
                                                         ops: list[tuple[str, int]]) -> None:
    """lowdiff reads ``random``'s state from the generator's memory (lowdiff/rng.py): the bytes must be those of
    ``random.getstate()`` in every state, and restoring them must repeat the draws."""
    for op, arg in ops:
        if op == "seed":
            random.seed(arg)
        elif op == "random":
            for _ in range(arg):
                random.random()
        elif op == "gauss":
            for _ in range(arg):
                random.gauss(0.0, 1.0)
        else:
            random.getrandbits(arg)
        state = lowdiff_rng.capture()
        assert bytes(state[lowdiff_rng.PYTHON].numpy()) == _python_bytes(random.getstate())
    first = [random.gauss(0.0, 1.0), random.random()]
    lowdiff_rng.restore(state)
    assert [random.gauss(0.0, 1.0), random.random()] == first


def _python_bytes(state: tuple) -> bytes:
    _, words, gauss_next = state
    return b"".join(w.to_bytes(4, "little") for w in words) + int(gauss_next is not None).to_bytes(8, "little") \
        + np.float64(0.0 if gauss_next is None else gauss_next).astype("<f8").tobytes()


def test_capture_raw_keeps_the_bytes_it_made_its_tensors_from_and_capture_saves_as_a_plain_dict(
        tmp_path: Path) -> None:
    state = lowdiff_rng.capture_raw()
    raw = state.raw
    assert raw.keys() == state.keys()
    assert all(bytes(state[k].numpy()) == v for k, v in raw.items())
    torch.save(lowdiff_rng.capture(), tmp_path / "rng.pt")  # loads with torch.load's default weights_only=True
    loaded = torch.load(tmp_path / "rng.pt")
    assert type(loaded) is dict and loaded.keys() == raw.keys()


def test_capture_raw_makes_its_tensors_on_first_use_and_reads_as_a_dict_every_way() -> None:
    """The tensors of a capture are made when first read (a step's record sends the bytes, so most are never
    made); every way of reading the mapping sees them, copies and pickles are plain dicts, and a change to the
    mapping stops its bytes from standing for it (lowdiff._persist.messages sends them as the record's state)."""
    raw = lowdiff_rng.capture_raw().raw
    views = {
        "dict()": lambda s: dict(s), "unpacking": lambda s: {**s}, "copy()": lambda s: s.copy(),
        "items()": lambda s: dict(s.items()), "[]": lambda s: {k: s[k] for k in raw},
        "get()": lambda s: {k: s.get(k) for k in raw}, "pickle": lambda s: pickle.loads(pickle.dumps(s)),
        "copy.copy": copy.copy, "deepcopy": copy.deepcopy,
        "values()": lambda s: dict(zip(raw, s.values())), "|": lambda s: s | {}, "| (right)": lambda s: {} | s,
        "reversed()": lambda s: {k: s[k] for k in reversed(list(reversed(s)))},
    }
    for how, view in views.items():
        state = lowdiff_rng.Captured(dict(raw))
        assert len(state) == len(raw) and list(state) == list(raw) and all(k in state for k in raw), how
        got = view(state)
        assert type(got) is dict and list(got) == list(raw), how
        assert all(bytes(got[k].numpy()) == v for k, v in raw.items()), how
        assert state.unchanged_raw() is state.raw, how
    state = lowdiff_rng.Captured(dict(raw))
    state["extra"] = torch.zeros(1, dtype=torch.uint8)
    assert state.unchanged_raw() is None and list(state) == [*raw, "extra"] and len(state) == len(raw) + 1
    state = lowdiff_rng.Captured(dict(raw))
    del state[next(iter(raw))]
    assert state.unchanged_raw() is None and len(state) == len(raw) - 1


FAST_READS_EXPECTED = (sys.byteorder == "little" and sys.maxsize > 2**32 and sys.implementation.name == "cpython"
                       and getattr(sys, "_is_gil_enabled", lambda: True)())


@pytest.mark.skipif(not FAST_READS_EXPECTED, reason="the direct reads apply to 64-bit little-endian CPython with a GIL")
def test_captures_read_the_generators_directly_not_through_get_state(monkeypatch: pytest.MonkeyPatch,
                                                                    keep_python_state: None) -> None:
    """The per-step capture reads numpy's and Python's states from the generators' memory (30-70 us a step less on
    fast steps than get_state() / getstate(), which build 624 Python ints). Where it applies it must stay in use: a
    change that made it fall back for good would pass every exactness test and cost every step."""
    calls = {"numpy": 0, "python": 0}
    real_np, real_py = np.random.get_state, random.getstate

    def np_get_state(self: np.random.RandomState, legacy: bool = True) -> object:
        calls["numpy"] += 1
        return real_np(legacy=legacy)

    def py_getstate(self: random.Random) -> object:
        calls["python"] += 1
        return real_py()

    monkeypatch.setattr(np.random, "get_state", types.MethodType(np_get_state, real_np.__self__))
    monkeypatch.setattr(random, "getstate", types.MethodType(py_getstate, real_py.__self__))
    lowdiff_rng.capture()  # the first read of each may check itself against the documented call
    np.random.random_sample(3)
    random.random()
    before = dict(calls)
    for _ in range(200):
        state = lowdiff_rng.capture()
    assert calls["numpy"] - before["numpy"] <= 1 and calls["python"] - before["python"] <= 1, calls  # periodic check
    assert bytes(state[lowdiff_rng.NUMPY].numpy()) == expected_numpy_bytes()
    assert bytes(state[lowdiff_rng.PYTHON].numpy()) == _python_bytes(real_py())


def test_a_capture_after_a_full_cycle_of_draws_is_not_the_last_one_again(keep_python_state: None) -> None:
    """The direct reads reuse the state they made last when the generator's memory is unchanged. A full cycle of
    624 words (312 doubles) leaves numpy's position and Python's index where they were with every word of the state
    regenerated: only a comparison of the whole memory tells the two apart. Every capture, repeated or not, must
    equal the documented states (torch's included, copied out of its tensor)."""
    np.random.seed(3)
    random.seed(3)
    for draws in (0, 0, 312, 0, 312, 1, 0, 624):
        np.random.random_sample(draws)
        for _ in range(draws):
            random.random()
        for _ in range(2):
            state = lowdiff_rng.capture_raw()
            assert state.raw[lowdiff_rng.NUMPY] == expected_numpy_bytes(), draws
            assert state.raw[lowdiff_rng.PYTHON] == _python_bytes(random.getstate()), draws
            assert state.raw[lowdiff_rng.TORCH] == bytes(torch.get_rng_state().numpy()), draws
        torch.rand(draws)
