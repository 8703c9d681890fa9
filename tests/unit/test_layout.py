"""Sharded layouts (format 2.3, FORMAT.md section 9): the rows each rank holds, the view of a layout's stored
tensors, joining shards back, and the manifest's ``sharding`` object read as untrusted input."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowdiff._storage import layout
from lowdiff._storage.manifest import Manifest, TensorSpec, read_manifest, write_manifest
from lowdiff.errors import CorruptFileError


@given(st.integers(0, 300), st.integers(1, 9))
def test_chunk_bounds_are_torch_chunk_rows(size: int, count: int) -> None:
    bounds = layout.chunk_bounds(size, count)
    chunks = torch.arange(size).chunk(count) if size else ()
    lengths = [len(c) for c in chunks] + [0] * (count - len(chunks))
    assert [ln for _, ln in bounds] == lengths
    assert [o for o, _ in bounds] == [min(sum(lengths[:i]), size) for i in range(count)]


def _manifest(count: int = 2) -> Manifest:
    params = [TensorSpec("w", (5, 3), "float32", True), TensorSpec("b", (1,), "float32", True)]
    m = Manifest(params=params, buffers=[], state_dict_keys=[("w", "w"), ("b", "b")],
                 optimizer_class="torch.optim.adamw.AdamW", optimizer_defaults={"lr": 0.1}, param_groups=[["w", "b"]])
    m.sharding = {"dim": 0, "layouts": [layout.layout_json({p.name: p.shape for p in params}, count)]}
    return m


def test_view_lists_each_shard_and_unshard_joins_them() -> None:
    m = _manifest(2)
    v = layout.view(m, 2)
    assert [(p.name, p.shape) for p in v.params] == [("w#0-of-2", (3, 3)), ("w#1-of-2", (2, 3)),
                                                     ("b#0-of-2", (1,)), ("b#1-of-2", (0,))]
    assert v.param_groups == [["w#0-of-2", "w#1-of-2", "b#0-of-2", "b#1-of-2"]] and v.layout == 2
    assert layout.view(m, 1) is m and layout.view(m, 3) is m
    w, b = torch.randn(5, 3), torch.randn(1)
    params = {"w#0-of-2": w[:3], "w#1-of-2": w[3:], "b#0-of-2": b, "b#1-of-2": b[:0]}
    step = torch.tensor(4.0)
    opt = {n: {"exp_avg": t * 2, "step": step} for n, t in params.items()}
    comp = {"w#0-of-2": {"residual": w[:3].reshape(-1), "q": torch.ones(3, 1)},
            "w#1-of-2": {"residual": w[3:].reshape(-1), "q": torch.zeros(3, 1)}}
    p, o, c = layout.unshard(m, 2, params, opt, comp)
    assert torch.equal(p["w"], w) and torch.equal(p["b"], b)
    assert torch.equal(o["w"]["exp_avg"], w * 2) and o["w"]["step"] is step
    assert torch.equal(c["w"]["residual"], w.reshape(-1))  # flat per-element state joins flat
    assert torch.equal(c["w#1-of-2"]["q"], torch.zeros(3, 1))  # per-shard state keeps its shard's name
    assert torch.equal(layout.rows(c["w"]["residual"], (5, 3), 3, 2), w[3:].reshape(-1))
    assert torch.equal(layout.rows(w, (5, 3), 3, 2), w[3:])


def _forge(run: Path, sharding: object) -> None:
    doc = json.loads((run / "manifest.json").read_text())
    doc.pop("crc32")
    doc["sharding"] = sharding
    doc["crc32"] = zlib.crc32(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    (run / "manifest.json").write_text(json.dumps(doc))


GOOD = {"dim": 0, "layouts": [{"mesh_size": 2, "shards": {"w": [[0, 3], [3, 2]], "b": [[0, 1], [1, 0]]}}]}


@pytest.mark.parametrize("bad", [
    {"dim": 1, "layouts": GOOD["layouts"]},
    {"dim": 0, "layouts": []},
    {"dim": 0, "layouts": [{"mesh_size": 1, "shards": GOOD["layouts"][0]["shards"]}]},
    {"dim": 0, "layouts": [GOOD["layouts"][0], GOOD["layouts"][0]]},
    {"dim": 0, "layouts": [{"mesh_size": 2, "shards": {"w": [[0, 3], [3, 2]]}}]},
    {"dim": 0, "layouts": [{"mesh_size": 2, "shards": {"w": [[0, 2], [2, 3]], "b": [[0, 1], [1, 0]]}}]},
    {"dim": 0, "layouts": [{"mesh_size": True, "shards": GOOD["layouts"][0]["shards"]}]},
    "sharded",
])
def test_a_forged_sharding_is_refused(tmp_path: Path, bad: object) -> None:
    write_manifest(tmp_path, _manifest())
    assert read_manifest(tmp_path).sharding == GOOD
    _forge(tmp_path, bad)
    with pytest.raises(CorruptFileError, match="shard"):
        read_manifest(tmp_path)


def test_a_sharded_run_of_a_coupled_optimizer_is_refused(tmp_path: Path) -> None:
    import dataclasses

    import lowdiff

    write_manifest(tmp_path, dataclasses.replace(_manifest(), optimizer_class="torch.optim.adafactor.Adafactor"))
    with pytest.raises(lowdiff.UnsupportedError, match="element-wise"):
        lowdiff.recover(tmp_path)


def test_split_cuts_a_whole_snapshot_back_into_shards() -> None:
    from lowdiff._storage.snapshot import SnapshotState

    m = _manifest(2)
    w, b = torch.randn(5, 3), torch.randn(1)
    step = torch.tensor(3.0)
    state = SnapshotState(step=7, params={"w": w, "b": b}, buffers={"x": torch.ones(2)},
                          optimizer_state={"w": {"exp_avg": w * 2, "step": step}, "b": {"exp_avg": b, "step": step}},
                          param_groups=[{"lr": 0.1, "params": ["w", "b"]}],
                          compressor_state={"w": {"residual": w.reshape(-1)}, "w#1-of-2": {"q": torch.ones(3, 1)}},
                          rng={"torch": torch.zeros(4, dtype=torch.uint8)})
    parts = layout.split(m, state, 2)
    assert [sorted(p.params) for p in parts] == [["b#0-of-2", "w#0-of-2"], ["b#1-of-2", "w#1-of-2"]]
    assert torch.equal(parts[1].params["w#1-of-2"], w[3:]) and parts[1].params["b#1-of-2"].shape == (0,)
    assert torch.equal(parts[0].optimizer_state["w#0-of-2"]["exp_avg"], w[:3] * 2)
    assert parts[1].optimizer_state["w#1-of-2"]["step"] is step
    assert torch.equal(parts[1].compressor_state["w#1-of-2"]["residual"], w[3:].reshape(-1))
    assert torch.equal(parts[1].compressor_state["w#1-of-2"]["q"], torch.ones(3, 1))
    assert parts[0].buffers and parts[0].rng and not parts[1].buffers and not parts[1].rng
    assert parts[0].param_groups == [{"lr": 0.1, "params": ["w#0-of-2", "w#1-of-2", "b#0-of-2", "b#1-of-2"]}]
