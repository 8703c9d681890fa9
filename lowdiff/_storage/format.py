"""The on-disk format in code (docs/reference/FORMAT.md is the normative text): names, versions, dtypes, values."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowdiff._storage.later import Later, Read
from lowdiff._storage.safe_io import lstat_size
from lowdiff.errors import CorruptFileError, UnsupportedError

FORMAT_NAME = "lowdiff"
FORMAT_VERSION = 2  # 2: metadata-CRC trailer on every HDF5 file (version 1 files had none)
FORMAT_MINOR = 6  # 2.1: run id in every file, files name their shard; 2.2: end-of-iteration state, per-rank state;
# 2.3: sharded (fully_shard) layouts in the manifest; 2.4: the run's history (branches) in the manifest and files;
# 2.5: the compressor memory a clean stop saves (stops/); 2.6: a mirrored prefix's claim (claim.json)
MANIFEST = "manifest.json"
CLAIM = "claim.json"  # under a mirrored run's prefix only, never in a run directory (lowdiff._storage.remote_claim)
SNAPSHOT_DIR = "snapshots"
LOG_DIR = "log"
STOP_DIR = "stops"
LOCK_FILE = "writer.lock"
PERSIST_LOCK_GLOB = "persist-*.lock"  # persist-IIIII.lock: rank I's persistence process (FORMAT.md section 1)
TMP_SUFFIX = ".tmp"
STEP_DIGITS = 10

_SHARD = r"(?:\.shard-(\d{5})-of-(\d{5}))?"
_STEP = rf"(\d{{{STEP_DIGITS}}})"
_SNAPSHOT_RE = re.compile(rf"^step-{_STEP}{_SHARD}\.h5$")
_SEGMENT_RE = re.compile(rf"^steps-{_STEP}-{_STEP}{_SHARD}\.h5$")


# The dtypes a run directory may hold; anything else is rejected when read.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Shard:
    """Which part of a sharded file set a file is: shard ``index`` of ``count`` (0 of 1 when unsharded)."""

    index: int = 0
    count: int = 1

    def suffix(self) -> str:
        return "" if self.count == 1 else f".shard-{self.index:05d}-of-{self.count:05d}"


@dataclass(frozen=True)
class FileSet:
    """One logical snapshot or segment: a single file, or one file per writing rank (all must be present)."""

    paths: tuple[Path, ...]

    @property
    def name(self) -> str:
        return str(self.paths[0]) if len(self.paths) == 1 else f"{self.paths[0].parent}/{_base(self.paths[0].name)}"

    @property
    def nbytes(self) -> int:
        """Bytes on disk (a summary: a name that is not a regular file counts 0; readers check every file)."""
        return sum(lstat_size(p) for p in self.paths)

    def __str__(self) -> str:
        return self.name


def _base(name: str) -> str:
    return re.sub(r"\.shard-\d{5}-of-\d{5}", "", name)


UNSHARDED = Shard()


def snapshot_name(step: int, shard: Shard = UNSHARDED) -> str:
    return f"step-{step:0{STEP_DIGITS}d}{shard.suffix()}.h5"


def segment_name(first_step: int, last_step: int, shard: Shard = UNSHARDED) -> str:
    return f"steps-{first_step:0{STEP_DIGITS}d}-{last_step:0{STEP_DIGITS}d}{shard.suffix()}.h5"


def _shard(index: str | None, count: str | None) -> Shard | None:
    if index is None:
        return Shard()
    i, n = int(index), int(count or 0)
    return Shard(i, n) if 0 <= i < n and n > 1 else None


def parse_snapshot_name(name: str) -> tuple[int, Shard] | None:
    m = _SNAPSHOT_RE.match(name)
    if not m:
        return None
    shard = _shard(m.group(2), m.group(3))
    return (int(m.group(1)), shard) if shard else None


def parse_segment_name(name: str) -> tuple[int, int, Shard] | None:
    m = _SEGMENT_RE.match(name)
    if not m:
        return None
    first, last = int(m.group(1)), int(m.group(2))
    shard = _shard(m.group(3), m.group(4))
    return (first, last, shard) if first <= last and shard else None


def _complete(groups: dict[tuple[Any, ...], dict[Shard, Path]]) -> dict[tuple[Any, ...], FileSet]:
    """Keep only complete shard sets; if several world sizes wrote the same steps, the smallest count wins."""
    out: dict[tuple[Any, ...], FileSet] = {}
    for key, files in groups.items():
        for count in sorted({s.count for s in files}):
            members = {s.index: p for s, p in files.items() if s.count == count}
            if len(members) == count:
                out[key] = FileSet(tuple(members[i] for i in range(count)))
                break
    return out


def list_snapshots(run_dir: Path, directory: str = SNAPSHOT_DIR) -> dict[int, FileSet]:
    """Committed, complete snapshots by step (``*.tmp``, foreign names and incomplete shard sets ignored); with
    ``directory`` STOP_DIR, the stop files (FORMAT.md section 4a), which are named like snapshots."""
    groups: dict[tuple[Any, ...], dict[Shard, Path]] = {}
    d = run_dir / directory
    if d.is_dir():
        for p in d.iterdir():
            parsed = parse_snapshot_name(p.name)
            if parsed is not None:
                groups.setdefault((parsed[0],), {})[parsed[1]] = p
    return {k[0]: v for k, v in sorted(_complete(groups).items())}


def list_segments(run_dir: Path) -> list[tuple[int, int, FileSet]]:
    """Committed, complete log segments as (first_step, last_step, files), sorted by first step."""
    groups: dict[tuple[Any, ...], dict[Shard, Path]] = {}
    d = run_dir / LOG_DIR
    if d.is_dir():
        for p in d.iterdir():
            parsed = parse_segment_name(p.name)
            if parsed is not None:
                groups.setdefault((parsed[0], parsed[1]), {})[parsed[2]] = p
    return sorted((k[0], k[1], v) for k, v in _complete(groups).items())


def files_beyond(run_dir: Path, step: int) -> list[Path]:
    """Every snapshot, segment or stop file (complete set or not) holding a step after ``step``."""
    out = []
    for sub in (SNAPSHOT_DIR, LOG_DIR, STOP_DIR):
        d = run_dir / sub
        if not d.is_dir():
            continue
        for p in d.iterdir():
            snap, seg = parse_snapshot_name(p.name), parse_segment_name(p.name)
            last = snap[0] if snap else seg[1] if seg else None
            if last is not None and last > step:
                out.append(p)
    return sorted(out)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"lowdiff cannot store tensors of dtype {dtype}") from None


def parse_dtype(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise CorruptFileError(f"{where}: unknown dtype {name!r}")
    return DTYPES[name]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (no copy when it is already contiguous)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8).numpy().data.cast("B")


def tensor_from_bytes(buf: bytes | bytearray | memoryview | np.ndarray, dtype: torch.dtype,
                      shape: tuple[int, ...] | list[int], where: str) -> torch.Tensor:
    """A new tensor owning a copy of ``buf``; the size must match dtype x shape exactly."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.size != numel * itemsize:
        raise CorruptFileError(f"{where}: holds {arr.size} bytes, expected {numel * itemsize} "
                               f"for {DTYPE_NAMES.get(dtype, dtype)} {tuple(shape)}")
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)  # viewing 0 bytes as a wider dtype is refused
    t = torch.from_numpy(arr.copy())
    return t.view(dtype).reshape(tuple(shape))


def check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise CorruptFileError(f"{where}: invalid shape {shape!r}")
    return tuple(shape)


# --- JSON encoding of optimizer hyperparameters, scalar state and tracked state ---------------------------------
# Python floats round-trip exactly through json (repr), including inf and nan. Tuples, 0-dim tensors (e.g. a tensor
# lr), Counters and dicts whose keys are not all strings (MultiStepLR's milestones) are tagged so they come back as
# the same type (docs/reference/FORMAT.md section 2).

TAGS = ("__tensor__", "__tuple__", "__counter__", "__items__")
"""The tagged forms; a dict using one of these as a key is stored as ``__items__`` (so it stays unambiguous)."""


def encode_value(value: Any, read: Read | None = None) -> Any:
    """``value`` as JSON, losslessly: numbers, strings, None, lists, tuples, dicts (any hashable scalar or tuple
    keys), ``collections.Counter`` and one-element tensors. Anything else is a ``TypeError`` naming it.
    ``read``: how a tensor's value is taken (:data:`Read`; None: now); a :class:`Later` stays as it is."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, (float, Later)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"only one-element tensors can be stored as scalars, got shape {tuple(value.shape)}")
        number = read(value) if read is not None else value.detach().cpu().item()
        return {"__tensor__": {"dtype": dtype_name(value.dtype), "shape": list(value.shape), "value": number,
                               "device": value.device.type}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, read) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, read) for v in value]
    if isinstance(value, Counter):
        return {"__counter__": [[_encode_key(k), encode_value(v, read)] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in TAGS for k in value):
            return {k: encode_value(v, read) for k, v in value.items()}
        return {"__items__": [[_encode_key(k), encode_value(v, read)] for k, v in value.items()]}
    raise TypeError(f"cannot store a value of type {type(value).__name__}")


def _encode_key(key: Any) -> Any:
    if isinstance(key, (bool, int, float, str)) or key is None:
        return key
    if isinstance(key, tuple):
        return {"__tuple__": [_encode_key(k) for k in key]}
    raise TypeError(f"cannot store a dict key of type {type(key).__name__}")


_MAX_VALUE_DEPTH = 32  # hyperparameters and data positions are shallow; deeper is not ours (and would recurse)


def decode_value(value: Any, device: torch.device | str | None = None, _depth: int = 0) -> Any:
    """The value :func:`encode_value` encoded. Untrusted input: a malformed tagged form (a "tensor" of more than one
    element, an unknown dtype, an unhashable key, nesting deeper than encode_value ever writes) is a
    CorruptFileError. Whether the value makes sense where it stands (finite, in range) is lowdiff._storage.validate's
    concern."""
    if _depth > _MAX_VALUE_DEPTH:
        raise CorruptFileError(f"value nested deeper than {_MAX_VALUE_DEPTH} levels")
    if isinstance(value, Later):  # a value encoded in this process (a shadow replica's groups)
        return value.get()
    if isinstance(value, list):
        return [decode_value(v, device, _depth + 1) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            tag, items = next(iter(value.items()))
            if tag == "__tuple__":
                if not isinstance(items, list):
                    raise CorruptFileError(f"malformed tuple {str(value)[:80]}")
                return tuple(decode_value(v, device, _depth + 1) for v in items)
            if tag == "__tensor__":
                return _decode_tensor(items, device)
            if tag in ("__counter__", "__items__"):
                pairs = _decode_pairs(items, device, _depth + 1)
                return Counter(dict(pairs)) if tag == "__counter__" else dict(pairs)
        return {k: decode_value(v, device, _depth + 1) for k, v in value.items()}
    return value


def _decode_pairs(items: Any, device: torch.device | str | None, depth: int) -> list[tuple[Any, Any]]:
    if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
        raise CorruptFileError(f"malformed mapping {str(items)[:80]} (expected [key, value] pairs)")
    out = []
    for k, v in items:
        key = decode_value(k, device, depth + 1)
        try:
            hash(key)
        except TypeError:
            raise CorruptFileError(f"mapping key {str(k)[:40]} is not hashable") from None
        out.append((key, decode_value(v, device, depth + 1)))
    return out


def _decode_tensor(spec: Any, device: torch.device | str | None) -> torch.Tensor:
    if not isinstance(spec, dict):
        raise CorruptFileError(f"malformed scalar tensor {str(spec)[:80]}")
    dtype = parse_dtype(spec.get("dtype"), "scalar tensor")
    shape = check_shape(spec.get("shape"), "scalar tensor")
    if math.prod(shape) != 1:
        raise CorruptFileError(f"scalar tensor of shape {list(shape)[:8]}: a stored scalar has one element")
    v = spec.get("value")
    if isinstance(v, Later):
        v = v.get()
    if not isinstance(v, (bool, int, float)):
        raise CorruptFileError(f"scalar tensor value {str(v)[:40]!r} is not a number")
    dev = spec.get("device")
    if not isinstance(dev, str):
        raise CorruptFileError(f"scalar tensor device {str(dev)[:40]!r} is not a string")
    target = device if device is not None else "cpu"
    if dev == "cpu":
        target = "cpu"  # e.g. Adam's step counter stays on CPU unless capturable
    try:
        return torch.tensor(v, dtype=dtype, device=target).reshape(shape)
    except (RuntimeError, OverflowError, TypeError, ValueError) as e:
        raise CorruptFileError(f"scalar tensor {str(spec)[:80]}: {e}") from e


def encode_group(group: Mapping[str, Any], read: Read | None = None) -> dict[str, Any]:
    """An optimizer group's hyperparameters as JSON values (``params`` left out)."""
    try:
        return {k: encode_value(v, read) for k, v in group.items() if k != "params"}
    except TypeError as e:
        raise UnsupportedError(f"an optimizer group hyperparameter cannot be logged: {e}") from e


def encode_groups(groups: Iterable[Mapping[str, Any]], read: Read | None = None) -> list[dict[str, Any]]:
    return [encode_group(g, read) for g in groups]
