"""The forged run directories of issue 20, one Case each: how to forge it from a pristine run, and what recovery
must do with it (an exact state, a reported fallback, or a clear refusal). ``lowdiff verify`` must flag every
case except the controls."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from forge import Forged, add_trailer, forge_manifest, load, manifest_doc, rewrite, save

STEPS = 10  # the pristine run: snapshots 0, 4, 8; segments 1-3, 4-6, 7-9, 10-10


def S(step: int) -> str:
    return f"snapshots/step-{step:010d}.h5"


def L(first: int, last: int) -> str:
    return f"log/steps-{first:010d}-{last:010d}.h5"


@dataclass
class Ctx:
    run: Path
    """The forged copy (pristine until the case's forge runs)."""
    others: dict[str, Path]
    """Pristine runs of the same model: "same" (another seed), "sgd" (optimizer SGD), "powersgd" (compressor)."""
    scratch: Path
    """A directory outside every run (external files, FIFOs)."""

    def p(self, rel: str) -> Path:
        return self.run / rel

    def other(self, which: str, rel: str) -> Path:
        return self.others[which] / rel

    @property
    def run_id(self) -> Any:
        return manifest_doc(self.run).get("run_id")


@dataclass(frozen=True)
class Expect:
    kind: str
    """"exact": recover() returns the exact state at ``step``; "refuse": it raises ``error`` naming ``names``."""
    step: int | None = None
    snapshot: int | None = None
    skipped: tuple[str, ...] = ()
    error: str = "CorruptFileError"
    names: str | None = None


def exact(step: int, snapshot: int | None = None, *skipped: str) -> Expect:
    return Expect("exact", step=step, snapshot=snapshot, skipped=skipped)


def refuse(names: str | None, error: str = "CorruptFileError") -> Expect:
    return Expect("refuse", error=error, names=names)


@dataclass(frozen=True)
class Case:
    name: str
    issue: str
    """The issue's category: wrong-state, hang, allocation, exception, fallback (or control)."""
    forge: Callable[[Ctx], None]
    expect: Expect
    target: int | None = None
    """The step asked of recover() (None: the latest)."""
    flagged: str | None = "default"
    """What `lowdiff verify` must name (it exits 1); "default": the skipped or refused file; "": nothing in
    particular; None: verify must pass (exit 0)."""
    base: str = "pristine"
    workers: int = 1

    def verify_names(self) -> str | None:
        if self.flagged != "default":
            return self.flagged
        return self.expect.skipped[0] if self.expect.skipped else self.expect.names


# --- forging helpers -----------------------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    shutil.copyfile(src, dst)


def _meta(rel: str, fn: Callable[[dict[str, Any]], Any]) -> Callable[[Ctx], None]:
    return lambda c: rewrite(c.p(rel), lambda f: fn(f.meta))


def _entries(rel: str, fn: Callable[[Forged], Any]) -> Callable[[Ctx], None]:
    return lambda c: rewrite(c.p(rel), fn)


def _set_run_id(rel: str, other: str) -> Callable[[Ctx], None]:
    def forge(c: Ctx) -> None:
        _copy(c.other(other, rel), c.p(rel))
        run_id = c.run_id
        rewrite(c.p(rel), lambda f: f.meta.__setitem__("run_id", run_id))
    return forge


def _col(f: Forged, name: str) -> np.ndarray:
    d = f.entry(name)
    return np.frombuffer(f.raw[name], dtype=np.dtype(d["dtype"])).copy()


def _topk(rel: str, fn: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
          param: str = "fc1.weight") -> Callable[[Ctx], None]:
    """Rewrite the first step's values/indices of ``param`` in segment ``rel``."""
    def edit(f: Forged) -> None:
        vname, iname = f"grad/{param}/values", f"grad/{param}/indices"
        v, i = _col(f, vname), _col(f, iname)
        n = f.entry(vname)["counts"][0]
        v0, i0 = fn(v[:n].copy(), i[:n].copy())
        v, i = np.concatenate([v0, v[n:]]), np.concatenate([i0.astype(i.dtype) if i0.dtype.kind == "i" and
                                                            i0.dtype.itemsize == i.dtype.itemsize else i0, i[n:]])
        counts = list(f.entry(vname)["counts"])
        counts[0] = len(v0)
        f.set_raw(vname, v.astype(v0.dtype).tobytes(), counts=counts, dtype=str(v0.dtype))
        icounts = list(f.entry(iname)["counts"])
        icounts[0] = len(i0)
        f.set_raw(iname, i.astype(i0.dtype).tobytes(), counts=icounts, dtype=str(i0.dtype))
    return _entries(rel, edit)


def _h5(rel: str, hook: Callable[[Ctx, h5py.File, bytes, bytes], None], **kw: Any) -> Callable[[Ctx], None]:
    def forge(c: Ctx) -> None:
        f = load(c.p(rel))
        save(c.p(rel), f, hook=lambda h, index, data: hook(c, h, index, data), **kw)
    return forge


def _index(h: h5py.File, index: bytes) -> None:
    import zlib

    ds = h.create_dataset("index", data=np.frombuffer(index, dtype=np.uint8))
    ds.attrs["crc32"] = zlib.crc32(index)


def _external_data(target: Callable[[Ctx, bytes], Path]) -> Callable[[Ctx, h5py.File, bytes, bytes], None]:
    def hook(c: Ctx, h: h5py.File, index: bytes, data: bytes) -> None:
        _index(h, index)
        ext = target(c, data)
        h.create_dataset("data", shape=(len(data),), dtype=np.uint8, external=[(str(ext), 0, h5py.h5f.UNLIMITED)])
    return hook


def _outside_file(c: Ctx, data: bytes) -> Path:
    p = c.scratch / "external-data.bin"
    p.write_bytes(data)
    return p


def _outside_fifo(c: Ctx, data: bytes) -> Path:
    p = c.scratch / "external-fifo"
    if not p.exists():
        os.mkfifo(p)
    return p


def _external_link_index(c: Ctx, h: h5py.File, index: bytes, data: bytes) -> None:
    h["index"] = h5py.ExternalLink(str(c.other("same", S(8))), "/index")
    h.create_dataset("data", data=np.frombuffer(data, dtype=np.uint8))


def _soft_link_index(c: Ctx, h: h5py.File, index: bytes, data: bytes) -> None:
    _index(h, index)
    h.move("index", "hidden")
    h["index"] = h5py.SoftLink("/hidden")
    h.create_dataset("data", data=np.frombuffer(data, dtype=np.uint8))


def _virtual_data(c: Ctx, h: h5py.File, index: bytes, data: bytes) -> None:
    _index(h, index)
    src = c.scratch / "vds-source.h5"
    with h5py.File(src, "w") as s:
        s.create_dataset("d", data=np.frombuffer(data, dtype=np.uint8))
    layout = h5py.VirtualLayout(shape=(len(data),), dtype=np.uint8)
    layout[:] = h5py.VirtualSource(str(src), "d", shape=(len(data),))
    h.create_virtual_dataset("data", layout)


def _chunked(name: str, n: int) -> Callable[[Ctx, h5py.File, bytes, bytes], None]:
    """Dataset ``name`` claims ``n`` bytes (chunked, nothing written: a 30 KB file)."""
    def hook(c: Ctx, h: h5py.File, index: bytes, data: bytes) -> None:
        if name == "index":
            ds = h.create_dataset("index", shape=(n,), dtype=np.uint8, chunks=(1 << 16,))
            import zlib

            ds.attrs["crc32"] = zlib.crc32(index)
            h.create_dataset("data", data=np.frombuffer(data, dtype=np.uint8))
        else:
            _index(h, index)
            h.create_dataset("data", shape=(n,), dtype=np.uint8, chunks=(1 << 16,))
    return hook


def _extra_dataset(c: Ctx, h: h5py.File, index: bytes, data: bytes) -> None:
    _index(h, index)
    h.create_dataset("data", data=np.frombuffer(data, dtype=np.uint8))
    h.create_dataset("evil", data=np.zeros(4, np.uint8))


def _huge_data_blob(c: Ctx) -> None:
    """The data dataset is declared 1 TB (sparse); the entries sit at its start."""
    path = c.p(S(8))
    f = load(path)
    holder: dict[str, int] = {}

    def hook(h: h5py.File, index: bytes, data: bytes) -> None:
        from lowdiff._storage.container import _allocate_data

        _index(h, index)
        holder["offset"] = _allocate_data(h, 1 << 40)
        holder["data"] = len(data)
        holder["bytes"] = data  # type: ignore[assignment]

    save(path, f, hook=hook)
    # save() appended a trailer for a blob-less file: redo it with the data declared.
    size = path.stat().st_size
    os.truncate(path, size - 40)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, holder["bytes"], holder["offset"])  # type: ignore[arg-type]
    finally:
        os.close(fd)
    add_trailer(path, (holder["offset"], 1 << 40))


def _sparse_trailer_covers_all(rel: str) -> Callable[[Ctx], None]:
    def forge(c: Ctx) -> None:
        p = c.p(rel)
        size = 1 << 40
        with open(p, "wb") as fh:
            fh.truncate(size - 40)
            fh.seek(size - 40)
            fh.write(struct.pack("<8sQQQI4x", b"LDIFFEND", size - 40, 0, 0, 0))
    return forge


def zstd_bomb(nbytes: int) -> bytes:
    """A zstd frame that declares and decompresses to ``nbytes`` zero bytes (a few KB per GB)."""
    import zstandard

    cobj = zstandard.ZstdCompressor(level=1).compressobj(size=nbytes)
    chunk = bytes(1 << 20)
    parts = [cobj.compress(chunk) for _ in range(nbytes >> 20)]
    parts.append(cobj.compress(bytes(nbytes & ((1 << 20) - 1))))
    parts.append(cobj.flush())
    return b"".join(parts)


_BOMB: list[bytes] = []


def _bomb(claim_counts: bool) -> Callable[[Forged], None]:
    """fc1.weight's Top-k values at step 10 stored as a 1 GB zstd bomb; ``claim_counts``: the descriptor claims
    the 2.5e8 float32 values it holds, else it keeps the true count (18) and only the frame lies."""
    def edit(f: Forged) -> None:
        if not _BOMB:
            _BOMB.append(zstd_bomb(1 << 30))
        name = f"grad/{F1}/values"
        if claim_counts:
            f.set_stored(name, _BOMB[0], codec="zstd", raw_nbytes=1 << 30, counts=[(1 << 30) // 4])
        else:
            f.set_stored(name, _BOMB[0], codec="zstd", raw_nbytes=len(f.raw[name]))
    return edit


def _fifo(rel: str) -> Callable[[Ctx], None]:
    return lambda c: os.mkfifo(c.p(rel))


def _socket(rel: str) -> Callable[[Ctx], None]:
    def forge(c: Ctx) -> None:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(c.p(rel)))
        s.close()
    return forge


def _symlink(rel: str, target: Callable[[Ctx], Path]) -> Callable[[Ctx], None]:
    def forge(c: Ctx) -> None:
        p = c.p(rel)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        p.symlink_to(target(c))
    return forge


def _moved_out(rel: str) -> Callable[[Ctx], None]:
    """The file moved outside the run directory, a symlink left in its place."""
    def forge(c: Ctx) -> None:
        outside = c.scratch / "moved-out.h5"
        shutil.move(c.p(rel), outside)
        c.p(rel).symlink_to(outside)
    return forge


def _sparse_manifest(c: Ctx) -> None:
    body = (c.run / "manifest.json").read_bytes()
    with open(c.run / "manifest.json", "wb") as fh:
        fh.write(body[:-1] + b" " * 16)
        fh.truncate(2 << 30)


def _deep_manifest(c: Ctx) -> None:
    depth = 200_000
    (c.run / "manifest.json").write_bytes(b'{"config": ' + b"[" * depth + b"]" * depth + b"}")


def _manifest(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Ctx], None]:
    return lambda c: forge_manifest(c.run, fn)


def _group(idx: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda meta: meta["param_groups"][idx].__setitem__(key, value)


def _step_group(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda meta: meta["steps"][0]["groups"][0].__setitem__(key, value)


def _state(rel: str, name: str, arr: np.ndarray, shape: list[int] | None = None) -> Callable[[Ctx], None]:
    return _entries(rel, lambda f: f.set_raw(name, arr.tobytes(), dtype=str(arr.dtype),
                                             shape=list(arr.shape) if shape is None else shape))


def _sgd_defaults(doc: dict[str, Any]) -> None:
    doc["optimizer"]["class"] = "torch.optim.sgd.SGD"
    doc["optimizer"]["defaults"] = {"lr": 0.05, "momentum": 0.9, "dampening": 0, "weight_decay": 0.0,
                                    "nesterov": False, "maximize": False, "foreach": None, "differentiable": False,
                                    "fused": None}


def _nan(x: Any) -> float:
    return float("nan")


HUGE = 10**12
F1 = "fc1.weight"

CASES: list[Case] = [
    # controls
    Case("pristine", "control", lambda c: None, exact(STEPS, 8), flagged=None),
    Case("golden_2_0_run_without_run_id", "control", lambda c: None, exact(6, 4), flagged=None, base="golden"),
    # silently wrong state
    Case("older_snapshot_copied_as_newest", "wrong-state", lambda c: _copy(c.p(S(4)), c.p(S(8))),
         exact(STEPS, 4, S(8))),
    Case("snapshot_of_another_run_same_config", "wrong-state", lambda c: _copy(c.other("same", S(8)), c.p(S(8))),
         exact(STEPS, 4, S(8))),
    Case("segment_of_another_run_same_config", "wrong-state",
         lambda c: _copy(c.other("same", L(7, 9)), c.p(L(7, 9))), exact(8, 8, L(7, 9))),
    Case("segment_of_another_run_other_compressor", "wrong-state",
         lambda c: _copy(c.other("powersgd", L(10, 10)), c.p(L(10, 10))), exact(9, 8, L(10, 10))),
    Case("segment_of_another_run_other_optimizer", "wrong-state",
         lambda c: _copy(c.other("sgd", L(10, 10)), c.p(L(10, 10))), exact(9, 8, L(10, 10))),
    Case("segment_of_another_run_other_optimizer_run_id_forged", "wrong-state", _set_run_id(L(10, 10), "sgd"),
         exact(9, 8, L(10, 10))),
    Case("snapshot_symlink_to_another_run", "wrong-state",
         _symlink(S(8), lambda c: c.other("same", S(8))), exact(STEPS, 4, S(8))),
    Case("segment_moved_out_and_symlinked", "wrong-state", _moved_out(L(10, 10)), exact(9, 8, L(10, 10))),
    Case("log_dir_symlink_to_another_run", "wrong-state",
         _symlink("log", lambda c: c.others["same"] / "log"), exact(8, 8, L(7, 9))),
    Case("snapshots_dir_symlink_to_another_run", "wrong-state",
         _symlink("snapshots", lambda c: c.others["same"] / "snapshots"), refuse(S(8))),
    Case("hdf5_external_storage_outside_the_run", "wrong-state", _h5(S(8), _external_data(_outside_file)),
         exact(STEPS, 4, S(8))),
    Case("hdf5_external_link", "wrong-state", _h5(S(8), _external_link_index), exact(STEPS, 4, S(8))),
    Case("hdf5_soft_link", "wrong-state", _h5(S(8), _soft_link_index), exact(STEPS, 4, S(8))),
    Case("hdf5_virtual_dataset", "wrong-state", _h5(S(8), _virtual_data), exact(STEPS, 4, S(8))),
    Case("hdf5_extra_dataset", "wrong-state", _h5(S(8), _extra_dataset), exact(STEPS, 4, S(8))),
    Case("golden_run_with_a_file_naming_a_run_id", "wrong-state",
         _meta(L(4, 6), lambda m: m.__setitem__("run_id", "0" * 32)), exact(4, 4, L(4, 6)), base="golden"),
    # files of a history a resume went back from (format 2.4: the manifest's history, each file's branch)
    Case("segment_of_a_discarded_branch", "wrong-state", _meta(L(10, 10), lambda m: m.__setitem__("branch", "d" * 32)),
         exact(9, 8, L(10, 10))),
    Case("snapshot_of_a_discarded_branch", "wrong-state", _meta(S(8), lambda m: m.__setitem__("branch", "d" * 32)),
         exact(STEPS, 4, S(8))),
    Case("first_history_left_at_step_6", "wrong-state", _manifest(lambda d: d.__setitem__("history", [["a" * 32, 6]])),
         exact(6, 4, S(8), L(7, 9))),
    Case("segment_branch_not_hex", "exception", _meta(L(10, 10), lambda m: m.__setitem__("branch", 7)),
         exact(9, 8, L(10, 10))),
    Case("manifest_history_going_back", "exception",
         _manifest(lambda d: d.__setitem__("history", [["a" * 32, 5], ["b" * 32, 3]])), refuse("manifest.json")),
    # hangs
    Case("fifo_named_like_a_snapshot", "hang", _fifo(S(12)), exact(STEPS, 8, S(12))),
    Case("fifo_named_like_a_segment", "hang", _fifo(L(11, 11)), exact(STEPS, 8, L(11, 11))),
    Case("socket_named_like_a_snapshot", "hang", _socket(S(12)), exact(STEPS, 8, S(12))),
    Case("hdf5_external_storage_on_a_fifo", "hang", _h5(S(8), _external_data(_outside_fifo)), exact(STEPS, 4, S(8))),
    Case("sparse_1tb_file_trailer_covers_it_all", "hang", _sparse_trailer_covers_all(S(12)), exact(STEPS, 8, S(12))),
    Case("sparse_1tb_data_blob", "hang", _huge_data_blob, exact(STEPS, 4, S(8))),
    # huge allocations
    Case("index_claims_3e9_bytes", "allocation", _h5(S(8), _chunked("index", 3_000_000_000)), exact(STEPS, 4, S(8))),
    Case("index_claims_1e12_bytes", "allocation", _h5(S(8), _chunked("index", HUGE)), exact(STEPS, 4, S(8))),
    Case("data_claims_1e12_bytes", "allocation", _h5(S(8), _chunked("data", HUGE)), exact(STEPS, 4, S(8))),
    Case("manifest_of_2_gb", "allocation", _sparse_manifest, refuse("manifest.json")),
    Case("manifest_parameter_of_1e12_elements", "allocation",
         _manifest(lambda d: d["params"][0].__setitem__("shape", [HUGE])), refuse("manifest.json")),
    Case("snapshot_entry_of_1e12_elements", "allocation",
         _entries(S(8), lambda f: f.entry(f"optim/{F1}/exp_avg").__setitem__("shape", [HUGE])),
         exact(STEPS, 4, S(8))),
    Case("segment_counts_of_1e9", "allocation",
         _entries(L(10, 10), lambda f: f.entry(f"grad/{F1}/values").__setitem__("counts", [10**9])),
         exact(9, 8, L(10, 10))),
    Case("topk_payload_larger_than_k", "allocation",
         _topk(L(10, 10), lambda v, i: (np.ones(72, v.dtype), np.arange(72, dtype=np.int32))),
         exact(9, 8, L(10, 10))),
    Case("zstd_bomb_of_1_gb_behind_true_counts", "allocation", _entries(L(10, 10), _bomb(False)),
         exact(9, 8, L(10, 10))),
    Case("zstd_bomb_of_1_gb_with_counts_claiming_it", "allocation", _entries(L(10, 10), _bomb(True)),
         exact(9, 8, L(10, 10))),
    Case("descriptor_claims_1e9_raw_bytes", "allocation",
         _entries(L(10, 10), lambda f: f.set_stored(f"grad/{F1}/values", f.raw[f"grad/{F1}/values"],
                                                    codec="none", raw_nbytes=10**9)),
         exact(9, 8, L(10, 10))),
    # exceptions that were not LowDiffErrors
    Case("manifest_nested_200000_deep", "exception", _deep_manifest, refuse("manifest.json")),
    Case("index_nested_200000_deep", "exception",
         _h5(S(8), lambda c, h, i, d: (_index(h, b'{"meta": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
                                       h.create_dataset("data", data=np.frombuffer(d, dtype=np.uint8)))[0]),
         exact(STEPS, 4, S(8))),
    Case("optimizer_class_in_a_missing_module", "exception",
         _manifest(lambda d: d["optimizer"].__setitem__("class", "torch.optim.nonexistent_mod.Foo")),
         refuse("manifest.json", "UnsupportedError")),
    Case("optimizer_class_not_an_optimizer", "exception",
         _manifest(lambda d: d["optimizer"].__setitem__("class", "torch.optim.lr_scheduler.LambdaLR")),
         refuse("manifest.json", "UnsupportedError")),
    Case("optimizer_class_changed", "exception",
         _manifest(lambda d: d["optimizer"].__setitem__("class", "torch.optim.sgd.SGD")), refuse("manifest.json")),
    Case("optimizer_class_and_defaults_changed", "exception", _manifest(_sgd_defaults), refuse(None), flagged=""),
    Case("manifest_defaults_lr_string", "exception",
         _manifest(lambda d: d["optimizer"]["defaults"].__setitem__("lr", "abc")), refuse("manifest.json")),
    Case("manifest_groups_not_lists", "exception",
         _manifest(lambda d: d["optimizer"].__setitem__("param_groups", [1, 2])), refuse("manifest.json")),
    Case("manifest_run_id_not_a_string", "exception", _manifest(lambda d: d.__setitem__("run_id", [1])),
         refuse("manifest.json")),
    Case("snapshot_lr_string", "exception", _meta(S(8), _group(0, "lr", "abc")), exact(STEPS, 4, S(8))),
    Case("snapshot_betas_string", "exception", _meta(S(8), _group(0, "betas", "xyz")), exact(STEPS, 4, S(8))),
    Case("snapshot_groups_ints", "exception", _meta(S(8), lambda m: m.__setitem__("param_groups", [1, 2])),
         exact(STEPS, 4, S(8))),
    Case("snapshot_group_params_renamed", "exception",
         _meta(S(8), lambda m: m["param_groups"][0].__setitem__("params", ["fc2.weight", "fc1.weight"])),
         exact(STEPS, 4, S(8))),
    Case("snapshot_scalar_tensor_of_1e12_elements", "exception",
         _meta(S(8), _group(0, "lr", {"__tensor__": {"dtype": "float32", "shape": [HUGE], "value": 0.01,
                                                      "device": "cpu"}})), exact(STEPS, 4, S(8))),
    Case("snapshot_scalar_state_bad_dtype", "exception",
         _meta(S(8), lambda m: m.__setitem__("optimizer_scalars", {F1: {"x": {"__tensor__": {
             "dtype": "float99", "shape": [], "value": 1, "device": "cpu"}}}})), exact(STEPS, 4, S(8))),
    Case("snapshot_step_is_a_string", "exception", _meta(S(8), lambda m: m.__setitem__("step", "8")),
         exact(STEPS, 4, S(8))),
    Case("segment_lr_string", "exception", _meta(L(10, 10), _step_group("lr", "abc")), exact(9, 8, L(10, 10))),
    Case("segment_betas_string", "exception", _meta(L(10, 10), _step_group("betas", "xyz")), exact(9, 8, L(10, 10))),
    Case("directory_named_like_a_snapshot", "exception", lambda c: c.p(S(12)).mkdir(), exact(STEPS, 8, S(12))),
    Case("dangling_symlink_named_like_a_segment", "exception",
         _symlink(L(11, 11), lambda c: c.scratch / "nowhere.h5"), exact(STEPS, 8, L(11, 11))),
    Case("sgd_snapshot_in_an_adamw_run", "exception", lambda c: _copy(c.other("sgd", S(8)), c.p(S(8))),
         exact(STEPS, 4, S(8))),
    Case("sgd_snapshot_in_an_adamw_run_run_id_forged", "exception", _set_run_id(S(8), "sgd"), exact(STEPS, 4, S(8))),
    Case("unknown_entry_in_a_snapshot", "exception",
         _entries(S(8), lambda f: (f.entries.append({"name": "evil/x", "dtype": "uint8", "shape": [1]}),
                                   f.raw.__setitem__("evil/x", b"\0"))), exact(STEPS, 4, S(8))),
    Case("data_position_not_an_object", "exception",
         _meta(L(10, 10), lambda m: m["steps"][0].__setitem__("data", [1])), exact(9, 8, L(10, 10))),
    # no fallback before: semantically bad files
    Case("topk_index_of_minus_5", "fallback",
         _topk(L(7, 9), lambda v, i: (v, np.concatenate([[-5], i[1:]]).astype(np.int32))), exact(8, 8, L(7, 9))),
    Case("topk_index_of_minus_5_needed_by_the_target", "fallback",
         _topk(L(4, 6), lambda v, i: (v, np.concatenate([[-5], i[1:]]).astype(np.int32))), refuse(L(4, 6)),
         target=6),
    Case("topk_index_of_minus_5_in_an_unused_segment", "fallback",
         _topk(L(1, 3), lambda v, i: (v, np.concatenate([[-5], i[1:]]).astype(np.int32))), exact(STEPS, 8),
         flagged=L(1, 3)),
    Case("topk_index_of_minus_5_found_by_a_worker_process", "fallback",
         _topk(L(7, 9), lambda v, i: (v, np.array([-5], np.int32)), param="scale"), exact(8, 8, L(7, 9)),
         workers=2),
    Case("segment_of_another_run_with_worker_processes", "wrong-state",
         lambda c: _copy(c.other("same", L(7, 9)), c.p(L(7, 9))), exact(8, 8, L(7, 9)), workers=2),
    Case("topk_index_out_of_range", "fallback",
         _topk(L(7, 9), lambda v, i: (v, np.concatenate([i[:-1], [72]]).astype(np.int32))), exact(8, 8, L(7, 9))),
    Case("topk_duplicate_indices", "fallback",
         _topk(L(7, 9), lambda v, i: (v, np.concatenate([[i[1]], i[1:]]).astype(np.int32))), exact(8, 8, L(7, 9))),
    Case("topk_unsorted_indices", "fallback",
         _topk(L(7, 9), lambda v, i: (v[::-1].copy(), i[::-1].copy())), exact(8, 8, L(7, 9))),
    Case("topk_values_float64", "fallback", _topk(L(7, 9), lambda v, i: (v.astype(np.float64), i)),
         exact(8, 8, L(7, 9))),
    Case("topk_indices_int64", "fallback", _topk(L(7, 9), lambda v, i: (v, i.astype(np.int64))),
         exact(8, 8, L(7, 9))),
    Case("topk_fewer_values_than_indices", "fallback", _topk(L(7, 9), lambda v, i: (v[:-1].copy(), i)),
         exact(8, 8, L(7, 9))),
    Case("misnamed_segment", "fallback", lambda c: _copy(c.p(L(7, 9)), c.p(L(10, 12))), exact(STEPS, 8, L(10, 12))),
    Case("segment_meta_names_other_steps", "fallback",
         _meta(L(10, 10), lambda m: (m.update(first_step=11, last_step=11), m["steps"][0].update(step=11))),
         exact(9, 8, L(10, 10))),
    Case("optimizer_state_int8", "fallback", _state(S(8), f"optim/{F1}/exp_avg", np.ones((12, 6), np.int8)),
         exact(STEPS, 4, S(8))),
    Case("optimizer_state_transposed", "fallback",
         _state(S(8), f"optim/{F1}/exp_avg", np.ones((6, 12), np.float32)), exact(STEPS, 4, S(8))),
    Case("optimizer_state_nan_step", "fallback",
         _state(S(8), f"optim/{F1}/step", np.array(np.nan, np.float32), shape=[]), exact(STEPS, 4, S(8))),
    Case("optimizer_state_extra_key", "fallback",
         _entries(S(8), lambda f: (f.entries.append({"name": f"optim/{F1}/evil", "dtype": "float32", "shape": [1]}),
                                   f.raw.__setitem__(f"optim/{F1}/evil", b"\0" * 4))), exact(STEPS, 4, S(8))),
    Case("optimizer_state_missing_key", "fallback", _entries(S(8), lambda f: f.remove(f"optim/{F1}/exp_avg_sq")),
         exact(STEPS, 4, S(8))),
    Case("nan_lr_in_a_segment", "fallback", _meta(L(10, 10), _step_group("lr", float("nan"))), exact(9, 8, L(10, 10))),
    Case("nan_lr_in_a_snapshot", "fallback", _meta(S(8), _group(0, "lr", float("nan"))), exact(STEPS, 4, S(8))),
    Case("negative_lr_in_a_segment", "fallback", _meta(L(10, 10), _step_group("lr", -1.0)), exact(9, 8, L(10, 10))),
    Case("buffer_float64_in_a_segment", "fallback",
         _entries(L(10, 10), lambda f: f.set_raw("buffer/bn.running_mean", np.zeros(12, np.float64).tobytes(),
                                                 dtype="float64")), exact(9, 8, L(10, 10))),
    Case("buffer_missing_in_a_snapshot", "fallback", _entries(S(8), lambda f: f.remove("buffer/bn.running_var")),
         exact(STEPS, 4, S(8))),
    Case("rng_state_float32", "fallback",
         _entries(S(8), lambda f: f.set_raw("rng/torch", f.raw["rng/torch"], dtype="float32",
                                            shape=[len(f.raw["rng/torch"]) // 4])), exact(STEPS, 4, S(8))),
    Case("rng_state_of_the_wrong_size_in_a_segment", "fallback",
         _entries(L(10, 10), lambda f: f.set_raw("rng/torch", f.raw["rng/torch"][:100], counts=[100])),
         exact(9, 8, L(10, 10))),
    Case("residual_of_the_wrong_size", "fallback",
         _state(S(8), f"compressor/{F1}/residual", np.zeros(5, np.float32)), exact(STEPS, 4, S(8))),
    Case("segment_step_list_shifted", "fallback",
         _meta(L(7, 9), lambda m: [s.update(step=s["step"] + 1) for s in m["steps"]]), exact(8, 8, L(7, 9))),
]

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "duplicate case names"


def json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))
