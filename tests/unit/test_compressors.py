"""Compressor invariants (hypothesis): exact Top-k selection, decode and error feedback; PowerSGD shapes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowdiff import CorruptFileError
from lowdiff._compressors import decode_payload, make_compressor, powersgd, topk
from lowdiff._compressors.identity import IdentityCompressor
from lowdiff._storage.segment import kept

shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)
ratios = st.sampled_from([0.01, 0.1, 0.3, 0.5, 0.99, 1.0])


def _tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _distinct(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """n values with pairwise distinct magnitudes (a permutation of 1..n with random signs)."""
    g = torch.Generator().manual_seed(seed)
    mags = (torch.randperm(n, generator=g) + 1).to(dtype)
    signs = torch.randint(0, 2, (n,), generator=g).to(dtype) * 2 - 1
    return mags * signs


# --- Top-k ---------------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3000), frac=st.floats(0.0, 1.0),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_select_topk_equals_torch_topk_on_distinct_values(seed: int, n: int, frac: float, dtype) -> None:
    x = _distinct(seed, n, dtype)
    k = max(1, min(n, round(frac * n)))
    got = topk.select_topk(x, k)
    assert got.tolist() == sorted(got.tolist()), "indices must be sorted ascending"
    assert set(got.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


@settings(max_examples=8)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1 << 16, (1 << 16) + 5000),
       ratio=st.sampled_from([0.001, 0.01, 0.05, 0.1]))
def test_select_topk_sampled_path_is_exact(seed: int, n: int, ratio: float) -> None:
    """Large tensors take the sampled-threshold path; the selected set must still be the exact top-k."""
    x = _distinct(seed, n, torch.float32)
    k = topk.k_for(n, ratio)
    gen = torch.Generator().manual_seed(seed)
    for ws in (None, topk.Workspace()):
        got = topk.select_topk(x, k, gen, ws)
        assert got.numel() == k and bool((got[1:] > got[:-1]).all())
        assert set(got.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 5000), density=st.sampled_from([0.0, 0.001, 0.02, 0.5, 1.0]))
def test_nonzero_flat_equals_torch_nonzero(seed: int, n: int, density: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=gen) < density
    got = topk.nonzero_flat(mask)
    assert got.dtype == torch.int64 and torch.equal(got, torch.nonzero(mask).flatten())
    if n > 8:  # a view that does not start at a word boundary
        assert torch.equal(topk.nonzero_flat(mask[3:]), torch.nonzero(mask[3:]).flatten())


def test_topk_workspace_is_reused_and_grows() -> None:
    ws = topk.Workspace()
    a = ws.take(100, torch.float32, torch.device("cpu"))
    b = ws.take(50, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.numel() == 50
    assert ws.take(200, torch.float32, torch.device("cpu")).numel() == 200


@given(numel=st.integers(0, 10_000), ratio=st.floats(1e-6, 1.0))
def test_k_for_bounds(numel: int, ratio: float) -> None:
    k = topk.k_for(numel, ratio)
    assert k >= 1 and (k <= numel or numel == 0) and k >= min(numel, math.ceil(ratio * numel))


@given(seed=st.integers(0, 10_000), shape=shapes, ratio=ratios, dtype=st.sampled_from([torch.float32, torch.float64,
                                                                                   torch.float16, torch.bfloat16]))
def test_topk_decode_has_exactly_the_selected_values(seed: int, shape, ratio: float, dtype) -> None:
    grad = _tensor(seed, shape, dtype)
    c = make_compressor("topk", ratio=ratio)
    payload = c.compress("w", grad)
    assert set(payload) == {"values", "indices"}
    idx, values = payload["indices"], payload["values"]
    assert idx.dtype == torch.int32 and values.dtype == dtype
    assert idx.numel() == values.numel() == topk.k_for(grad.numel(), ratio)
    assert bool((idx[1:] > idx[:-1]).all()), "indices must be unique and sorted"
    dec = decode_payload(payload, grad.shape)
    assert dec.shape == grad.shape and dec.dtype == dtype
    flat = dec.reshape(-1)
    assert torch.equal(flat[idx.long()], values)
    assert torch.equal(values, grad.reshape(-1)[idx.long()]), "first step: values are the gradient's own"
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    mask[idx.long()] = False
    assert bool((flat[mask] == 0).all())
    # Selected are the largest magnitudes: nothing left out is bigger than anything kept.
    if mask.any():
        assert grad.reshape(-1)[mask].abs().max() <= values.abs().min()


@given(seed=st.integers(0, 10_000), shape=shapes, ratio=ratios, steps=st.integers(1, 5))
def test_topk_error_feedback_is_exact(seed: int, shape, ratio: float, steps: int) -> None:
    """residual_t + decoded_t == gradient_t + residual_{t-1}, bit for bit, at every step."""
    c = make_compressor("topk", ratio=ratio)
    residual = torch.zeros(shape).reshape(-1)
    for t in range(steps):
        grad = _tensor(seed + t, shape)
        acc = grad.reshape(-1) + residual if t else grad.reshape(-1).clone()
        dec = decode_payload(c.compress("w", grad), shape)
        residual = c.state_dict()["w"]["residual"].clone()
        assert torch.equal(residual + dec.reshape(-1), acc)
        assert bool((residual[dec.reshape(-1) != 0] == 0).all())


@given(seed=st.integers(0, 2**31 - 1), numel=st.integers(1, 200), world=st.integers(2, 4), frac=st.floats(0.0, 1.0))
def test_topk_merge_of_ranks_drops_repeats_on_the_host_to_the_sorted_union(seed: int, numel: int, world: int,
                                                                            frac: float) -> None:
    """Under DDP the merged payload keeps every rank's entries (no device sync for the union's size); the segment
    writer's ``kept`` makes it the sorted union with each index's average over ranks, and both decode to the dense
    average the optimizer consumes."""
    g = torch.Generator().manual_seed(seed)
    k = max(1, round(frac * numel))
    values = [torch.randn(k, generator=g) for _ in range(world)]
    indices = [torch.randperm(numel, generator=g)[:k].to(torch.int32) for _ in range(world)]
    payload, dense = topk.merge_gathered(values, indices, numel, world)
    assert all(t.numel() == world * k for t in payload.values())
    got = kept(payload)
    union = torch.unique(torch.cat(indices).long())
    want = torch.zeros(numel)
    for v, i in zip(values, indices):
        want.index_add_(0, i.long(), v)
    want.div_(world)
    assert torch.equal(got["indices"], union.to(torch.int32)) and torch.equal(got["values"], want[union])
    assert torch.equal(dense, want)
    assert torch.equal(topk.decode(got["values"], got["indices"], (numel,)), want)


def test_topk_without_error_feedback_keeps_no_residual() -> None:
    c = make_compressor("topk", ratio=0.25, error_feedback=False)
    g = _tensor(1, (4, 4))
    p1, p2 = c.compress("w", g), c.compress("w", g)
    assert c.state_dict() == {}
    assert torch.equal(p1["values"], p2["values"]) and torch.equal(p1["indices"], p2["indices"])


def test_topk_state_round_trip_continues_identically() -> None:
    a = make_compressor("topk", ratio=0.2)
    a.compress("w", _tensor(0, (6, 5)))
    b = make_compressor("topk", ratio=0.2)
    b.load_state_dict({k: {n: t.clone() for n, t in v.items()} for k, v in a.state_dict().items()})
    g = _tensor(1, (6, 5))
    pa, pb = a.compress("w", g), b.compress("w", g)
    assert torch.equal(pa["values"], pb["values"]) and torch.equal(pa["indices"], pb["indices"])


@pytest.mark.parametrize("payload, shape", [
    ({"values": torch.ones(3), "indices": torch.tensor([0, 1], dtype=torch.int32)}, (4,)),
    ({"values": torch.ones(1), "indices": torch.tensor([4], dtype=torch.int32)}, (4,)),
    ({"values": torch.ones(1), "indices": torch.tensor([-1], dtype=torch.int32)}, (4,)),
    ({"full": torch.ones(5)}, (2, 2)),
    ({"p": torch.ones(3, 2), "q": torch.ones(4, 1)}, (3, 4)),
    ({"p": torch.ones(3, 2), "q": torch.ones(4, 2)}, (3, 5)),
    ({"bogus": torch.ones(1)}, (1,)),
])
def test_decode_rejects_inconsistent_payloads(payload, shape) -> None:
    with pytest.raises(CorruptFileError):
        decode_payload(payload, shape)


# --- PowerSGD ------------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 10_000), shape=st.lists(st.integers(1, 12), min_size=2, max_size=4).map(tuple),
       rank=st.integers(1, 4), steps=st.integers(1, 3))
def test_powersgd_payload_and_decode_shape(seed: int, shape, rank: int, steps: int) -> None:
    c = make_compressor("powersgd", rank=rank)
    dims = powersgd.factor_shapes(shape, rank)
    for t in range(steps):
        grad = _tensor(seed + t, shape)
        payload = c.compress("w", grad)
        dec = decode_payload(payload, shape)
        assert dec.shape == torch.Size(shape) and dec.dtype == grad.dtype
        if dims is None:
            assert set(payload) == {"full"} and torch.equal(dec, grad)
            continue
        n, m, r = dims
        assert n * m == grad.numel() and (n + m) * r < n * m
        assert set(payload) == {"p", "q"}
        assert payload["p"].shape == (n, r) and payload["q"].shape == (m, r)
        # decode is the documented sum of rank-1 products in order, bit for bit, and deterministic.
        p, q = payload["p"], payload["q"]
        expected = p[:, 0:1] * q[:, 0].unsqueeze(0)
        for i in range(1, r):
            expected = expected + p[:, i : i + 1] * q[:, i].unsqueeze(0)
        assert torch.equal(dec, expected.reshape(shape))
        assert torch.equal(dec, decode_payload(payload, shape))
        assert torch.equal(c.state_dict()["w"]["q"], q)


@given(seed=st.integers(0, 10_000), n=st.integers(1, 50), rank=st.integers(1, 4))
def test_powersgd_sends_1d_tensors_full(seed: int, n: int, rank: int) -> None:
    c = make_compressor("powersgd", rank=rank)
    grad = _tensor(seed, (n,))
    payload = c.compress("b", grad)
    assert set(payload) == {"full"}
    assert torch.equal(payload["full"], grad) and payload["full"] is not grad
    assert torch.equal(decode_payload(payload, (n,)), grad)
    assert "b" not in c.state_dict(), "uncompressed tensors keep no residual or Q"


def test_powersgd_small_matrix_is_sent_full() -> None:
    # (n + m) * r >= n * m: factors would not be smaller.
    assert powersgd.factor_shapes((2, 2), 2) is None
    assert powersgd.factor_shapes((3,), 2) is None
    assert powersgd.factor_shapes((8, 16), 2) == (8, 16, 2)
    assert powersgd.factor_shapes((8, 3, 3, 3), 4) == (8, 27, 4)


def test_powersgd_initial_q_is_seeded_by_name() -> None:
    a, b = make_compressor("powersgd", rank=2), make_compressor("powersgd", rank=2)
    g = _tensor(3, (10, 12))
    pa, pb = a.compress("layer.weight", g), b.compress("layer.weight", g)
    assert torch.equal(pa["p"], pb["p"]) and torch.equal(pa["q"], pb["q"])


def test_powersgd_state_round_trip_continues_identically() -> None:
    a = make_compressor("powersgd", rank=2)
    a.compress("w", _tensor(0, (10, 12)))
    b = make_compressor("powersgd", rank=2)
    b.load_state_dict({k: {n: t.clone() for n, t in v.items()} for k, v in a.state_dict().items()})
    g = _tensor(1, (10, 12))
    pa, pb = a.compress("w", g), b.compress("w", g)
    assert torch.equal(pa["p"], pb["p"]) and torch.equal(pa["q"], pb["q"])


def test_identity_payload_is_the_gradient() -> None:
    c = IdentityCompressor()
    g = _tensor(0, (3, 4))
    payload = c.compress("w", g)
    assert set(payload) == {"full"} and torch.equal(decode_payload(payload, (3, 4)), g)
    assert c.state_dict() == {}
    with pytest.raises(ValueError):
        c.load_state_dict({"w": {"residual": torch.zeros(1)}})


def test_make_compressor_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown compressor"):
        make_compressor("dgc")


class _ReferencePowerSGD:
    """PowerSGD as first written (format v1): one fresh tensor per operation, whole matrices. Logs written by
    that code must replay bit for bit, so the block-wise, in-place compressor must match it exactly."""

    def __init__(self, rank: int) -> None:
        self.rank, self.residual, self.q = rank, {}, {}

    def compress(self, fqn: str, grad: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, m, r = powersgd.factor_shapes(grad.shape, self.rank)
        matrix = grad.reshape(n, m)
        if fqn in self.residual:
            matrix = matrix + self.residual[fqn]
        q = self.q.get(fqn)
        if q is None:
            q = powersgd.PowerSGDCompressor(rank=self.rank).initial_q(fqn, m, r, matrix)
        p = matrix @ q
        powersgd.orthogonalize(p)
        q = matrix.T @ p
        self.q[fqn] = q.clone()
        dec = p[:, 0:1] * q[:, 0].unsqueeze(0)
        for i in range(1, r):
            dec = dec + p[:, i : i + 1] * q[:, i].unsqueeze(0)
        self.residual[fqn] = matrix - dec
        return {"p": p, "q": q}, dec.reshape(grad.shape)


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(8, 16), (33, 10), (70, 3, 3), (9, 200), (130, 65)]),
       rank=st.integers(1, 4), block=st.sampled_from([1, 7, 64, 1000, 1 << 16]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_powersgd_blockwise_in_place_matches_the_reference(seed: int, shape, rank: int, block: int, dtype) -> None:
    """Blocks of any size (one row, several, a partial last one, the whole matrix), over steps with error
    feedback: the payload, the decoded gradient and the residual are those of the reference, bit for bit."""
    c, ref = powersgd.PowerSGDCompressor(rank=rank, block_elems=block), _ReferencePowerSGD(rank)
    for t in range(3):
        grad = _tensor(seed + t, shape, dtype)
        kept = grad.clone()
        payload, dec = c.compress_decode("w", grad)
        want, want_dec = ref.compress("w", grad)
        assert torch.equal(grad, kept), "the caller's gradient is not changed"
        assert torch.equal(payload["p"], want["p"]) and torch.equal(payload["q"], want["q"])
        assert dec.dtype == want_dec.dtype and torch.equal(dec, want_dec)
        assert torch.equal(c.state_dict()["w"]["residual"], ref.residual["w"])
        assert torch.equal(decode_payload(payload, shape), want_dec)


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_a_residual_that_does_not_match_its_gradient_is_an_error(name: str) -> None:
    """The residual is updated in place with the gradient added: a mismatch (state loaded for another model, or
    onto another device) must not be silently reset or broadcast."""
    c = make_compressor(name, ratio=0.25, rank=2)
    c.compress("w", _tensor(0, (10, 12)))
    state = c.state_dict()
    c.load_state_dict({"w": {k: (v.double() if k == "residual" else v) for k, v in state["w"].items()}})
    with pytest.raises(ValueError, match="residual of 'w'"):
        c.compress("w", _tensor(1, (10, 12)))


def test_powersgd_payloads_in_reused_step_buffers_are_the_fresh_payloads_bit_for_bit() -> None:
    """PowerSGD between ``begin_step`` and ``end_step`` writes P and Q (``torch.matmul(..., out=)`` into slices of
    one flat) and copies the tensors it sends whole there: every payload, every decoded gradient and the
    compressor's state equal a twin's that returns fresh tensors, bit for bit, through steps where a parameter has no
    gradient and a step that needs more room than the buffers have. A tensor sent whole is decoded as the gradient
    itself, never as a view of the buffers (the next step writes them again)."""
    shapes = {"a": (300, 40), "b": (40, 10, 3), "c": (7,), "d": (64, 2), "e": (128, 96)}
    reused, fresh = make_compressor("powersgd", rank=3), make_compressor("powersgd", rank=3)
    full = ["a", "b", "c", "d"]
    plan = [full, full, ["a", "c"], full, full + ["e"], full + ["e"]]
    versions: list[int | None] = []
    for step, names in enumerate(plan):
        grads = {n: _tensor(step * 10 + i, shapes[n]) for i, n in enumerate(names)}
        reused.begin_step()
        got = {n: reused.compress_decode(n, g) for n, g in grads.items()}
        flats = reused.end_step()
        want = {n: fresh.compress_decode(n, g) for n, g in grads.items()}
        for n in names:
            assert sorted(got[n][0]) == sorted(want[n][0])
            for f in got[n][0]:
                assert torch.equal(got[n][0][f], want[n][0][f]), (step, n, f)
            assert torch.equal(got[n][1], want[n][1]), (step, n)
            if "full" in got[n][0]:
                assert got[n][1] is grads[n]
        versions.append(None if flats is None else flats.version)
        if flats is not None:
            assert flats.names == names and list(flats.flats) == [torch.float32]
            parts = [p[f].reshape(-1) for p, _ in got.values() for f in p]
            assert torch.equal(flats.flats[torch.float32], torch.cat(parts))
    assert versions[0] is None and versions[4] is None
    assert versions[1] != versions[2] != versions[3] != versions[5] and None not in versions[1:4] + versions[5:]
    a, b = reused.state_dict(), fresh.state_dict()
    assert sorted(a) == sorted(b)
    for n in a:
        for k in a[n]:
            assert torch.equal(a[n][k], b[n][k]), (n, k)


def test_topk_payloads_in_reused_step_buffers_are_the_fresh_payloads_bit_for_bit() -> None:
    """Between ``begin_step`` and ``end_step`` Top-k writes its payloads one after the other into buffers it reuses
    at the next step (``StepPayloads``). Every payload equals, bit for bit, the one a twin compressor returns as
    fresh tensors, through steps where a parameter has no gradient, a bfloat16 parameter, and steps that need more
    room than the buffers have (then ``end_step`` is None and the buffers are replaced). Where ``end_step`` gives
    flats, they hold the step's payloads one after the other, and its version changes exactly when the sequence of
    payloads does."""
    shapes = {"a": (300,), "b": (40, 50), "c": (7,), "h": (64,), "d": (900,)}
    dtypes = {"h": torch.bfloat16}
    reused, fresh = make_compressor("topk", ratio=0.1), make_compressor("topk", ratio=0.1)
    full = ["a", "b", "c", "h"]
    plan = [full, full, ["a", "c", "h"], ["a", "c", "h"], full, full, ["b"], full + ["d"], full + ["d"]]
    versions: list[int | None] = []
    for step, names in enumerate(plan):
        grads = {n: _tensor(step * 10 + i, shapes[n], dtypes.get(n, torch.float32)) for i, n in enumerate(names)}
        reused.begin_step()
        got = {n: reused.compress(n, g) for n, g in grads.items()}
        flats = reused.end_step()
        want = {n: fresh.compress(n, g) for n, g in grads.items()}
        for n in names:
            for f in ("values", "indices"):
                assert got[n][f].dtype == want[n][f].dtype and torch.equal(got[n][f], want[n][f]), (step, n, f)
        if flats is None:
            versions.append(None)
            continue
        assert flats.names == names
        for dt, flat in flats.flats.items():
            parts = [p[f] for p in got.values() for f in ("values", "indices") if p[f].dtype == dt]
            assert torch.equal(flat, torch.cat(parts))
            assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in parts)
        versions.append(flats.version)
    # Step 0 found no buffers and step 7 buffers too small (a new parameter): fresh tensors past that point.
    v = versions
    assert v[0] is None and v[7] is None and None not in v[1:7] + v[8:]
    assert v[1] != v[2] == v[3] != v[4] == v[5] != v[6] != v[8] and len(set(v[1:7] + v[8:])) == 5
    # Outside begin_step/end_step: fresh tensors, never written again.
    g = _tensor(99, shapes["a"])
    out = reused.compress("a", g)
    before = out["values"].clone()
    reused.begin_step()
    reused.compress("a", _tensor(100, shapes["a"]))
    reused.end_step()
    assert torch.equal(out["values"], before)
