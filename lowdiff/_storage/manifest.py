"""manifest.json: what the run is (model tensors, optimizer class and groups, config, run id), checksummed JSON.

The manifest is the root every other check of a run directory stands on, so it is read as untrusted input in
full: bounded in size before it is read, and every field checked for type and range (docs/reference/FORMAT.md
sections 2 and 8).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowdiff._storage.atomic import write_json_atomic
from lowdiff._storage.format import DTYPES, FORMAT_MINOR, FORMAT_NAME, FORMAT_VERSION, MANIFEST
from lowdiff._storage.history import History
from lowdiff._storage.history import check as check_history
from lowdiff._storage.layout import SEP, check_sharding
from lowdiff._storage.safe_io import parse_json, read_bounded
from lowdiff._storage.validate import check_run_id, decoded_defaults
from lowdiff.errors import CorruptFileError, FileVanishedError, ModelMismatchError, RunDirNotFoundError

MAX_MANIFEST_BYTES = 64 << 20
"""~200 bytes per tensor: room for 300,000 tensors. A larger manifest.json is not lowdiff's."""
_MAX_DIMS = 64


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

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


def new_run_id() -> str:
    """A fresh run id: 128 random bits as 32 hex digits."""
    return uuid.uuid4().hex


def run_id_to_ints(run_id: str) -> list[int]:
    """Two int64 values carrying a run id (to broadcast it from rank 0 over torch.distributed)."""
    v = int(run_id, 16)
    return [(v >> 64) - (1 << 63), (v & ((1 << 64) - 1)) - (1 << 63)]


def run_id_from_ints(values: list[int]) -> str:
    hi, lo = (int(x) + (1 << 63) for x in values)
    return f"{(hi << 64) | lo:032x}"


def shared_run_id(broadcast_ints: Callable[[list[int], str], list[int]], what: str = "run id") -> str:
    """A fresh id, the same on every rank: rank 0's, broadcast (``Coordinator.broadcast_ints``; in one process it
    returns its argument). A new run's id: every rank stamps its shard of snapshot 0 before rank 0 writes the
    manifest, so the id cannot be read from the manifest, and nothing all ranks share is unique to one run. A
    resume's branch id (lowdiff._storage.history) likewise."""
    return run_id_from_ints(broadcast_ints(run_id_to_ints(new_run_id()), what))


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
    run_id: str | None = None
    """Names the run in every file of it (format 2.1); None in a run written before run ids existed."""
    format_minor: int = FORMAT_MINOR
    sharding: dict[str, Any] | None = None
    """fully_shard (FSDP2) runs: every mesh size's shards of every parameter (format 2.3, lowdiff._storage.layout)."""
    layout: int = 1
    """Shards per parameter of the tensors this manifest lists (1: the model's own; >1: a layout's view)."""
    history: History = field(default_factory=list)
    """The branches resumes started (format 2.4; lowdiff._storage.history): (branch id, step it resumed from),
    oldest first; empty for a run never resumed by a 2.4 writer."""

    def param(self, name: str) -> TensorSpec:
        return self._params_by_name[name]

    def __post_init__(self) -> None:
        self._params_by_name = {p.name: p for p in self.params}
        self._buffers_by_name = {b.name: b for b in self.buffers}
        self._defaults_decoded: dict[str, Any] | None = None

    def buffer(self, name: str) -> TensorSpec:
        return self._buffers_by_name[name]

    def has_param(self, name: str) -> bool:
        return name in self._params_by_name

    def has_buffer(self, name: str) -> bool:
        return name in self._buffers_by_name

    @property
    def optimized_params(self) -> list[str]:
        return [n for g in self.param_groups for n in g]

    @property
    def defaults_decoded(self) -> dict[str, Any]:
        """The optimizer defaults as Python values (the reference every logged group is checked against)."""
        if self._defaults_decoded is None:
            self._defaults_decoded = decoded_defaults(self.optimizer_defaults, MANIFEST)
        return self._defaults_decoded

    @property
    def state_nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.params, *self.buffers))

    def to_json(self) -> dict[str, Any]:
        body = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "format_minor": FORMAT_MINOR,
            "params": [asdict(p) | {"shape": list(p.shape)} for p in self.params],
            "buffers": [asdict(b) | {"shape": list(b.shape)} for b in self.buffers],
            "state_dict_keys": [list(k) for k in self.state_dict_keys],
            "optimizer": {"class": self.optimizer_class, "defaults": self.optimizer_defaults,
                          "param_groups": self.param_groups},
            "config": self.config,
            "created_unix_s": self.created_unix_s,
        }
        if self.run_id is not None:
            body["run_id"] = self.run_id
        if self.sharding is not None:
            body["sharding"] = self.sharding
        if self.history:
            body["history"] = [list(h) for h in self.history]
        return body | {"crc32": _crc(body)}


def _crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(run_dir: Path, manifest: Manifest) -> None:
    write_json_atomic(run_dir / MANIFEST, manifest.to_json())


def update_manifest(run_dir: Path, **fields: Any) -> None:
    """Set ``fields`` (JSON values) in the committed manifest.json of a resumed run, changing nothing else: keys a
    newer lowdiff wrote are kept, and ``format_minor`` never goes down. Call after :func:`read_manifest` has checked
    the file, holding the writer lock."""
    path = run_dir / MANIFEST
    doc = parse_json(read_bounded(path, MAX_MANIFEST_BYTES, confined=False), str(path))
    doc.pop("crc32", None)
    doc |= fields
    doc["format_minor"] = max(FORMAT_MINOR, int(doc.get("format_minor", 0)))
    write_json_atomic(path, doc | {"crc32": _crc(doc)})


def write_history(run_dir: Path, new: History) -> None:
    """Record ``new`` as the run's history (a resume; lowdiff._storage.history)."""
    update_manifest(run_dir, history=[list(h) for h in new])


def read_manifest(run_dir: Path) -> Manifest:
    path = run_dir / MANIFEST
    if not run_dir.is_dir():
        if run_dir.exists():  # a file: often the manifest itself, named instead of its directory
            where = f"the directory holding it, {run_dir.parent}" if run_dir.name == MANIFEST else \
                f"the run directory (the one holding {MANIFEST})"
            raise RunDirNotFoundError(f"{run_dir} is not a directory; pass {where}")
        raise RunDirNotFoundError(f"run directory {run_dir} does not exist")
    if not os.path.lexists(path):
        raise RunDirNotFoundError(f"{run_dir} holds no lowdiff run ({MANIFEST} missing); check the path")
    try:
        raw = read_bounded(path, MAX_MANIFEST_BYTES, confined=False)
    except FileVanishedError as e:
        raise RunDirNotFoundError(f"{run_dir} holds no lowdiff run ({MANIFEST} missing); check the path") from e
    try:
        return _parse(raw, path)
    except CorruptFileError as e:
        e.path = path
        raise


def _parse(raw: bytes, path: Path) -> Manifest:
    doc = parse_json(raw, str(path))
    if not isinstance(doc, dict):
        raise CorruptFileError(f"{path}: not a JSON object")
    crc = doc.pop("crc32", None)
    try:
        expected = _crc(doc)
    except (ValueError, RecursionError) as e:
        raise CorruptFileError(f"{path}: not a lowdiff manifest ({type(e).__name__})") from e
    if crc != expected:
        raise CorruptFileError(f"{path}: checksum mismatch (file damaged or edited by hand)")
    if doc.get("format") != FORMAT_NAME or doc.get("format_version") != FORMAT_VERSION:
        raise CorruptFileError(f"{path}: format {str(doc.get('format'))[:40]!r} version "
                               f"{str(doc.get('format_version'))[:40]!r}; this lowdiff reads {FORMAT_NAME} version "
                               f"{FORMAT_VERSION}")
    minor = doc.get("format_minor", 0)
    if not isinstance(minor, int) or isinstance(minor, bool) or minor < 0:
        raise CorruptFileError(f"{path}: invalid format_minor {str(minor)[:40]!r}")
    params = _specs(doc.get("params"), path, "params")
    buffers = _specs(doc.get("buffers"), path, "buffers")
    names = {p.name for p in params}
    if names & {b.name for b in buffers}:
        raise CorruptFileError(f"{path}: a name is both a parameter and a buffer")
    keys = doc.get("state_dict_keys")
    if not isinstance(keys, list) or not all(isinstance(k, list) and len(k) == 2 and all(isinstance(s, str) for s in k)
                                             for k in keys):
        raise CorruptFileError(f"{path}: state_dict_keys must be a list of [key, name] string pairs")
    tensors = names | {b.name for b in buffers}
    for key, canonical in keys:
        if canonical not in tensors:
            raise CorruptFileError(f"{path}: state_dict key {key!r} names unknown tensor {canonical!r}")
    opt = doc.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("defaults"), dict):
        raise CorruptFileError(f"{path}: optimizer must be an object with class, defaults and param_groups")
    cls = opt.get("class")
    if not isinstance(cls, str) or not 0 < len(cls) <= 1024 or not cls.isprintable():
        raise CorruptFileError(f"{path}: invalid optimizer class name {str(cls)[:80]!r}")
    groups = opt.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                               for g in groups):
        raise CorruptFileError(f"{path}: optimizer param_groups must be lists of parameter names")
    seen: set[str] = set()
    for g in groups:
        for n in g:
            if n not in names:
                raise CorruptFileError(f"{path}: optimizer group names unknown parameter {n!r}")
            if n in seen:
                raise CorruptFileError(f"{path}: parameter {n!r} is in two optimizer groups")
            seen.add(n)
    config = doc.get("config", {})
    created = doc.get("created_unix_s", 0.0)
    if not isinstance(config, dict):
        raise CorruptFileError(f"{path}: config must be an object")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise CorruptFileError(f"{path}: invalid created_unix_s {str(created)[:40]!r}")
    sharding = doc.get("sharding")
    if sharding is not None:
        sharding = check_sharding(sharding, {p.name: p.shape for p in params}, path)
        if any(SEP in n for n in names) or any(not p.shape for p in params):
            raise CorruptFileError(f"{path}: a sharded run's parameters have names without {SEP!r} and dimensions")
    manifest = Manifest(params=params, buffers=buffers, state_dict_keys=[(k, c) for k, c in keys],
                        optimizer_class=cls, optimizer_defaults=dict(opt["defaults"]), param_groups=groups,
                        config=config, created_unix_s=float(created),
                        run_id=check_run_id(doc.get("run_id"), str(path)), format_minor=minor, sharding=sharding,
                        history=check_history(doc.get("history"), str(path)))
    manifest.defaults_decoded  # noqa: B018  (checks every default now: a bad one is the manifest's fault)
    limit = _memory_bytes()
    if limit and manifest.state_nbytes > limit:
        raise CorruptFileError(f"{path}: describes a model of {manifest.state_nbytes} bytes, more than this "
                               f"machine's memory ({limit} bytes); the manifest is damaged, or recover on a larger "
                               "machine")
    return manifest


def _specs(items: Any, path: Path, what: str) -> list[TensorSpec]:
    if not isinstance(items, list):
        raise CorruptFileError(f"{path}: {what} must be a list")
    out, seen = [], set()
    for d in items:
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"]:
            raise CorruptFileError(f"{path}: malformed {what} entry {str(d)[:80]}")
        name, shape, dtype, rg = d["name"], d.get("shape"), d.get("dtype"), d.get("requires_grad", False)
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 48 for s in shape):
            raise CorruptFileError(f"{path} [{name}]: invalid shape {str(shape)[:80]}")
        if dtype not in DTYPES or not isinstance(rg, bool):
            raise CorruptFileError(f"{path} [{name}]: invalid dtype {str(dtype)[:40]!r} or requires_grad")
        if name in seen:
            raise CorruptFileError(f"{path}: {what} lists {name!r} twice")
        seen.add(name)
        out.append(TensorSpec(name=name, shape=tuple(shape), dtype=dtype, requires_grad=rg))
    return out


def _memory_bytes() -> int:
    """Physical memory of this machine (0: unknown). No model larger than it can be recovered here."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


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


def config_changes(recorded: Manifest, current: Manifest) -> list[str]:
    """What a resume changes that the run directory cannot follow silently: another compressor (allowed: each
    segment records its own, FORMAT.md section 5) or other optimizer defaults (the resumed state keeps the run's
    logged hyperparameters). One line each, for the log."""
    out = []
    old_c, new_c = recorded.config.get("compressor") or {}, current.config.get("compressor") or {}
    if old_c != new_c:
        out.append(f"the compressor is {_short(new_c)} now, the run was written with {_short(old_c)}: segments from "
                   "here on record the new one (manifest.json keeps the run's first configuration)")
    old_d, new_d = recorded.optimizer_defaults, current.optimizer_defaults
    changed = [k for k in sorted(old_d.keys() | new_d.keys()) if old_d.get(k) != new_d.get(k)]
    if changed:
        diff = ", ".join(f"{k} {_short(old_d.get(k))} -> {_short(new_d.get(k))}" for k in changed[:6])
        out.append(f"the optimizer was built with other defaults than the run's ({diff}): resume() restores the "
                   "hyperparameters the run logged; set new values on opt.param_groups after resume() to change them")
    return out


def _short(value: Any) -> str:
    return str(value)[:80]
