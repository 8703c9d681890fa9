"""Unit tests of the untrusted-input readers: opening files (safe_io), the container's structure checks, the
manifest's validation, value and hyperparameter checks, and the Top-k decode check."""

from __future__ import annotations

import json
import math
import os
import socket
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from lowdiff._compressors import decode_payload, topk
from lowdiff._storage import format as fmt
from lowdiff._storage.container import ContainerReader, EntryIn, write_container
from lowdiff._storage.manifest import Manifest, TensorSpec, read_manifest, write_manifest
from lowdiff._storage.safe_io import open_regular, read_bounded
from lowdiff._storage.validate import check_belongs, check_group, decoded_defaults
from lowdiff.errors import CorruptFileError, FileVanishedError, ForeignFileError, LowDiffError, UnsafeFileError


def _member(tmp_path: Path) -> Path:
    d = tmp_path / "run" / "snapshots"
    d.mkdir(parents=True)
    return d / "step-0000000001.h5"


def test_open_regular_refuses_what_is_not_a_regular_file_in_place(tmp_path: Path) -> None:
    p = _member(tmp_path)
    p.write_bytes(b"x")
    os.close(open_regular(p))
    p.unlink()
    with pytest.raises(FileVanishedError):
        open_regular(p)
    os.mkfifo(p)
    with pytest.raises(UnsafeFileError, match="FIFO"):
        open_regular(p)  # returns at once: O_NONBLOCK
    p.unlink()
    p.mkdir()
    with pytest.raises(UnsafeFileError, match="directory"):
        open_regular(p)
    p.rmdir()
    (tmp_path / "elsewhere").write_bytes(b"x")
    p.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        open_regular(p)
    p.unlink()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()
    with pytest.raises(UnsafeFileError, match="socket"):
        open_regular(p)


def test_a_linked_run_subdirectory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "other" / "snapshots"
    real.mkdir(parents=True)
    (real / "step-0000000001.h5").write_bytes(b"x")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "snapshots").symlink_to(real)
    path = tmp_path / "run" / "snapshots" / "step-0000000001.h5"
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        open_regular(path)
    os.close(open_regular(path, confined=False))  # outside a run directory the directory may be a link


def test_read_bounded_checks_the_size_before_reading(tmp_path: Path) -> None:
    p = tmp_path / "big"
    with open(p, "wb") as f:
        f.truncate(1 << 40)  # sparse: reading it would take hours
    with pytest.raises(UnsafeFileError, match="more than"):
        read_bounded(p, 1 << 20, confined=False)
    p.write_bytes(b"abc")
    assert read_bounded(p, 3, confined=False) == b"abc"


def _container(path: Path) -> None:
    write_container(path, "snapshot", {"step": 1}, [EntryIn("a", [b"abcd"], {"dtype": "uint8", "shape": [4]})],
                    "none")


def _rebuild(path: Path, build) -> None:  # type: ignore[no-untyped-def]
    """Rewrite the HDF5 part with ``build(f, index, data)`` and a valid trailer (tests/hostile/forge.py)."""
    from forge import load, save

    save(path, load(path), hook=build)


def test_container_refuses_hdf5_reaching_outside(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    _container(path)
    outside = tmp_path / "outside.bin"

    def external(f, index, data):  # type: ignore[no-untyped-def]
        ds = f.create_dataset("index", data=np.frombuffer(index, np.uint8))
        ds.attrs["crc32"] = zlib.crc32(index)
        outside.write_bytes(data)
        f.create_dataset("data", shape=(len(data),), dtype=np.uint8, external=[(str(outside), 0, len(data))])

    _rebuild(path, external)
    with pytest.raises(UnsafeFileError, match="outside the file"):
        ContainerReader(path, "snapshot")

    def soft(f, index, data):  # type: ignore[no-untyped-def]
        ds = f.create_dataset("real", data=np.frombuffer(index, np.uint8))
        ds.attrs["crc32"] = zlib.crc32(index)
        f["index"] = h5py.SoftLink("/real")
        f.create_dataset("data", data=np.frombuffer(data, np.uint8))

    _container(path)
    _rebuild(path, soft)
    with pytest.raises(CorruptFileError, match="not exactly the datasets|SoftLink"):
        ContainerReader(path, "snapshot")


def test_container_refuses_a_padded_or_overlapping_data_blob(tmp_path: Path) -> None:
    from forge import load, save

    path = tmp_path / "c.h5"
    _container(path)
    c = load(path)
    c.entries.append({"name": "b", "dtype": "uint8", "shape": [4]})
    c.raw["b"] = b"efgh"
    save(path, c)
    c = load(path)
    c.entry("b")["offset"] = 0  # b now overlaps a
    save(path, c, keep_descriptors=True)
    with pytest.raises(CorruptFileError, match="overlap or leave a gap"):
        ContainerReader(path, "snapshot")


def test_decode_value_refuses_malformed_tagged_values() -> None:
    bad = [
        {"__tensor__": {"dtype": "float32", "shape": [10**12], "value": 1.0, "device": "cpu"}},
        {"__tensor__": {"dtype": "float32", "shape": [], "value": "x", "device": "cpu"}},
        {"__tensor__": {"dtype": "float32", "shape": [], "value": 1.0, "device": 3}},
        {"__tensor__": [1]},
        {"__tuple__": 5},
    ]
    for v in bad:
        with pytest.raises(CorruptFileError):
            fmt.decode_value(v)
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(CorruptFileError, match="nested"):
        fmt.decode_value(deep)


ADAM = decoded_defaults(fmt.encode_value(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults), "m")


@pytest.mark.parametrize("key, value, match", [
    ("lr", "abc", "not a number"), ("lr", math.nan, "finite"), ("lr", -1.0, "finite number in"),
    ("betas", "xyz", "tuple"), ("betas", {"__tuple__": [0.9]}, "tuple of 2"), ("betas", {"__tuple__": [0.9, 1.5]},
                                                                               "finite number in"),
    ("amsgrad", 1, "true or false"), ("eps", math.inf, "finite"),
    ("lr", {"__tensor__": {"dtype": "float32", "shape": [], "value": math.nan, "device": "cpu"}}, "finite"),
])
def test_group_hyperparameters_are_checked_against_the_defaults(key: str, value: object, match: str) -> None:
    group = fmt.encode_value(dict(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]))
    group.pop("params")
    check_group(dict(group), ADAM, "here")
    group[key] = value
    with pytest.raises(CorruptFileError, match=match):
        check_group(group, ADAM, "here")
    del group[key]
    with pytest.raises(CorruptFileError, match="lacks"):
        check_group(group, ADAM, "here")


def test_tensor_learning_rates_and_scheduler_keys_are_accepted() -> None:
    group = fmt.encode_value({**{k: v for k, v in torch.optim.AdamW(
        [torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.01)).param_groups[0].items() if k != "params"},
        "initial_lr": 0.01})
    check_group(group, ADAM, "here")


def test_run_ids_must_match_or_both_be_absent(tmp_path: Path) -> None:
    p = tmp_path / "f"
    check_belongs({"run_id": "a" * 32}, "a" * 32, p)
    check_belongs({}, None, p)
    for meta, mine in (({"run_id": "b" * 32}, "a" * 32), ({}, "a" * 32), ({"run_id": "a" * 32}, None)):
        with pytest.raises(ForeignFileError) as e:
            check_belongs(meta, mine, p)
        assert e.value.path == p
    with pytest.raises(CorruptFileError, match="invalid run id"):
        check_belongs({"run_id": 5}, "a" * 32, p)


def _manifest(tmp_path: Path) -> Path:
    m = Manifest(params=[TensorSpec("w", (3, 2), "float32", True)], buffers=[], state_dict_keys=[("w", "w")],
                 optimizer_class="torch.optim.sgd.SGD",
                 optimizer_defaults=fmt.encode_value(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))],
                                                                     lr=0.1).defaults),
                 param_groups=[["w"]], run_id="c" * 32)
    tmp_path.mkdir(exist_ok=True)
    write_manifest(tmp_path, m)
    return tmp_path


@pytest.mark.parametrize("edit", [
    lambda d: d["params"][0].__setitem__("shape", [-1]),
    lambda d: d["params"][0].__setitem__("shape", [True]),
    lambda d: d["params"].append(dict(d["params"][0])),
    lambda d: d["optimizer"].__setitem__("param_groups", [["w"], ["w"]]),
    lambda d: d["optimizer"].__setitem__("param_groups", [[1]]),
    lambda d: d.__setitem__("state_dict_keys", [["w", "nothing"]]),
    lambda d: d.__setitem__("created_unix_s", "yesterday"),
    lambda d: d.__setitem__("run_id", "not hex"),
    lambda d: d["optimizer"]["defaults"].__setitem__("lr", "abc"),
    lambda d: d["optimizer"]["defaults"].__setitem__("momentum", -1.0),
    lambda d: d.__setitem__("params", {"w": 1}),
    lambda d: d["params"][0].__setitem__("shape", [1 << 40, 1 << 20]),
])
def test_manifest_fields_are_validated(tmp_path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    from forge import forge_manifest

    run = _manifest(tmp_path)
    read_manifest(run)
    forge_manifest(run, edit)
    with pytest.raises(CorruptFileError) as e:
        read_manifest(run)
    assert e.value.path == run / "manifest.json" and "manifest.json" in str(e.value)


def test_manifest_json_that_no_parser_accepts(tmp_path: Path) -> None:
    run = _manifest(tmp_path)
    for body in (b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b'{"a": NaN' + b"}"):
        (run / "manifest.json").write_bytes(body)
        with pytest.raises(CorruptFileError):
            read_manifest(run)
    (run / "manifest.json").unlink()
    os.mkfifo(run / "manifest.json")
    with pytest.raises(UnsafeFileError):
        read_manifest(run)


def test_topk_decode_refuses_repeated_unsorted_and_out_of_range_indices() -> None:
    v = torch.ones(3)
    assert torch.equal(topk.decode(v, torch.tensor([0, 2, 4], dtype=torch.int32), (5,)),
                       torch.tensor([1.0, 0, 1, 0, 1]))
    for idx in ([0, 2, 2], [2, 0, 4], [0, 2, 5], [-1, 0, 1]):
        with pytest.raises(CorruptFileError):
            decode_payload({"values": v, "indices": torch.tensor(idx, dtype=torch.int32)}, (5,))
    # A payload the compressor just produced is trusted (no checks, no device synchronization).
    decode_payload({"values": v, "indices": torch.tensor([0, 2, 4], dtype=torch.int32)}, (5,), trusted=True)


def test_every_reader_error_is_a_lowdiff_error() -> None:
    for cls in (CorruptFileError, ForeignFileError, UnsafeFileError, FileVanishedError):
        assert issubclass(cls, LowDiffError)
    assert issubclass(FileVanishedError, FileNotFoundError) and issubclass(UnsafeFileError, ValueError)
    json.dumps(str(ForeignFileError("x", path=Path("p"), step=3)))
