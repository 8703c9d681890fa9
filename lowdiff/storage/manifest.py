"""manifest.json: what the run is (model tensors, optimizer class and groups, config), checksummed JSON."""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowdiff.errors import CorruptFileError, ModelMismatchError, RunDirNotFoundError
from lowdiff.storage.atomic import write_json_atomic
from lowdiff.storage.format import FORMAT_NAME, FORMAT_VERSION, MANIFEST, check_shape, parse_dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Manifest:
    params: list[TensorSpec]
    """Canonical parameters (tied weights appear once), in model order."""
    buffers: list[TensorSpec]
    """Canonical persistent buffers."""
    state_dict_keys: list[tuple[str, str]]
    """(state_dict key, canonical tensor name), in the model's state_dict order: restores tied aliases."""
    optimizer_class: str
    optimizer_defaults: dict[str, Any]
    param_groups: list[list[str]]
    """Parameter names of each optimizer group, in order (the optimizer state_dict's index order)."""
    config: dict[str, Any] = field(default_factory=dict)
    created_unix_s: float = field(default_factory=time.time)

    def param(self, name: str) -> TensorSpec:
        return self._params_by_name[name]

    def __post_init__(self) -> None:
        self._params_by_name = {p.name: p for p in self.params}
        self._buffers_by_name = {b.name: b for b in self.buffers}

    def buffer(self, name: str) -> TensorSpec:
        return self._buffers_by_name[name]

    def has_param(self, name: str) -> bool:
        return name in self._params_by_name

    def has_buffer(self, name: str) -> bool:
        return name in self._buffers_by_name

    @property
    def optimized_params(self) -> list[str]:
        return [n for g in self.param_groups for n in g]

    def to_json(self) -> dict[str, Any]:
        body = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "params": [asdict(p) | {"shape": list(p.shape)} for p in self.params],
            "buffers": [asdict(b) | {"shape": list(b.shape)} for b in self.buffers],
            "state_dict_keys": [list(k) for k in self.state_dict_keys],
            "optimizer": {"class": self.optimizer_class, "defaults": self.optimizer_defaults,
                          "param_groups": self.param_groups},
            "config": self.config,
            "created_unix_s": self.created_unix_s,
        }
        return body | {"crc32": _crc(body)}


def _crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(run_dir: Path, manifest: Manifest) -> None:
    write_json_atomic(run_dir / MANIFEST, manifest.to_json())


def read_manifest(run_dir: Path) -> Manifest:
    path = run_dir / MANIFEST
    if not run_dir.is_dir():
        raise RunDirNotFoundError(f"run directory {run_dir} does not exist")
    if not path.is_file():
        raise RunDirNotFoundError(f"{run_dir} holds no lowdiff run ({MANIFEST} missing); check the path")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, OSError) as e:
        raise CorruptFileError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CorruptFileError(f"{path}: not a JSON object")
    crc = doc.pop("crc32", None)
    if crc != _crc(doc):
        raise CorruptFileError(f"{path}: checksum mismatch (file damaged or edited by hand)")
    if doc.get("format") != FORMAT_NAME or doc.get("format_version") != FORMAT_VERSION:
        raise CorruptFileError(f"{path}: format {doc.get('format')!r} version {doc.get('format_version')!r}; "
                               f"this lowdiff reads {FORMAT_NAME} version {FORMAT_VERSION}")
    try:
        params = [_spec(p, path) for p in doc["params"]]
        buffers = [_spec(b, path) for b in doc["buffers"]]
        opt = doc["optimizer"]
        manifest = Manifest(
            params=params, buffers=buffers,
            state_dict_keys=[(str(k), str(c)) for k, c in doc["state_dict_keys"]],
            optimizer_class=str(opt["class"]), optimizer_defaults=dict(opt["defaults"]),
            param_groups=[[str(n) for n in g] for g in opt["param_groups"]],
            config=dict(doc.get("config", {})), created_unix_s=float(doc.get("created_unix_s", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptFileError(f"{path}: malformed manifest ({e!r})") from e
    names = {p.name for p in params}
    for n in manifest.optimized_params:
        if n not in names:
            raise CorruptFileError(f"{path}: optimizer group names unknown parameter {n!r}")
    return manifest


def _spec(d: dict[str, Any], path: Path) -> TensorSpec:
    parse_dtype(d["dtype"], str(path))
    return TensorSpec(name=str(d["name"]), shape=check_shape(d["shape"], f"{path} [{d['name']}]"),
                      dtype=str(d["dtype"]), requires_grad=bool(d.get("requires_grad", False)))


def check_compatible(recorded: Manifest, current: Manifest, run_dir: Path) -> None:
    """The model/optimizer being wrapped must be the one the run directory was written for."""
    def fail(what: str) -> None:
        raise ModelMismatchError(f"{run_dir}: {what}; use a new run_dir for a different model or optimizer")

    rec_p = {p.name: p for p in recorded.params}
    cur_p = {p.name: p for p in current.params}
    for name in rec_p.keys() | cur_p.keys():
        if name not in cur_p:
            fail(f"parameter {name!r} is in the run but not in the model")
        if name not in rec_p:
            fail(f"parameter {name!r} is in the model but not in the run")
        if (rec_p[name].shape, rec_p[name].dtype) != (cur_p[name].shape, cur_p[name].dtype):
            fail(f"parameter {name!r} is {cur_p[name].dtype}{list(cur_p[name].shape)} in the model but "
                 f"{rec_p[name].dtype}{list(rec_p[name].shape)} in the run")
    if [(b.name, b.shape, b.dtype) for b in recorded.buffers] != [(b.name, b.shape, b.dtype) for b in current.buffers]:
        fail("the model's buffers differ from the run's")
    if recorded.optimizer_class != current.optimizer_class:
        fail(f"optimizer is {current.optimizer_class}, the run used {recorded.optimizer_class}")
    if recorded.param_groups != current.param_groups:
        fail("optimizer parameter groups differ from the run's")
