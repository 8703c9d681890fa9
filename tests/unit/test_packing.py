"""lowdiff._transfer.packing: a step's tensors packed into one host buffer and read back as views, bit for bit; the
layout is reused while nothing changes and replaced when anything does; the layouts a persistence process keeps are
bounded."""

from __future__ import annotations

import pytest
import torch

from lowdiff._storage.packed import unpack
from lowdiff._transfer.packing import KNOWN_LAYOUTS, StepPacker, pack_host, remember


def _step(k: int) -> tuple[list[tuple[str, str]], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(k)
    keys = [("w", "values"), ("w", "indices"), ("b", "p"), ("b", "q"), ("", "bn.running_mean")]
    tensors = [torch.randn(7, generator=g), torch.randint(0, 100, (7,), generator=g),
               torch.randn(5, 2, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g),
               torch.randn(4, generator=g)]
    return keys, tensors


def test_packed_step_reads_back_bit_for_bit() -> None:
    keys, tensors = _step(0)
    layout, new = StepPacker().plan(keys, tensors)
    assert layout is not None and new
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_host(layout, tensors, buf)
    grads, buffers = unpack(layout.wire, buf)
    assert list(grads) == ["w", "b"] and list(buffers) == ["bn.running_mean"]
    for (name, field), t in zip(keys, tensors):
        got = grads[name][field] if name else buffers[field]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    payload = sum(t.numel() * t.element_size() for (n, _), t in zip(keys, tensors) if n)
    assert layout.payload_nbytes == payload


def test_layout_is_reused_until_a_shape_or_key_changes() -> None:
    packer = StepPacker()
    keys, tensors = _step(0)
    first, _ = packer.plan(keys, tensors)
    same, new = packer.plan(*_step(1))
    assert same is first and not new
    changed, new = packer.plan(keys, [*tensors[:-1], torch.randn(5)])  # a buffer changed shape
    assert new and changed is not None and first is not None and changed.id != first.id
    fewer, new = packer.plan(keys[1:], tensors[1:])  # a parameter without a gradient this step
    assert new and fewer is not None and fewer.id != changed.id


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tensors_on_two_devices_are_not_packed_together() -> None:
    layout, _ = StepPacker().plan([("a", "x"), ("b", "x")], [torch.ones(2), torch.ones(2, device="cuda")])
    assert layout is None


def test_known_layouts_are_bounded_and_forget_the_oldest() -> None:
    known: dict[int, object] = {}
    for lid in range(1, KNOWN_LAYOUTS + 11):
        remember(known, lid, lid)
    assert len(known) == KNOWN_LAYOUTS and min(known) == 11 and max(known) == KNOWN_LAYOUTS + 10


def test_tensors_of_every_shape_and_stride_read_back_bit_for_bit() -> None:
    """Regions group tensors by dtype and row shape; 0-d tensors, zero-size dimensions, transposed and sliced
    (non-contiguous) tensors and several row shapes of one dtype all come back exactly, each in its shape."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g).t(), torch.randn(3, 5, generator=g),
               torch.tensor(2.5), torch.randn(9, generator=g)[::2], torch.empty(2, 0), torch.empty(0, 4),
               torch.randn(2, 3, 4, generator=g), torch.randint(0, 9, (5, 4), generator=g), torch.tensor(7),
               torch.randn(1, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g)[:, 1:3]]
    keys = [(f"p{i}", "x") for i in range(len(tensors))]
    layout, _ = StepPacker().plan(keys, tensors)
    assert layout is not None
    assert (torch.float32, (4,)) in {(layout.regions[r][0], rows) for r, rows in enumerate(layout.rows)}
    buf = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    pack_host(layout, tensors, buf)
    grads, _ = unpack(layout.wire, buf)
    for (name, field), t in zip(keys, tensors):
        got = grads[name][field]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_a_step_packed_from_its_compressors_flats_reads_back_the_same_tensors(name: str) -> None:
    """A compressor's payloads written one after the other into flats (lowdiff._compressors.base.StepPayloads:
    Top-k's values and indices; PowerSGD's 2-D factors and the tensors it sends whole, of several shapes in one
    flat) and packed by copying those, with changed buffers that share a region with a flat (a 0-d float32 one)
    and ones that do not (a float32 1-D, an int32, a 0-d int64): the writer reads back every tensor, bit for bit,
    as packing every tensor on its own gives them."""
    from lowdiff._compressors import make_compressor
    from lowdiff._transfer.packing import from_flats, layout_of

    comp = make_compressor(name, ratio=0.1, rank=2)
    grads = {"w": torch.randn(30, 20), "b": torch.randn(20), "c": torch.randn(4, 6, 5), "h": torch.randn(3, 2)}
    if name == "topk":
        grads["bf"] = torch.randn(16).to(torch.bfloat16)
    buffers = {"bn.running_mean": torch.randn(20), "pos": torch.arange(5, dtype=torch.int32),
               "bn.num_batches_tracked": torch.tensor(7), "scale": torch.tensor(0.5)}
    for _ in range(2):  # the first step finds no buffers yet
        comp.begin_step()
        payloads = {n: comp.compress(n, g) for n, g in grads.items()}
        flats = comp.end_step()
    assert flats is not None and flats.names == list(grads)
    keys = [(n, f) for n, p in payloads.items() for f in p] + [("", n) for n in buffers]
    tensors = [t for p in payloads.values() for t in p.values()] + list(buffers.values())
    n_payload = len(keys) - len(buffers)
    generic = layout_of(keys, tensors)
    flat = layout_of(keys, tensors, flat=n_payload)
    assert generic is not None and flat is not None
    # Regions of row shapes are not a compressor's flats: PowerSGD's (r,) rows beside its 1-D tensors.
    assert from_flats(generic, n_payload, {dt: f.numel() for dt, f in flats.flats.items()}) is None or name == "topk"
    planned = from_flats(flat, n_payload, {dt: f.numel() for dt, f in flats.flats.items()})
    assert planned is not None
    layout, order = planned
    want, got = torch.zeros(generic.nbytes, dtype=torch.uint8), torch.ones(layout.nbytes, dtype=torch.uint8)
    pack_host(generic, tensors, want)
    pack_host(layout, [flats.flats[dt] for dt in order] + list(buffers.values()), got)
    for a, b in zip(unpack(generic.wire, want), unpack(layout.wire, got)):
        assert list(a) == list(b)
        for k in a:
            x, y = a[k], b[k]
            for f in (x if isinstance(x, dict) else {"": x}):
                u, v = (x[f], y[f]) if f else (x, y)
                assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v), (k, f)
    # Flats that do not add up to the payloads' size: not packed that way.
    wrong = {dt: f.numel() + 1 for dt, f in flats.flats.items()}
    assert from_flats(flat, n_payload, wrong) is None
