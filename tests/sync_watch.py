"""A ``TorchDispatchMode`` that records the operations lowdiff's own code makes on one thread that would make the
host wait for a device (issue 35): shared by the single-process guards (tests/integration/test_step_guards.py) and
the DDP ranks (tests/distributed/ddp_worker.py ``--sync-watch``).

What counts: ``_local_scalar_dense``, ``equal``, ``nonzero``, ``masked_select``, ``unique``, ``is_nonzero`` and
copies to the host that are not non-blocking into pinned memory. On the CPU nothing synchronizes, so each op is
judged by what it would be on a GPU (``device``: where the model lives): a ``.to("cpu")`` of a tensor is a
device-to-host copy there. An op is lowdiff's when the innermost frame outside torch and Python's standard library
that led to it is in lowdiff; anything under ``torch.optim`` (the inner optimizer's own step) is not."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lowdiff

LOWDIFF_DIR = str(Path(lowdiff.__file__).resolve().parent) + os.sep
TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
OPTIM_DIR = TORCH_DIR + "optim" + os.sep
STDLIB_DIRS = tuple({str(Path(sysconfig.get_paths()["stdlib"])) + os.sep,
                     str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep})
SYNCING = {"aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::masked_select", "aten::is_nonzero",
           "aten::item", "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim",
           "aten::unique_consecutive", "aten::nonzero_numpy"}


def _passes_through(filename: str) -> bool:
    """torch's own code and Python's standard library: an op made there on lowdiff's behalf is lowdiff's (a
    ``weakref.WeakKeyDictionary`` lookup compares tensors with ``==``, a ``bool()`` of a device tensor)."""
    if filename.startswith(TORCH_DIR) or filename.startswith("<frozen "):  # frozen: os, _collections_abc, ...
        return True
    return filename.startswith(STDLIB_DIRS) and "-packages" + os.sep not in filename


def _attributed(frame: Any) -> str | None:
    """The lowdiff function an op comes from ("file:line"), or None: not lowdiff's (the inner optimizer's step, the
    model, the test)."""
    culprit = None
    while frame is not None:
        f = frame.f_code.co_filename
        if f.startswith(OPTIM_DIR):
            return None  # inside the inner optimizer's step: its own ops
        if culprit is None and not _passes_through(f):
            if not f.startswith(LOWDIFF_DIR):
                return None
            culprit = f"{f[len(LOWDIFF_DIR):]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return culprit


def _host_copy_syncs(name: str, args: Any, kwargs: dict[str, Any], device: str) -> bool:
    """Whether a copy op makes the host wait for a device (on the CPU: would on a GPU)."""
    if name == "aten::_to_copy":
        src, dev = args[0], kwargs.get("device")
        if dev is None or torch.device(dev).type != "cpu":
            return False
        # .to("cpu"): from the model's device, a copy into pageable memory the host waits for.
        return src.device.type != "cpu" or device == "cpu"
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return src.device.type != "cpu" and dst.device.type == "cpu" and not (non_blocking and dst.is_pinned())
    return False


class SyncWatch(TorchDispatchMode):
    """Records the syncing ops lowdiff makes on the thread that created it (``device``: the model's)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self.thread = threading.get_ident()
        self.found: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if threading.get_ident() == self.thread:
            name = func._schema.name
            if name in SYNCING or _host_copy_syncs(name, args, kwargs, self.device):
                where = _attributed(sys._getframe(1))
                if where is not None:
                    self.found[f"{name} from {where}"] += 1
        return func(*args, **kwargs)
