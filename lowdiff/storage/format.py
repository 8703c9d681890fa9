"""The on-disk format in code (docs/FORMAT.md is the normative text). Names, versions, dtypes, value encoding."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowdiff.errors import CorruptFileError

FORMAT_NAME = "lowdiff"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SNAPSHOT_DIR = "snapshots"
LOG_DIR = "log"
LOCK_FILE = "writer.lock"
TMP_SUFFIX = ".tmp"
STEP_DIGITS = 10

_SNAPSHOT_RE = re.compile(r"^step-(\d{%d})\.h5$" % STEP_DIGITS)
_SEGMENT_RE = re.compile(r"^steps-(\d{%d})-(\d{%d})\.h5$" % (STEP_DIGITS, STEP_DIGITS))

# The dtypes a run directory may hold; anything else is rejected when read.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def snapshot_name(step: int) -> str:
    return f"step-{step:0{STEP_DIGITS}d}.h5"


def segment_name(first_step: int, last_step: int) -> str:
    return f"steps-{first_step:0{STEP_DIGITS}d}-{last_step:0{STEP_DIGITS}d}.h5"


def parse_snapshot_name(name: str) -> int | None:
    m = _SNAPSHOT_RE.match(name)
    return int(m.group(1)) if m else None


def parse_segment_name(name: str) -> tuple[int, int] | None:
    m = _SEGMENT_RE.match(name)
    if not m:
        return None
    first, last = int(m.group(1)), int(m.group(2))
    return (first, last) if first <= last else None


def list_snapshots(run_dir: Path) -> dict[int, Path]:
    """Committed snapshots by step (``*.tmp`` and foreign names ignored)."""
    d = run_dir / SNAPSHOT_DIR
    out: dict[int, Path] = {}
    if d.is_dir():
        for p in d.iterdir():
            step = parse_snapshot_name(p.name)
            if step is not None:
                out[step] = p
    return dict(sorted(out.items()))


def list_segments(run_dir: Path) -> list[tuple[int, int, Path]]:
    """Committed log segments as (first_step, last_step, path), sorted by first step."""
    d = run_dir / LOG_DIR
    out: list[tuple[int, int, Path]] = []
    if d.is_dir():
        for p in d.iterdir():
            rng = parse_segment_name(p.name)
            if rng is not None:
                out.append((rng[0], rng[1], p))
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
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def tensor_from_bytes(buf: bytes | bytearray | memoryview | np.ndarray, dtype: torch.dtype,
                      shape: tuple[int, ...] | list[int], where: str) -> torch.Tensor:
    """A new tensor owning a copy of ``buf``; the size must match dtype x shape exactly."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.size != numel * itemsize:
        raise CorruptFileError(f"{where}: holds {arr.size} bytes, expected {numel * itemsize} "
                               f"for {DTYPE_NAMES.get(dtype, dtype)} {tuple(shape)}")
    t = torch.from_numpy(arr.copy())
    return t.view(dtype).reshape(tuple(shape))


def check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise CorruptFileError(f"{where}: invalid shape {shape!r}")
    return tuple(shape)


# --- JSON encoding of optimizer hyperparameters and scalar state --------------------------------------------
# Python floats round-trip exactly through json (repr), including inf and nan. Tuples and 0-dim tensors
# (e.g. a tensor lr) are tagged so they come back as the same type.


def encode_value(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"only one-element tensors can be stored as scalars, got shape {tuple(value.shape)}")
        return {"__tensor__": {"dtype": dtype_name(value.dtype), "shape": list(value.shape),
                               "value": value.detach().cpu().item(), "device": value.device.type}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("only dicts with string keys can be stored")
        if "__tensor__" in value or "__tuple__" in value:
            raise TypeError("dict keys __tensor__ and __tuple__ are reserved")
        return {k: encode_value(v) for k, v in value.items()}
    raise TypeError(f"cannot store a value of type {type(value).__name__}")


def decode_value(value: Any, device: torch.device | str | None = None) -> Any:
    if isinstance(value, list):
        return [decode_value(v, device) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode_value(v, device) for v in value["__tuple__"])
        if set(value) == {"__tensor__"}:
            spec = value["__tensor__"]
            dtype = parse_dtype(spec.get("dtype"), "scalar tensor")
            shape = check_shape(spec.get("shape"), "scalar tensor")
            dev = device if device is not None else "cpu"
            if spec.get("device") == "cpu":
                dev = "cpu"  # e.g. Adam's step counter stays on CPU unless capturable
            return torch.tensor(spec.get("value"), dtype=dtype, device=dev).reshape(shape)
        return {k: decode_value(v, device) for k, v in value.items()}
    return value
