"""The modes bench/overhead.py times, part 1: the interface every mode implements, plain training, and the
full-checkpoint baselines (torch.save, CheckFreq-style async, torch.distributed.checkpoint async_save, naive
differential). The lowdiff modes are in overhead_lowdiff.py; the protocol that runs them in overhead_protocol.py.

The baselines handle GPU tensors: torch.save and the naive differential save them directly (torch.save copies to the
host), CheckFreq-style copies into reused pinned host buffers with non-blocking copies and its persist thread waits
on a CUDA event, DCP's async_save stages to the host itself.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import dir_bytes, fsync_file, k_for
from _common import train_step as _clipped_train_step

TOPK_RATIO = 0.01
PSGD_RANK = 4
# DCP without a process group warns on every call (also from its upload thread, where catch_warnings does not reach).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the command line sets for every mode."""

    device: torch.device
    clip: bool = True
    """clip_grad_norm_(1.0) in every mode's step (False with --no-clip)."""
    snapshot_keep: int = 0
    """lowdiff's snapshot.keep (1 with --tidy)."""
    quick: bool = False
    """--smoke: few repetitions of what is measured apart from the rounds (compression time)."""


@dataclass
class Ctx:
    """What the modes share: one model and one AdamW, so every mode trains the same tensors."""

    model: torch.nn.Module
    inner: torch.optim.Optimizer
    work: Path
    settings: Settings
    shared: bool = True
    """Whether other modes train the same model (False in a --probe process, which runs one mode)."""
    measured: dict[str, Any] = field(default_factory=dict)
    """Measurements modes share (e.g. one compression time per compressor)."""


def train_step(settings: Settings, model: torch.nn.Module, opt: Any, batch: Any) -> None:
    """bench/_common.train_step (forward, backward, clip_grad_norm_ 1.0, step, zero_grad); without the clipping
    under --no-clip (clipping scales every gradient in place after backward, which makes layer-wise captures
    stale: lowdiff then removes its hooks and copies in step())."""
    if settings.clip:
        _clipped_train_step(model, opt, batch)
        return
    x, y = batch
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU): called at window boundaries only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Mode:
    """Plain training, and the interface of every mode. Call order: :meth:`setup`, :meth:`warm`,
    :meth:`start_timed`; per timed window :meth:`begin_window`, :meth:`step` x W, :meth:`end_window` (and
    :meth:`tidy`); after the rounds :meth:`finish`, :meth:`results`, :meth:`close`."""

    family = "plain"
    ref = "plain"
    k: int | None = None  # steps between checkpoint events (None: no events)

    def __init__(self, name: str) -> None:
        self.name = name
        self.compress_s = 0.0
        self.warmup = 2
        self.window = 1  # steps per timed window (set by build_modes)

    def setup(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def warm(self, next_batch: Any) -> None:
        """Untimed steps before the rounds (``next_batch()`` gives the next batch)."""
        for _ in range(self.warmup):
            self.step(next_batch())

    def step(self, batch: Any) -> bool:
        """One training step; True when a checkpoint event happened in it."""
        train_step(self.ctx.settings, self.ctx.model, self.ctx.inner, batch)
        return False

    def start_timed(self) -> None:
        """Called after warm-up: reset counters so events align with window starts."""

    def begin_window(self) -> None:
        """Called right before a timed window (untimed)."""

    def end_window(self) -> float:
        """Called right after a timed window: wait for the mode's background work (untimed); returns the wait."""
        return 0.0

    def tidy(self) -> None:
        """With --tidy: delete checkpoint files after a window (untimed), for small disks."""

    def finish(self, next_batch: Any) -> None:
        """After the last round, before the statistics (untimed)."""

    def compress_s_per_step(self, since_s: float, steps: int) -> float:
        """Compression time per timed step (``since_s``: :attr:`compress_s` when the rounds started)."""
        return (self.compress_s - since_s) / steps

    def bytes_written(self) -> int:
        return 0

    def info(self) -> dict[str, Any]:
        """Settings and counters of the mode, merged into its JSON result."""
        return {}

    def results(self, total_steps: int) -> dict[str, Any]:
        """Mode-specific figures appended to its JSON result after :meth:`info` (``total_steps``: timed steps)."""
        return {}

    def close(self) -> None:
        pass


class IntervalMode(Mode):
    """A baseline that checkpoints the full state every ``k`` steps."""

    def __init__(self, family: str, k: int) -> None:
        super().__init__(f"{family}-k{k}")
        self.family, self.k = family, k
        self.interval = k
        self.counter = 0
        self.nbytes = 0
        self.saves = 0

    def setup(self, ctx: Ctx) -> None:
        super().setup(ctx)
        self.dir = ctx.work / self.name
        self.dir.mkdir(parents=True)

    def start_timed(self) -> None:
        self.end_window()
        self.counter = 0

    def optimizer(self) -> Any:
        """What the training step steps (the shared AdamW; a subclass may put a wrapper around it)."""
        return self.ctx.inner

    def step(self, batch: Any) -> bool:
        train_step(self.ctx.settings, self.ctx.model, self.optimizer(), batch)
        event = self.counter % self.interval == 0
        self.counter += 1
        if event:
            self.checkpoint()
            self.saves += 1
        return event

    def checkpoint(self) -> None:
        raise NotImplementedError

    def tidy(self) -> None:
        for p in self.dir.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def bytes_written(self) -> int:
        return self.nbytes

    def results(self, total_steps: int) -> dict[str, Any]:
        return {"saves": self.saves, "bytes_per_save": self.bytes_written() / max(self.saves, 1)}


def _save_durably(obj: Any, path: Path) -> int:
    """torch.save to a temporary name, fsync, rename: the durability lowdiff gives its files."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    fsync_file(tmp)
    os.replace(tmp, path)
    return path.stat().st_size


class TorchSaveMode(IntervalMode):
    """Synchronous full checkpoint: torch.save(model + optimizer state) + fsync on the training thread."""

    def __init__(self, k: int) -> None:
        super().__init__("torchsave", k)

    def checkpoint(self) -> None:
        self.nbytes += _save_durably({"model": self.ctx.model.state_dict(), "optim": self.ctx.inner.state_dict()},
                                     self.dir / "ckpt.pt")


def _clone_state(sd: Any) -> Any:
    """A host copy (GPU tensors: into new pinned buffers, non-blocking: wait on an event before reading)."""
    if isinstance(sd, torch.Tensor):
        if sd.device.type == "cuda":
            buf = torch.empty(sd.shape, dtype=sd.dtype, pin_memory=True)
            buf.copy_(sd.detach(), non_blocking=True)
            return buf
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _clone_state(v) for k, v in sd.items()}
    return copy.deepcopy(sd)


def _copy_into(dst: Any, src: Any) -> Any:
    if isinstance(src, torch.Tensor):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            return _clone_state(src)
        dst.copy_(src.detach(), non_blocking=src.device.type == "cuda")
        return dst
    if isinstance(src, dict):
        return {k: _copy_into(dst[k], v) if k in dst else _clone_state(v) for k, v in src.items()}
    return copy.deepcopy(src)


class CheckFreqMode(IntervalMode):
    """CheckFreq-style: snapshot() copies the state into reused CPU buffers on the training thread, persist()
    torch.saves them (+ fsync) in a background thread; at most one checkpoint in flight (the next snapshot
    waits for the previous persist, since it reuses the buffers)."""

    def __init__(self, k: int) -> None:
        super().__init__("checkfreq", k)
        self.buf: Any = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def checkpoint(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error:
            raise self.error
        state = {"model": self.ctx.model.state_dict(), "optim": self.ctx.inner.state_dict()}
        self.buf = _clone_state(state) if self.buf is None else _copy_into(self.buf, state)
        ready = None
        if self.ctx.settings.device.type == "cuda":
            # The copies are queued on the stream; the next step's kernels come after them.
            ready = torch.cuda.Event()
            ready.record()
        self.thread = threading.Thread(target=self._persist, args=(self.buf, ready), daemon=True)
        self.thread.start()

    def _persist(self, buf: Any, ready: Any = None) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            n = _save_durably(buf, self.dir / "ckpt.pt")
            with self._lock:
                self.nbytes += n
        except BaseException as e:  # surfaced at the next checkpoint
            self.error = e

    def end_window(self) -> float:
        t0 = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
        return time.perf_counter() - t0


class DCPMode(IntervalMode):
    """torch.distributed.checkpoint.async_save without a process group (single process), one in flight."""

    def __init__(self, k: int) -> None:
        super().__init__("dcp", k)
        self.pending: Any = None
        self.pending_dir: Path | None = None

    def checkpoint(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._wait()
        msd, osd = get_state_dict(self.ctx.model, self.ctx.inner)
        target = self.dir / f"ckpt{self.saves % 2}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            resp = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(target))
        self.pending = getattr(resp, "upload_completion", resp)
        self.pending_dir = target

    def _wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            assert self.pending_dir is not None
            self.nbytes += dir_bytes(self.pending_dir)
            self.pending = None

    def end_window(self) -> float:
        t0 = time.perf_counter()
        self._wait()
        return time.perf_counter() - t0


class NaiveDiffMode(IntervalMode):
    """Naive differential checkpoint: Top-k 1 % (per tensor) of the parameter change since the previous
    checkpoint, computed on the training thread, plus the full optimizer state, torch.save'd + fsync'd."""

    def __init__(self, k: int) -> None:
        super().__init__("naivediff", k)

    def setup(self, ctx: Ctx) -> None:
        super().setup(ctx)
        self.prev = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}

    def checkpoint(self) -> None:
        t0 = time.perf_counter()
        deltas = {}
        with torch.no_grad():
            for n, p in self.ctx.model.named_parameters():
                d = (p - self.prev[n]).reshape(-1)
                idx = torch.topk(d.abs(), k_for(d.numel(), TOPK_RATIO), sorted=False).indices
                deltas[n] = (d[idx], idx.to(torch.int32))
                self.prev[n].copy_(p)
        self.compress_s += time.perf_counter() - t0
        self.nbytes += _save_durably({"delta": deltas, "optim": self.ctx.inner.state_dict()}, self.dir / "diff.pt")


def dcp_available() -> tuple[bool, str]:
    try:
        import torch.distributed.checkpoint as dcp

        if not hasattr(dcp, "async_save"):
            return False, "torch.distributed.checkpoint has no async_save in this torch"
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resp = dcp.async_save({"x": torch.zeros(4)}, checkpoint_id=d)
            getattr(resp, "upload_completion", resp).result()
        return True, "dcp.async_save works single-process without init_process_group (no_dist inferred)"
    except Exception as e:  # pragma: no cover - depends on the torch build
        return False, f"dcp.async_save failed without a process group: {e!r}"


def baselines(ks: list[int], with_dcp: bool) -> list[Mode]:
    """The full-checkpoint baselines for every interval in ``ks``."""
    out: list[Mode] = []
    for k in ks:
        out += [TorchSaveMode(k), CheckFreqMode(k)]
        if with_dcp:
            out.append(DCPMode(k))
        out.append(NaiveDiffMode(k))
    return out
