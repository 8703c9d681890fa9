"""Overhead of checkpointing every iteration, against the same training without it and against full-checkpoint
baselines (torch.save, CheckFreq-style async, torch.distributed.checkpoint async_save, naive differential).

    python bench/overhead.py            # the real run (~18 min on 2 cores); writes bench/results, docs/
    python bench/overhead.py --smoke --out-dir /tmp/x   # seconds; what tests/bench runs
    python bench/overhead.py --device cuda --model-size 50m   # on a GPU: bench/results/overhead-cuda.json, docs/
        # 50m: a full checkpoint is 595 MB and compressor none logs 200 MB per step; on a small disk add --tidy
        # and leave lowdiff-none(-layerwise) out (--modes); the 9 GB free on the H100 test machine did not hold a
        # full run
    python bench/overhead.py --modes lowdiff-topk-auto --out-name overhead-auto   # tuner-chosen settings only

On ``--device cuda`` the model, the optimizer state and the batches live on the GPU; the stream is synchronized at
every window boundary (before the first step and after the last), so a window's mean step time is real GPU time
(the per-step times inside a window are host-side). The baselines handle GPU tensors: torch.save and the naive
differential save them directly (torch.save copies to the host), CheckFreq-style copies into reused pinned host
buffers with non-blocking copies and its persist thread waits on a CUDA event, DCP's async_save stages to the host
itself. Compression times are host-side on GPU (kernels are asynchronous); the ``-off`` twin's ratio to plain is
the real compression cost.

Auto mode (``lowdiff-C-auto``, issue #7): ``snapshot.every_steps: auto`` and ``log.batch_steps: auto`` with
``tuner.max_overhead`` (``--auto-max-overhead``, 0.02) and ``tuner.mtbf_hours`` (``--auto-mtbf-hours``). It warms
up continuously until the tuner has decided and a snapshot has followed the decision (so the chosen batch size is
in force), then its windows are W steps, W a multiple of the chosen batch B dividing the chosen interval F, aligned
so snapshot steps start windows; the reference is its ``enabled: false`` twin ``lowdiff-C-off``; the interval F
is stratified as for the fixed modes (rounds >= F / W are needed to see a snapshot). At a window's end it waits for
the writer to commit the complete segments and snapshots (no flush: that would cut segments shorter than B).

LowDiff+ variants (issue #8), compressor none, each with the reference ``lowdiff-none-off`` and otherwise like
``lowdiff-none``: ``lowdiff-none-shadow`` (``snapshot.shadow: true``: full snapshots are written from a CPU replica
that the writer keeps in step; CPU only) and ``lowdiff-none-layerwise`` (``log.capture: layerwise``: post-accumulate-
grad hooks copy gradients during backward; the hooks are on the shared model, so they are removed outside this
mode's warm-up and windows). Every step clips its gradients (clip_grad_norm_ 1.0) unless ``--no-clip``; clipping
changes the gradients after backward, so lowdiff finds the layer-wise captures stale and removes its hooks after
3 steps (the JSON's ``capture`` says when): ``--modes lowdiff-none-layerwise --no-clip`` measures the hooks.

Protocol (one process, one model, one AdamW shared by every mode, so every mode trains the same tensors):
  * every mode is warmed up, then R rounds. A round runs windows of consecutive training steps: plain training
    (P) and every baseline X alternate, P X1 P X2 ... Xn P (the baselines' order rotates each round), and the
    lowdiff modes run as (C off, C on, C off) for each compressor C and each variant of C (none off,
    none-shadow, none off; ...), before or after that chain (alternating by round). Step times are wall-clock
    per step (forward, backward, clipping, optimizer step, checkpoint work on the training thread); process CPU
    time per window (all threads) is recorded too.
  * a window's ratio = its mean step time / the mean step time of its reference measured next to it in time:
    for a baseline, the mean of the two plain windows around it; for lowdiff with compressor C, the mean of the
    two windows of lowdiff with C and ``enabled: false`` around it (the lowdiff block of a round is
    off-on-off per compressor; the disabled twin compresses and decodes identically and writes nothing, so
    compression cost is excluded; both twins get the same warm-up). The shared machine's load drifts on a
    scale of seconds, so only neighbouring windows are compared. The reported overhead is the median over rounds.
  * checkpoint events are aligned with window starts (the k-step counter is 0 at a window start; the lowdiff
    warm-up is W-1 steps for a lowdiff window of W steps, plus one snapshot interval, so its snapshot steps,
    multiples of ``snapshot.every_steps``, start a window, and the run's first snapshot, which allocates the host
    buffers every later one reuses, is not timed: the timed ones are the steady state; ``--time-first-snapshot``
    times it). When the interval k exceeds the window W, only some rounds hold
    an event; the ratio is then stratified: (1 - W/k) * median(rounds without) + (W/k) * median(rounds with).
  * background work (lowdiff's writer, CheckFreq's persist thread, DCP's upload) still running when a window
    ends is waited for OUTSIDE the timed window (so it cannot slow the next window); that wait is reported, and
    ``ratio_incl_drain`` charges it to the window as if it had blocked training (an upper bound).
  * the step-time tail (issue #8: does a step wait for a snapshot?), per mode over all its timed steps:
    ``max_over_median`` = slowest / median step time, ``event_steps_over_others`` = median of the steps with a
    checkpoint event (lowdiff: snapshot steps) / median of the others (None unless both were timed; how many event
    steps in ``event_steps_timed``; which step of each window in the windows' ``event_steps``). Plain's own
    max / median is the noise floor of the shared machine.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import (  # noqa: E402
    MODEL_SIZES,
    SMOKE_MODEL,
    device_info,
    dir_bytes,
    fsync_file,
    machine_info,
    maxrss_bytes,
    mb,
    median,
    output_paths,
    peak_rss_bytes,
    pyplot,
    raw_write_fsync,
    run_probe,
    to_device,
    write_json,
)
from _common import train_step as _train_step  # noqa: E402

import lowdiff  # noqa: E402
from lowdiff.compressors.powersgd import factor_shapes  # noqa: E402
from lowdiff.compressors.topk import k_for  # noqa: E402
from lowdiff.config import resolve_codec  # noqa: E402
from lowdiff.storage.run_dir import RunDir  # noqa: E402
from lowdiff.storage.segment import write_segment  # noqa: E402

TOPK_RATIO = 0.01
# DCP without a process group warns on every call (also from its upload thread, where catch_warnings does not reach).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
PSGD_RANK = 4
DEVICE = torch.device("cpu")  # set by --device
SNAPSHOT_KEEP = 0  # lowdiff's snapshot.keep (1 with --tidy)
CLIP = True  # clip_grad_norm_(1.0) in every mode's step (False with --no-clip)


def train_step(model: torch.nn.Module, opt: Any, batch: Any) -> None:
    """bench/_common.train_step (forward, backward, clip_grad_norm_ 1.0, step, zero_grad); without the clipping
    under --no-clip (clipping scales every gradient in place after backward, which makes layer-wise captures
    stale: lowdiff then removes its hooks and copies in step())."""
    if CLIP:
        _train_step(model, opt, batch)
        return
    x, y = batch
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync() -> None:
    """Wait for the GPU's queued work (a no-op on the CPU): called at window boundaries only."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def lz4_available() -> bool:
    try:
        import lz4.frame  # noqa: F401
    except ImportError:
        return False
    return True

# -- instrumentation of lowdiff's segment writes (timing only; the library is not changed) ----------------------

_SEGMENT_LOG: dict[str, list[tuple[int, float]]] = {}
_LAST_RECORDS: dict[str, list[Any]] = {}
_KEEP_RECORDS = 0
_NO_KEEP: set[str] = set()  # run dirs whose records the bandwidth test does not need (the LowDiff+ variants)


_REAL_RUN_DIR_WRITE_SEGMENT = RunDir.write_segment


def _timed_write_segment(run_dir: RunDir, records: list[Any], *args: Any, **kwargs: Any) -> int:
    t0 = time.perf_counter()
    n = _REAL_RUN_DIR_WRITE_SEGMENT(run_dir, records, *args, **kwargs)
    dt = time.perf_counter() - t0
    key = str(run_dir.path)
    _SEGMENT_LOG.setdefault(key, []).append((n, dt))
    if _KEEP_RECORDS and key not in _NO_KEEP:
        kept = _LAST_RECORDS.setdefault(key, [])
        kept.extend(records)
        del kept[:-_KEEP_RECORDS]
    return n


RunDir.write_segment = _timed_write_segment  # type: ignore[method-assign]


# -- modes ---------------------------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, work: Path) -> None:
        self.model, self.inner, self.work = model, inner, work


class Mode:
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
        train_step(self.ctx.model, self.ctx.inner, batch)
        return False

    def start_timed(self) -> None:
        """Called after warm-up: reset counters so events align with window starts."""

    def begin_window(self) -> None:
        """Called right before a timed window (untimed)."""

    def end_window(self) -> float:
        return 0.0

    def tidy(self) -> None:
        """With --tidy: delete checkpoint files after a window (untimed), for small disks."""

    def finish(self) -> None:
        """After the last round, before the statistics."""

    def bytes_written(self) -> int:
        return 0

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class LowDiffMode(Mode):
    family = "lowdiff"

    def __init__(self, comp: str, enabled: bool, every: int, batch_steps: int, codec: str, align: int,
                 warm_snapshot: bool = True) -> None:
        super().__init__(f"lowdiff-{comp}" + ("" if enabled else "-off"))
        self.comp, self.enabled, self.every, self.batch_steps, self.codec = comp, enabled, every, batch_steps, codec
        self.ref = f"lowdiff-{comp}-off" if enabled else "plain"
        self.k = every if enabled else None
        # The same for both twins: a fresh Top-k compressor is slower for ~20 steps. With warm_snapshot the first
        # snapshot falls in the warm-up: it allocates the host buffers every later snapshot reuses (once per run).
        self.warmup = align - 1 + (every if warm_snapshot else 0)

    def config(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "enabled": self.enabled,
                "compressor": {"name": self.comp, "ratio": TOPK_RATIO, "rank": PSGD_RANK},
                "snapshot": {"every_steps": self.every, "keep": SNAPSHOT_KEEP},
                "log": {"batch_steps": self.batch_steps, "codec": self.codec}}

    def setup(self, ctx: Ctx) -> None:
        super().setup(ctx)
        self.run_dir = ctx.work / self.name
        t0 = time.perf_counter()
        self.opt = lowdiff.wrap(ctx.inner, ctx.model, self.config())
        self.wrap_s = time.perf_counter() - t0
        # The wrapper calls compress_decode where the library has it (compress + the decode it needs anyway).
        attr = "compress_decode" if hasattr(self.opt.compressor, "compress_decode") else "compress"
        orig = getattr(self.opt.compressor, attr)

        def timed(fqn: str, grad: torch.Tensor, *rest: Any) -> Any:
            t = time.perf_counter()
            out = orig(fqn, grad, *rest)
            self.compress_s += time.perf_counter() - t
            return out

        setattr(self.opt.compressor, attr, timed)

    def step(self, batch: Any) -> bool:
        train_step(self.ctx.model, self.opt, batch)
        return self.enabled and self.opt.step_count % self.every == 0

    def start_timed(self) -> None:
        self.end_window()  # commit the warm-up's partial batch: segments then align with windows

    def end_window(self) -> float:
        t0 = time.perf_counter()
        self.opt.flush()
        return time.perf_counter() - t0

    def stats(self) -> Any:
        return self.opt._checkpointer.writer_stats if self.opt._checkpointer else None

    def bytes_written(self) -> int:
        st = self.stats()
        return st.log_bytes + st.snapshot_bytes if st else 0

    def info(self) -> dict[str, Any]:
        st = self.stats()
        return {"compressor": self.comp, "enabled": self.enabled, "snapshot_every_steps": self.every,
                "batch_steps": self.batch_steps, "codec": self.codec,
                "codec_resolved": resolve_codec(self.codec, self.comp),
                "writer_stats": vars(st).copy() if st else None}

    def close(self) -> None:
        self.opt.close()


class LowDiffPlusMode(LowDiffMode):
    """A LowDiff+ variant of ``lowdiff-C`` (compressor none): ``lowdiff-C-shadow`` (``snapshot.shadow: true``: the
    writer keeps a CPU replica and writes full snapshots from it) or ``lowdiff-C-layerwise`` (``log.capture:
    layerwise``: post-accumulate-grad hooks copy gradients during backward). Otherwise like ``lowdiff-C``, with the
    same reference ``lowdiff-C-off``.

    The model is shared by every mode, so the layer-wise hooks (on its parameters) are removed outside this mode's
    warm-up and windows (untimed) and put back before them; if lowdiff removes them itself (captures stale in
    STALE_STEPS_LIMIT steps in a row, e.g. by gradient clipping), they stay removed, as in training."""

    VARIANTS = ("shadow", "layerwise")

    def __init__(self, comp: str, variant: str, every: int, batch_steps: int, codec: str, align: int,
                 warm_snapshot: bool = True) -> None:
        assert variant in self.VARIANTS, variant
        super().__init__(comp, True, every, batch_steps, codec, align, warm_snapshot)
        self.variant = variant
        self.name = f"lowdiff-{comp}-{variant}"
        self._suspended = False  # hooks removed by the benchmark (between this mode's windows)
        self.hooks_removed_by_lowdiff_at: int | None = None
        self._captures0 = (0, 0)  # (hits, misses) at the start of the timed rounds

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        if self.variant == "shadow":
            cfg["snapshot"]["shadow"] = True
        else:
            cfg["log"]["capture"] = "layerwise"
        return cfg

    def setup(self, ctx: Ctx) -> None:
        super().setup(ctx)
        _NO_KEEP.add(str(self.run_dir))  # same records as lowdiff-C: no second bandwidth test
        lw = self.opt._stager.layerwise
        if lw is not None:
            # The parameters LayerwiseCapture hooks (lowdiff/optimizer.py), to hook them again after a pause.
            self._hooked = [(n, p) for n, p in self.opt._spec.optimized if n in self.opt._owned_log]
            self._hooks(False)

    def _hooks(self, on: bool) -> None:
        lw = self.opt._stager.layerwise
        if lw is None:
            return
        if on and self._suspended:
            lw._handles = [p.register_post_accumulate_grad_hook(lw._hook_for(n)) for n, p in self._hooked]
            self._suspended = False
        elif not on and lw.active:
            lw.remove()
            self._suspended = True

    def warm(self, next_batch: Any) -> None:
        self._hooks(True)
        super().warm(next_batch)
        self._hooks(False)

    def start_timed(self) -> None:
        super().start_timed()
        lw = self.opt._stager.layerwise
        if lw is not None:
            self._captures0 = (lw.hits, lw.misses)

    def begin_window(self) -> None:
        self._hooks(True)

    def step(self, batch: Any) -> bool:
        self._hooks(True)  # a no-op after begin_window (the memory probe calls step() alone)
        event = super().step(batch)
        lw = self.opt._stager.layerwise
        if lw is not None and not lw.active and not self._suspended and self.hooks_removed_by_lowdiff_at is None:
            self.hooks_removed_by_lowdiff_at = self.opt.step_count
        return event

    def end_window(self) -> float:
        wait = super().end_window()
        self._hooks(False)
        return wait

    def info(self) -> dict[str, Any]:
        out = super().info()
        out["variant"] = self.variant
        ck = self.opt._checkpointer
        writer = ck._writer if ck is not None else None
        if self.variant == "shadow":
            # False when the replica failed and snapshots fell back to the training thread (logged as an error).
            out["shadow_in_force"] = bool(writer is not None and writer.shadow_ok)
        lw = self.opt._stager.layerwise
        if lw is not None:
            # Gradients of the timed steps taken from the hooks' copies (hits) or captured but changed after
            # backward, so copied again in step() (misses); the last partial bucket is always copied in step().
            out["capture"] = {"hits_timed": lw.hits - self._captures0[0],
                              "misses_timed": lw.misses - self._captures0[1],
                              "hooks_active": lw.active or self._suspended,
                              "hooks_removed_by_lowdiff_at_step": self.hooks_removed_by_lowdiff_at}
        return out


class AutoLowDiffMode(LowDiffMode):
    """lowdiff with ``snapshot.every_steps: auto`` and ``log.batch_steps: auto`` (see the module docstring)."""

    def __init__(self, comp: str, codec: str, target_window: int, mtbf_hours: float, max_overhead: float,
                 max_warmup_steps: int, retune_drift: float | None = None) -> None:
        super().__init__(comp, True, 0, 0, codec, target_window)
        self.name = f"lowdiff-{comp}-auto"
        self.target_window = target_window
        self.mtbf_hours, self.max_overhead, self.max_warmup_steps = mtbf_hours, max_overhead, max_warmup_steps
        self.retune_drift = retune_drift
        self.k = None  # the tuner's interval, known after warm-up
        self.snapshots_submitted = 0
        self.warmup_steps = 0
        self.warmup_s = 0.0
        self.alignment = "not warmed up"
        self.aligned_to: dict[str, int] = {}
        self.drain_timeouts = 0

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["snapshot"] = {"every_steps": "auto", "keep": SNAPSHOT_KEEP}
        cfg["log"] = {"batch_steps": "auto", "codec": self.codec}
        cfg["tuner"] = {"mtbf_hours": self.mtbf_hours, "max_overhead": self.max_overhead}
        if self.retune_drift is not None:
            cfg["tuner"]["retune_drift"] = self.retune_drift
        return cfg

    @property
    def ckpt(self) -> Any:
        return self.opt._checkpointer

    def step(self, batch: Any) -> bool:
        train_step(self.ctx.model, self.opt, batch)
        event = self.ckpt.policy.last_snapshot_step == self.opt.step_count
        self.snapshots_submitted += event
        return event

    def warm(self, next_batch: Any) -> None:
        """Until the tuner has decided and a snapshot has followed its latest decision (its B then in force), then
        to alignment."""
        t0 = time.perf_counter()
        ck, tuner = self.ckpt, self.ckpt.policy.tuner
        while True:
            seen = len(tuner.decisions)
            while self.warmup_steps < self.max_warmup_steps:
                self.step(next_batch())
                self.warmup_steps += 1
                # The LATEST decision followed by a snapshot: a re-decision during warm-up must not leave the
                # windows aligned to an interval no longer in force. Settled: no probe in force and no decision
                # still waiting for alpha (its re-decision would fall inside the timed rounds).
                if tuner.settled and tuner.decisions and ck.policy.last_snapshot_step > tuner.decisions[-1].step:
                    break
            f, b = ck.policy.every_steps, ck.policy.batch_steps
            self.k = f
            # The window: a multiple of B dividing F, closest to the target (snapshot steps then start windows);
            # of two as close, the longer (F = 19, B = 1: 19-step windows, not 1-step ones).
            cands = [w for w in range(b, f + 1, b) if f % w == 0]
            self.window = min(cands, key=lambda w: (abs(w - self.target_window), -w))
            # Windows start at steps = last snapshot (mod W): run to the step before the next such start.
            while (self.opt.step_count + 1 - ck.policy.last_snapshot_step) % self.window:
                self.step(next_batch())
                self.warmup_steps += 1
            # Decided again while aligning: align to the new decision (within the warm-up budget).
            if len(tuner.decisions) == seen or self.warmup_steps >= self.max_warmup_steps:
                break
        self.warmup_s = time.perf_counter() - t0
        decided = bool(tuner.decisions)
        self.aligned_to = {"every_steps": f, "batch_steps": b}
        self.alignment = (f"every_steps={f} batch_steps={b} window={self.window} after {self.warmup_steps} warm-up "
                          f"steps ({self.warmup_s:.0f} s){'' if decided else ' - NO DECISION YET (bootstrap values)'}")
        print(f"  {self.name}: {self.alignment}", flush=True)

    def start_timed(self) -> None:
        self.end_window()

    def finish(self) -> None:
        # The interval the stratification weighs with: the tuner's choice in force at the end (it may have
        # re-decided during the rounds; every decision is in info()).
        self.k = self.ckpt.policy.every_steps

    def end_window(self) -> float:
        """Wait for the writer to commit every complete segment and every snapshot submitted (the open segment
        stays open: a flush would cut it)."""
        t0 = time.perf_counter()
        ck, st = self.ckpt, self.stats()
        b, cur = ck.policy._writer_batch, self.opt.step_count
        target = ck.policy._batch_anchor + (cur - ck.policy._batch_anchor) // b * b
        while ck.durable_step < target or st.snapshots < self.snapshots_submitted:
            if time.perf_counter() - t0 > 120:
                self.drain_timeouts += 1
                self.opt.flush()
                break
            time.sleep(0.0005)
            ck.check()
        return time.perf_counter() - t0

    def info(self) -> dict[str, Any]:
        out = super().info()
        tuner = self.ckpt.policy.tuner
        out.update({
            "snapshot_every_steps": "auto", "batch_steps": "auto", "tuner_mtbf_hours": self.mtbf_hours,
            "tuner_max_overhead": self.max_overhead, "alignment": self.alignment, "warmup_steps": self.warmup_steps,
            "in_force": {"every_steps": self.ckpt.policy.every_steps, "batch_steps": self.ckpt.policy.batch_steps},
            "aligned_to": self.aligned_to,
            "drain_timeouts": self.drain_timeouts,
            "decisions": [{"step": d.step, "reason": d.reason, "every_steps": d.every_steps,
                           "batch_steps": d.batch_steps, "predicted_overhead": d.overhead,
                           "waste_s_per_hour": d.waste_s_per_hour, "feasible": d.feasible,
                           "predicted_writer_load": d.breakdown.writer_load,
                           "sources": dict(d.costs.sources), "summary": d.summary()} for d in tuner.decisions],
        })
        return out


class _IntervalMode(Mode):
    """A baseline that checkpoints the full state every ``k`` steps."""

    def __init__(self, family: str, k: int) -> None:
        super().__init__(f"{family}-k{k}")
        self.family, self.k = family, k
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

    def step(self, batch: Any) -> bool:
        train_step(self.ctx.model, self.ctx.inner, batch)
        event = self.counter % self.k == 0
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


def _save_durably(obj: Any, path: Path) -> int:
    """torch.save to a temporary name, fsync, rename: the durability lowdiff gives its files."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    fsync_file(tmp)
    os.replace(tmp, path)
    return path.stat().st_size


class TorchSaveMode(_IntervalMode):
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


class CheckFreqMode(_IntervalMode):
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
        if DEVICE.type == "cuda":  # the copies are queued on the stream; the next step's kernels come after them
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


class DCPMode(_IntervalMode):
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


class NaiveDiffMode(_IntervalMode):
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


def build_modes(names: list[str] | None, ks: list[int], every: int, window: int, ld_window: int, codec: str,
                batch_steps: dict[str, int], with_dcp: bool, auto: dict[str, Any] | None = None,
                warm_snapshot: bool = True) -> list[Mode]:
    """``auto``: {"compressors": [...], "mtbf_hours", "max_overhead", "max_warmup_steps"} adds lowdiff-C-auto for
    those compressors (and for any named in ``names``). Compressor none also gets the LowDiff+ variants
    lowdiff-none-shadow (CPU only) and lowdiff-none-layerwise."""
    modes: list[Mode] = [Mode("plain")]
    for comp in ("topk", "powersgd", "none"):
        modes.append(LowDiffMode(comp, False, every, batch_steps[comp], codec, ld_window, warm_snapshot))
        modes.append(LowDiffMode(comp, True, every, batch_steps[comp], codec, ld_window, warm_snapshot))
        if comp == "none":  # the LowDiff+ variants (the shadow replica is refused when training on a GPU)
            for variant in LowDiffPlusMode.VARIANTS:
                if not (variant == "shadow" and DEVICE.type != "cpu"):
                    modes.append(LowDiffPlusMode(comp, variant, every, batch_steps[comp], codec, ld_window,
                                                   warm_snapshot))
        if auto is not None and (comp in auto["compressors"] or f"lowdiff-{comp}-auto" in (names or [])):
            modes.append(AutoLowDiffMode(comp, codec, ld_window, auto["mtbf_hours"], auto["max_overhead"],
                                         auto["max_warmup_steps"], auto.get("retune_drift")))
    for k in ks:
        modes.append(TorchSaveMode(k))
        modes.append(CheckFreqMode(k))
        if with_dcp:
            modes.append(DCPMode(k))
        modes.append(NaiveDiffMode(k))
    for m in modes:
        m.window = ld_window if m.family == "lowdiff" else window  # an auto mode picks its own in warm()
    if names:
        keep = set(names) | {"plain"} | {m.ref for m in modes if m.name in names}
        modes = [m for m in modes if m.name in keep]
    return modes


def payload_bytes_per_step(model: torch.nn.Module, comp: str) -> int:
    total = 0
    for _, p in model.named_parameters():
        if comp == "topk":
            total += k_for(p.numel(), TOPK_RATIO) * (p.element_size() + 4)  # values + int32 indices
        elif comp == "powersgd":
            dims = factor_shapes(p.shape, PSGD_RANK)
            total += p.numel() * p.element_size() if dims is None else (dims[0] + dims[1]) * dims[2] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


# -- statistics ------------------------------------------------------------------------------------------------------


def iqr(xs: list[float]) -> list[float] | None:
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def stratified(ratios: list[float], events: list[int], k: int | None, s: int) -> tuple[float, str]:
    """Median ratio, weighting rounds with and without an event by how often they occur in a long run."""
    if k is None or k <= s:
        return median(ratios), "median over all rounds"
    with_ev = [r for r, e in zip(ratios, events) if e]
    without = [r for r, e in zip(ratios, events) if not e]
    w = s / k
    if not with_ev or not without:
        return median(ratios), f"INCOMPLETE: {len(with_ev)} rounds with an event, {len(without)} without"
    return (1 - w) * median(without) + w * median(with_ev), (
        f"stratified: {1 - w:.2f} x median of {len(without)} rounds without + {w:.2f} x median of "
        f"{len(with_ev)} round(s) with a checkpoint event")


def step_tail(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The step-time tail of one mode over all its timed steps (issue #8: does a step wait for a snapshot?):
    max / median step time, and the median of the steps that took a checkpoint event (a lowdiff snapshot step, a
    baseline's save) over the median of the other steps (None unless both kinds were timed)."""
    times = [t for w in windows for t in w["step_s"]]
    at = [w["step_s"][i] for w in windows for i in w.get("event_steps", [])]
    other = [t for w in windows for i, t in enumerate(w["step_s"]) if i not in w.get("event_steps", [])]
    med = median(times)
    return {"step_median_s": med, "step_max_s": max(times) if times else None,
            "max_over_median": max(times) / med if times and med > 0 else None,
            "event_steps_timed": len(at),
            "event_steps_over_others": median(at) / median(other) if at and other else None}


# -- the benchmark ----------------------------------------------------------------------------------------------------


def measure_bandwidth(modes: list[Mode], work: Path, reps: int, max_bytes: int) -> dict[str, Any]:
    """Re-write the last captured records of each lowdiff mode with lowdiff's write_segment, interleaved with a
    raw os.write + fsync of the same number of bytes (the committed file's content), medians of ``reps``."""
    out: dict[str, Any] = {}
    codecs = ("lz4", "none") if lz4_available() else ("none",)
    for m in modes:
        if not isinstance(m, LowDiffMode) or not m.enabled or isinstance(m, (AutoLowDiffMode, LowDiffPlusMode)):
            continue
        recs = _LAST_RECORDS.get(str(m.run_dir), [])
        if not recs:
            continue
        per = max(1, recs[-1].payload_nbytes)
        n = max(1, min(len(recs), max_bytes // per))
        recs = recs[-n:]
        scratch = work / f"bw-{m.name}"
        (scratch / "log").mkdir(parents=True, exist_ok=True)
        res: dict[str, Any] = {"steps_per_segment": n, "payload_bytes": sum(r.payload_nbytes for r in recs)}
        samples: dict[str, list[float]] = {}
        sizes: dict[str, int] = {}
        for _ in range(reps):
            for codec in codecs:
                t0 = time.perf_counter()
                nbytes = write_segment(scratch, recs, codec, m.comp)
                samples.setdefault(f"lowdiff_{codec}_s", []).append(time.perf_counter() - t0)
                sizes[codec] = nbytes
                seg = next((scratch / "log").iterdir())
                data = seg.read_bytes()
                seg.unlink()
                raw = scratch / "raw.bin"
                t0 = time.perf_counter()
                raw_write_fsync(raw, data)
                samples.setdefault(f"raw_{codec}_s", []).append(time.perf_counter() - t0)
                raw.unlink()
                del data
        for codec in codecs:
            lo, raw_s = median(samples[f"lowdiff_{codec}_s"]), median(samples[f"raw_{codec}_s"])
            res[codec] = {"segment_bytes": sizes[codec], "lowdiff_write_s": lo, "raw_write_fsync_s": raw_s,
                          "lowdiff_MBps": mb(sizes[codec]) / lo, "raw_MBps": mb(sizes[codec]) / raw_s,
                          "bandwidth_ratio": raw_s / lo,
                          "payload_MBps_lowdiff": mb(res["payload_bytes"]) / lo,
                          "samples": samples}
        out[m.name] = res
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def model_spec(args: argparse.Namespace) -> Any:
    spec = SMOKE_MODEL if args.smoke else MODEL_SIZES[args.model_size]
    changes = {k: v for k, v in (("batch", args.batch), ("block", args.block)) if v}
    return dataclasses.replace(spec, **changes) if changes else spec


def set_device(args: argparse.Namespace) -> None:
    global DEVICE, SNAPSHOT_KEEP, CLIP
    SNAPSHOT_KEEP = 1 if getattr(args, "tidy", False) else 0
    CLIP = not getattr(args, "no_clip", False)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    DEVICE = torch.device(args.device)


def run_probe_mode(args: argparse.Namespace) -> None:
    """``--probe MODE``: fresh process, train a few steps of one mode, print peak RSS as JSON."""
    torch.set_num_threads(args.threads)
    set_device(args)
    spec = model_spec(args)
    every = 2  # a full snapshot is in flight during the probe, as it is every `snapshot.every_steps` in training
    modes = build_modes(None, [1], every, 1, 1, args.codec, _batch_steps(args), with_dcp=True)
    mode = next(m for m in modes if m.name == args.probe)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-probe-", dir=args.work_dir))
    try:
        model = spec.build().to(DEVICE)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        batches = to_device(spec.batches(2), DEVICE)
        mode.setup(Ctx(model, inner, work))
        for i in range(args.probe_steps):
            mode.step(batches[i % 2])
        mode.end_window()
        mode.close()
        gpu = torch.cuda.max_memory_allocated(DEVICE) if DEVICE.type == "cuda" else None
        print(json.dumps({"mode": mode.name, "peak_rss_bytes": peak_rss_bytes(), "maxrss_bytes": maxrss_bytes(),
                          "cuda_peak_allocated_bytes": gpu}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure_memory(args: argparse.Namespace, every: int, with_dcp: bool) -> dict[str, Any]:
    memory: dict[str, Any] = {
        "method": "peak RSS (VmHWM from /proc/self/status; psutil is not installed, and ru_maxrss carries the "
                  "parent's RSS over fork+exec) of a fresh process per mode that builds the model and trains a few "
                  "steps of that mode (k=1; lowdiff with a snapshot every 2 steps, so a snapshot is in flight as it "
                  "is every snapshot.every_steps in training)",
        "peak_rss_bytes": {}, "cuda_peak_allocated_bytes": {}}
    names = ["plain", "lowdiff-topk"] if args.smoke else \
        [m.name for m in build_modes(None, [1], every, 1, 1, args.codec, _batch_steps(args), with_dcp)]
    for name in names:
        r = run_probe(Path(__file__), ["--probe", name, "--threads", str(args.threads), "--codec", args.codec,
                                       "--device", args.device, "--model-size", args.model_size,
                                       *(["--batch", str(args.batch)] if args.batch else []),
                                       *(["--block", str(args.block)] if args.block else []),
                                       "--batch-steps", str(args.batch_steps),
                                       "--batch-steps-none", str(args.batch_steps_none),
                                       "--probe-steps", "3" if args.smoke else "6",
                                       *(["--no-clip"] if args.no_clip else []),
                                       *(["--smoke"] if args.smoke else [])], timeout_s=600)
        memory["peak_rss_bytes"][name] = r["peak_rss_bytes"]
        memory["cuda_peak_allocated_bytes"][name] = r.get("cuda_peak_allocated_bytes")
        print(f"  peak RSS {name}: {mb(r['peak_rss_bytes']):.0f} MB", flush=True)
    return memory


def attach_memory(results: dict[str, Any], memory: dict[str, Any]) -> None:
    peaks = memory.get("peak_rss_bytes", {})
    gpu = memory.get("cuda_peak_allocated_bytes") or {}
    for mname, res in results.items():
        probe_name = mname if res["family"] in ("plain", "lowdiff") else f"{res['family']}-k1"
        if probe_name in peaks and "plain" in peaks:
            res["peak_rss_bytes"] = peaks[probe_name]
            res["peak_rss_over_plain_bytes"] = peaks[probe_name] - peaks["plain"]
        if gpu.get(probe_name) is not None and gpu.get("plain") is not None:
            res["cuda_peak_over_plain_bytes"] = gpu[probe_name] - gpu["plain"]


def memory_only(args: argparse.Namespace) -> None:
    """Re-measure peak memory for an existing overhead.json (its timing results are kept) and re-render."""
    json_path, md_path, png_path = output_paths(args.out_dir, out_name(args))
    out = json.loads(json_path.read_text())
    pr = out["protocol"]
    memory = measure_memory(args, pr["lowdiff_snapshot_every_steps"], any(m.startswith("dcp-") for m in out["modes"]))
    memory["measured_separately_by"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    memory["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    out["memory"] = memory
    attach_memory(out["modes"], memory)
    write_json(json_path, out)
    write_markdown(md_path, out)
    plot(png_path, out)
    print(f"overhead: memory re-measured -> {json_path}, {md_path}", flush=True)


def out_name(args: argparse.Namespace) -> str:
    return args.out_name or ("overhead" if args.device == "cpu" else f"overhead-{args.device}")


def _batch_steps(args: argparse.Namespace) -> dict[str, int]:
    return {"topk": args.batch_steps, "powersgd": args.batch_steps, "none": args.batch_steps_none}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 short rounds: finishes in seconds")
    ap.add_argument("--out-dir", help="write overhead.json/.md/.png here instead of bench/results and docs/")
    ap.add_argument("--work-dir", default=None, help="where checkpoints are written (default: system tmp)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--window", type=int, help="steps per window of plain and the baselines (default 5)")
    ap.add_argument("--lowdiff-window", type=int, help="steps per window of the lowdiff modes (default 10)")
    ap.add_argument("--ks", help="comma-separated checkpoint intervals for the baselines (default 1,10,50)")
    ap.add_argument("--snapshot-every", type=int, help="lowdiff snapshot.every_steps (default 50)")
    ap.add_argument("--batch-steps", type=int, default=2, help="lowdiff log.batch_steps for topk/powersgd")
    ap.add_argument("--batch-steps-none", type=int, default=1, help="log.batch_steps for compressor none")
    ap.add_argument("--codec", default="auto", help="log.codec (default: the library's default, auto)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model, optimizer state and batches live (default cpu)")
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                    help="small: GPT 10.8M, 4x128 tokens (default); 50m: GPT 49.6M, 8x256 tokens (issue #3's size)")
    ap.add_argument("--batch", type=int, help="sequences per step (overrides the model size's)")
    ap.add_argument("--block", type=int, help="tokens per sequence (overrides the model size's)")
    ap.add_argument("--out-name", help="output base name (default overhead, or overhead-cuda on --device cuda)")
    ap.add_argument("--tidy", action="store_true",
                    help="for small disks: delete each baseline's checkpoint files after each window (untimed; the "
                         "next save then writes a new file instead of replacing one) and run lowdiff with "
                         "snapshot.keep 1 (retention in its writer)")
    ap.add_argument("--auto", action="store_true",
                    help="add lowdiff-C-auto (snapshot.every_steps and log.batch_steps auto) for --auto-compressors")
    ap.add_argument("--auto-compressors", default="topk", help="comma-separated (default topk)")
    ap.add_argument("--auto-mtbf-hours", type=float, default=1.0, help="tuner.mtbf_hours of the auto modes")
    ap.add_argument("--auto-max-overhead", type=float, default=0.02, help="tuner.max_overhead of the auto modes")
    ap.add_argument("--auto-max-warmup", type=int, default=2000,
                    help="most warm-up steps an auto mode waits for the tuner's first decision and a snapshot after")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: see docs)")
    ap.add_argument("--no-clip", action="store_true",
                    help="no clip_grad_norm_ in any mode: clipping scales gradients in place after backward, so "
                         "lowdiff-none-layerwise's captures go stale and lowdiff removes its hooks (the mode then "
                         "measures the step() copy); use with --modes lowdiff-none-layerwise to measure the hooks")
    ap.add_argument("--time-first-snapshot", action="store_true",
                    help="lowdiff modes warm up W-1 steps only, so the first snapshot of the run (which allocates "
                         "the host buffers later ones reuse) is timed; by default it falls in the warm-up")
    ap.add_argument("--modes", help="comma-separated subset of modes (plus their references)")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-mode peak-RSS subprocesses")
    ap.add_argument("--bw-reps", type=int)
    ap.add_argument("--render-only", action="store_true", help="re-render .md and .png from an existing overhead.json")
    ap.add_argument("--memory-only", action="store_true",
                    help="only re-measure peak memory into an existing overhead.json (timings are kept)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--probe-steps", type=int, default=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        run_probe_mode(args)
        return
    if args.memory_only:
        set_device(args)
        memory_only(args)
        return
    if args.render_only:
        json_path, md_path, png_path = output_paths(args.out_dir, out_name(args))
        out = json.loads(json_path.read_text())
        write_markdown(md_path, out)
        plot(png_path, out)
        return

    torch.set_num_threads(args.threads)
    set_device(args)
    spec = model_spec(args)
    names = args.modes.split(",") if args.modes else None
    auto = {"compressors": args.auto_compressors.split(",") if args.auto else [], "mtbf_hours": args.auto_mtbf_hours,
            "max_overhead": args.auto_max_overhead, "max_warmup_steps": args.auto_max_warmup,
            # --smoke: a tiny model's write times jitter by more than the default drift, and a re-decision between
            # warm-up and the end would leave the windows aligned to an interval no longer in force.
            "retune_drift": 1.0 if args.smoke else None}
    rounds = args.rounds or (2 if args.smoke else 6)
    s = args.window or (2 if args.smoke else 5)
    s_ld = args.lowdiff_window or (2 if args.smoke else 10)
    ks = [int(k) for k in args.ks.split(",")] if args.ks else ([1, 2, 4] if args.smoke else [1, 10, 50])
    every = args.snapshot_every or (4 if args.smoke else 50)
    bw_reps = args.bw_reps or (1 if args.smoke else 5)
    for k, w in [*((k, s) for k in ks), (every, s_ld)]:
        if (k > w and k % w) or (k <= w and w % k):
            ap.error(f"interval {k} and window {w}: one must divide the other (events must start windows)")
    if every < s_ld * rounds and not args.smoke:
        print(f"note: lowdiff snapshot every {every} steps; it lands in round {every // s_ld - 1}", flush=True)
    for b in (args.batch_steps, args.batch_steps_none):
        if s_ld % b:
            ap.error(f"batch steps {b} must divide --lowdiff-window {s_ld}")
    global _KEEP_RECORDS
    _KEEP_RECORDS = s_ld
    json_path, md_path, png_path = output_paths(args.out_dir, out_name(args))
    notes: list[str] = []
    with_dcp, dcp_note = dcp_available()
    notes.append(dcp_note)
    have = [m.name for m in build_modes(None, ks, every, s, s_ld, args.codec, _batch_steps(args), with_dcp, auto)]
    unknown = sorted(set(names or []) - set(have) - {f"lowdiff-{c}-auto" for c in ("topk", "powersgd", "none")})
    if unknown:
        ap.error(f"--modes: unknown or not available here: {', '.join(unknown)} (have: {', '.join(have)})")
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="lowdiff-overhead-", dir=args.work_dir))
    info = machine_info()
    info["device"] = device_info(DEVICE)
    print(f"overhead: device {DEVICE}, model {spec}, {rounds} rounds, windows {s}/{s_ld} steps, ks {ks}, "
          f"work dir {work}", flush=True)
    try:
        model = spec.build().to(DEVICE)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        nparams = sum(p.numel() for p in model.parameters())
        batches = to_device(spec.batches(8), DEVICE)
        ctx = Ctx(model, inner, work)
        modes = build_modes(names, ks, every, s, s_ld, args.codec, _batch_steps(args), with_dcp, auto,
                            warm_snapshot=not args.time_first_snapshot)
        train_step(model, inner, batches[0])  # AdamW state exists before anyone snapshots it
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        state_bytes += sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor))
        gi = 0

        def next_batch() -> Any:
            nonlocal gi
            gi += 1
            return batches[(gi - 1) % len(batches)]

        for m in modes:
            m.setup(ctx)
            m.warm(next_batch)
            m.start_timed()
        print(f"  setup + warm-up {time.perf_counter() - t_start:.0f} s", flush=True)
        gc.collect()
        gc.freeze()  # a full collection walks torch's huge module graph (~0.4 s); keep it out of the timed steps
        bytes0 = {m.name: m.bytes_written() for m in modes}
        comp0 = {m.name: m.compress_s for m in modes}
        seg0 = {k: len(v) for k, v in _SEGMENT_LOG.items()}
        plain = next(m for m in modes if m.name == "plain")
        baselines = [m for m in modes if m.family not in ("plain", "lowdiff")]
        by_name = {m.name: m for m in modes}
        ld_block: list[Mode] = []
        for m in modes:
            if m.family == "lowdiff" and m.ref != "plain":
                # every enabled window sits between two windows of its enabled:false twin
                ld_block += [by_name[m.ref], m, by_name[m.ref]]

        def run_window(m: Mode) -> dict[str, Any]:
            nonlocal gi
            n = m.window
            times, event_at = [], []
            m.begin_window()
            sync()  # on a GPU: nothing of the previous window runs into this one
            c0 = time.process_time()
            for i in range(n):
                b = batches[gi % len(batches)]
                gi += 1
                t0 = time.perf_counter()
                if m.step(b):
                    event_at.append(i)
                if i == n - 1:
                    sync()  # the last step's time absorbs the queued GPU work: the window's sum is real
                times.append(time.perf_counter() - t0)
            cpu = time.process_time() - c0
            wait = m.end_window()
            if args.tidy:
                m.tidy()
            return {"mode": m.name, "mean_step_s": sum(times) / n, "cpu_step_s": cpu / n, "step_s": times,
                    "events": len(event_at), "event_steps": event_at, "drain_s": wait,
                    "t_s": time.perf_counter() - t_start}

        windows: list[list[dict[str, Any]]] = []  # per round, in execution order
        for r in range(rounds):
            rot = baselines[r % max(len(baselines), 1):] + baselines[: r % max(len(baselines), 1)]
            seq: list[Mode] = [plain]
            for m in rot:
                seq += [m, plain]  # every baseline window sits between two plain windows
            seq = seq + ld_block if r % 2 == 0 else ld_block + seq
            windows.append([run_window(m) for m in seq])
            pl = [w["mean_step_s"] for w in windows[-1] if w["mode"] == "plain"]
            print(f"  round {r + 1}/{rounds} done at {time.perf_counter() - t_start:.0f} s; plain "
                  f"{median(pl):.3f} s/step (median of {len(pl)} windows)", flush=True)
        for m in modes:
            m.finish()
        total_steps = {m.name: 0 for m in modes}
        for rw in windows:
            for w in rw:
                total_steps[w["mode"]] += len(w["step_s"])
        # Per mode and round: ratio to the reference measured closest in time.
        ratios: dict[str, dict[str, list[float]]] = {m.name: {"wall": [], "cpu": [], "drain": [], "plain": [],
                                                               "events": []} for m in modes}
        for rw in windows:
            plain_wall = median([w["mean_step_s"] for w in rw if w["mode"] == "plain"])
            plain_cpu = median([w["cpu_step_s"] for w in rw if w["mode"] == "plain"])
            for i, w in enumerate(rw):
                m = next(x for x in modes if x.name == w["mode"])
                is_baseline = m.family not in ("plain", "lowdiff")
                is_enabled_lowdiff = m.family == "lowdiff" and m.ref != "plain"
                if is_baseline or is_enabled_lowdiff:
                    # the reference windows right before and after (plain, or the enabled:false twin)
                    refs = [x for x in (rw[i - 1] if i else None, rw[i + 1] if i + 1 < len(rw) else None)
                            if x and x["mode"] == m.ref]
                else:
                    refs = []
                ref_wall = sum(x["mean_step_s"] for x in refs) / len(refs) if refs else plain_wall
                ref_cpu = sum(x["cpu_step_s"] for x in refs) / len(refs) if refs else plain_cpu
                n = len(w["step_s"])
                d = ratios[m.name]
                d["wall"].append(w["mean_step_s"] / ref_wall)
                d["cpu"].append(w["cpu_step_s"] / ref_cpu)
                d["drain"].append((w["mean_step_s"] * n + w["drain_s"]) / (ref_wall * n))
                d["plain"].append(w["mean_step_s"] / plain_wall)
                d["events"].append(w["events"])
        results: dict[str, Any] = {}
        for m in modes:
            d = ratios[m.name]
            mine = [w for rw in windows for w in rw if w["mode"] == m.name]
            if m.name == "plain":
                d = {k: [1.0] * len(mine) if k != "events" else [0] * len(mine) for k in d}
            ev = d["events"]
            ratio, how = stratified(d["wall"], ev, m.k, m.window)
            res: dict[str, Any] = {
                "family": m.family, "k": m.k, "reference": m.ref, "window_steps": m.window,
                "ratio": ratio, "ratio_iqr": iqr(d["wall"]) if not m.k or m.k <= m.window else None,
                "ratio_incl_drain": stratified(d["drain"], ev, m.k, m.window)[0],
                "ratio_cpu": stratified(d["cpu"], ev, m.k, m.window)[0],
                "ratio_vs_plain": stratified(d["plain"], ev, m.k, m.window)[0], "statistic": how,
                "median_step_s": median([w["mean_step_s"] for w in mine]),
                "bytes_per_step": (m.bytes_written() - bytes0[m.name]) / total_steps[m.name],
                "compress_s_per_step": (m.compress_s - comp0[m.name]) / total_steps[m.name],
                "drain_s_per_window": median([w["drain_s"] for w in mine]),
                **step_tail(mine),
                "round_ratios": d["wall"], "round_ratios_cpu": d["cpu"], "windows": mine, **m.info(),
            }
            if isinstance(m, LowDiffMode):
                res["payload_bytes_per_step"] = payload_bytes_per_step(model, m.comp)
                if m.enabled:
                    st = m.stats()
                    segs = _SEGMENT_LOG.get(str(m.run_dir), [])[seg0.get(str(m.run_dir), 0):]
                    res["log_bytes_per_step"] = None
                    res["segments_in_training"] = [{"bytes": n, "write_s": dt} for n, dt in segs]
                    if segs:
                        nb, ts = sum(n for n, _ in segs), sum(dt for _, dt in segs)
                        res["log_bytes_per_step"] = nb / total_steps[m.name]
                        res["segment_MBps_in_training"] = mb(nb) / ts if ts else None
                    res["blocked_s_total"] = st.blocked_s if st else None
            if isinstance(m, _IntervalMode):
                res["saves"] = m.saves
                res["bytes_per_save"] = m.bytes_written() / max(m.saves, 1)
            results[m.name] = res
        print(f"  rounds done at {time.perf_counter() - t_start:.0f} s; bandwidth test", flush=True)
        bandwidth = measure_bandwidth(modes, work, bw_reps, max_bytes=64 << 20)
        for m in modes:
            m.close()
        shutil.rmtree(work, ignore_errors=True)
        memory = {"skipped": True} if args.no_memory else measure_memory(args, every, with_dcp)
        attach_memory(results, memory)
        out = {
            "benchmark": "overhead", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "machine": info, "device": DEVICE.type,
            "model": {**spec.as_dict(), "params": nparams, "state_bytes_model_plus_adam": state_bytes,
                      "size": "smoke" if args.smoke else args.model_size},
            "protocol": {"rounds": rounds, "window_steps": s, "lowdiff_window_steps": s_ld, "ks": ks,
                         "first_snapshot_timed": bool(args.time_first_snapshot),
                         "lowdiff_snapshot_every_steps": every,
                         "lowdiff_batch_steps": _batch_steps(args), "codec": args.codec, "torch_threads": args.threads,
                         "auto": auto, "tidy": args.tidy, "snapshot_keep": SNAPSHOT_KEEP,
                         "optimizer": "AdamW(lr=3e-4)" + (", clip_grad_norm 1.0" if CLIP else ", no clipping"),
                         "clip_grad_norm": CLIP, "topk_ratio": TOPK_RATIO,
                         "powersgd_rank": PSGD_RANK},
            "modes": results, "bandwidth": bandwidth, "memory": memory, "notes": notes,
            "runtime_s": time.perf_counter() - t_start, "loadavg_end": os.getloadavg(),
        }
        write_json(json_path, out)
        write_markdown(md_path, out)
        plot(png_path, out)
        print(f"overhead: done in {out['runtime_s']:.0f} s -> {json_path}, {md_path}, {png_path}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- reporting ----------------------------------------------------------------------------------------------------


def _pct(r: float | None) -> str:
    return "n/a" if r is None or (isinstance(r, float) and math.isnan(r)) else f"{(r - 1) * 100:+.1f} %"


GPU_CAVEATS = [
    "GPU: the stream is synchronized at window boundaries only, so a window's mean step time is real and the "
    "per-step times inside it are host-side; compression times are host-side (the -off twin's ratio to plain is "
    "the real compression cost). Checkpoints go to the machine's local disk.",
    "GPU: 'max / median step' and 'event steps / others' use those host-side per-step times, and the last step of "
    "each window absorbs the queued GPU work, so they are no measure of the GPU's step-time tail (bench/steptimes.py "
    "times each step to the end of its kernels).",
]
CAVEATS = [
    "Shared machine: other jobs load the 2 cores (load averages in the header), so wall-clock ratios carry "
    "roughly +-10-20 % noise per round (per-round ratios are in the JSON) and overheads below ~10 % are not "
    "resolvable here; the CPU-time ratio is steadier. One torch thread trains, so one core is nominally free for "
    "background writers, but other jobs compete for it.",
    "Tokens per step are few (CPU training), so per-step checkpoint costs weigh more than with realistic batches.",
    "Peak RSS of k=10 and k=50 is that of k=1 (one checkpoint in flight either way).",
]


def _iqr(q: list[float] | None) -> str:
    return "-" if not q else f"{(q[0] - 1) * 100:+.0f} .. {(q[1] - 1) * 100:+.0f} %"


def _x(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _tail(r: dict[str, Any]) -> tuple[str, str]:
    """The 'max / median step' and 'event steps / others' cells ('-' for results without them)."""
    ev = r.get("event_steps_over_others")
    return _x(r.get("max_over_median")), "-" if ev is None else f"{ev:.2f} ({r['event_steps_timed']})"


def write_markdown(path: Path, out: dict[str, Any]) -> None:
    mdl, pr = out["model"], out["protocol"]
    dev = out.get("machine", {}).get("device", {"type": "cpu"})
    where = "CPU" if dev.get("type", "cpu") == "cpu" else f"{dev.get('name', dev['type'])} (CUDA {dev.get('cuda')})"
    lines = [
        "# Checkpointing overhead",
        "",
        f"Generated by `{out['command']}` on {out['machine']['date']} (git {out['machine']['git_commit'][:10]}); "
        f"{out['machine']['cpu_count']} CPUs, torch {out['machine']['torch']}, {pr['torch_threads']} torch thread(s); "
        f"runtime {out['runtime_s']:.0f} s; load average at start {out['machine']['loadavg_start'][0]:.1f}, "
        f"at end {out['loadavg_end'][0]:.1f} (shared machine).",
        "",
        f"Model: GPT, {mdl['n_layer']} layers, d_model {mdl['d_model']}, {mdl['params'] / 1e6:.1f} M parameters, "
        f"batch {mdl['batch']} x {mdl['block']} tokens, {pr['optimizer']}, {where}. Model + AdamW state: "
        f"{mb(mdl['state_bytes_model_plus_adam']):.0f} MB.",
        "",
        f"Protocol: {pr['rounds']} rounds; in each, windows of {pr['window_steps']} steps of plain training and of "
        f"each baseline alternate (P X1 P X2 ... P), and each lowdiff mode runs {pr['lowdiff_window_steps']} steps "
        "between two windows of its `enabled: false` twin; one process, one shared model (see the docstring of "
        "bench/overhead.py). Overhead = median over rounds of (window mean step time / mean step time of its "
        "reference measured next to it), stratified by rounds with and without a checkpoint event when the "
        "interval exceeds the window. "
        + ("The run's first lowdiff snapshot (it allocates the host buffers later ones reuse) is timed. "
           if pr.get("first_snapshot_timed") else
           "Each lowdiff mode's first snapshot (it allocates the host buffers later ones reuse) falls in its "
           "warm-up; the timed snapshots are the steady state. " if "first_snapshot_timed" in pr else "")
        + "The reference of `lowdiff-C` is `lowdiff-C-off` (same compressor, "
        "`enabled: false`), so compression cost is excluded; every other reference is `plain`. 'incl. drain' also "
        "charges the wait for background work still pending at the end of a window (an upper bound). 'CPU' is "
        "the same ratio on process CPU time (all threads, so background work counts in full; waiting on the disk "
        "does not). Peak RSS: " + out["memory"].get("method", "not measured") + ".",
        "",
    ]
    if any(n.startswith("lowdiff-none") for n in out["modes"]):
        lines += [
            "LowDiff+ variants of compressor none, each between two windows of `lowdiff-none-off` like "
            "`lowdiff-none`: `lowdiff-none-shadow` (`snapshot.shadow: true`: the writer thread keeps a CPU replica "
            "in step by applying every logged step and writes the full snapshots from it, so the training thread "
            "never copies its state for them; CPU only) and `lowdiff-none-layerwise` (`log.capture: layerwise`: "
            "post-accumulate-grad hooks copy each gradient during backward; lowdiff removes them when gradients "
            "change after backward, as clipping does).",
            "",
        ]
    lines += [
        "Step-time tail, per mode over all its timed steps: 'max / median step' = slowest step / median step (plain's "
        "own, below the table, is the machine's noise floor); 'event steps / others' = median of the steps that took "
        "a checkpoint event (a lowdiff snapshot step, a baseline's save; how many in parentheses) / median of the "
        "other steps, '-' when no event fell in a timed window or every step had one. Issue #8's bar for "
        "`snapshot.shadow: true`: no step waits for a full snapshot, max / median within 1.2.",
        "",
        "| mode | k | overhead vs ref | IQR over rounds | ref | incl. drain | CPU | vs plain | bytes/step | "
        "payload/step | peak RSS over plain | compress/step | max / median step | event steps / others |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in out["modes"].items():
        if name == "plain":
            continue
        rss = r.get("peak_rss_over_plain_bytes")
        payload = r.get("payload_bytes_per_step")
        k = f"1 (snapshot every {r['k']})" if r["family"] == "lowdiff" and r["k"] else (r["k"] or "-")
        if r.get("snapshot_every_steps") == "auto":
            k = f"1 (auto: snapshot every {r['in_force']['every_steps']}, {r['in_force']['batch_steps']} steps/segment)"
        lines.append(
            f"| {name} | {k} | {_pct(r['ratio'])} | {_iqr(r.get('ratio_iqr'))} | {r['reference']} | "
            f"{_pct(r['ratio_incl_drain'])} | {_pct(r.get('ratio_cpu'))} | {_pct(r['ratio_vs_plain'])} | "
            f"{mb(r['bytes_per_step']):.2f} MB | "
            f"{'-' if payload is None else f'{mb(payload):.2f} MB'} | "
            f"{'-' if rss is None else f'{mb(rss):.0f} MB'} | {r['compress_s_per_step'] * 1e3:.1f} ms | "
            f"{' | '.join(_tail(r))} |")
    pl = out["modes"]["plain"]
    lines += ["", f"Plain training: median {pl['median_step_s']:.3f} s per step"
              + (f"; max / median step {_x(pl['max_over_median'])}." if pl.get("max_over_median") else "."), ""]
    plus = {n: r for n, r in out["modes"].items() if r.get("variant")}
    if plus:
        lines += ["## LowDiff+ variants (compressor none)", "",
                  "Against the same reference, `lowdiff-none-off`; `lowdiff-none` for comparison.", "",
                  "| mode | overhead vs ref | CPU | max / median step | snapshot steps / others | |",
                  "|---|---|---|---|---|---|"]
        for name in ["lowdiff-none", *plus]:
            r = out["modes"].get(name)
            if r is None:
                continue
            note = ""
            if r.get("variant") == "shadow":
                mom = r.get("max_over_median")
                bar = "-" if mom is None else ("met" if mom <= 1.2 else "NOT met")
                note = (f"issue #8 bar (max / median <= 1.2): {bar} (plain's own: {_x(pl.get('max_over_median'))}); "
                        + ("snapshots written from the replica throughout" if r.get("shadow_in_force") else
                           "REPLICA FAILED: snapshots fell back to the training thread (see the log)"))
            elif r.get("variant") == "layerwise" and r.get("capture"):
                c = r["capture"]
                note = (f"timed steps: {c['hits_timed']} gradients taken from the hooks' copies, "
                        f"{c['misses_timed']} stale")
                removed = c.get("hooks_removed_by_lowdiff_at_step")
                if removed is not None:
                    why = ("clip_grad_norm_ scales them in place; --no-clip measures the hooks"
                           if pr.get("clip_grad_norm", True) else "stale captures")
                    note += (f"; lowdiff removed its hooks at step {removed} ({why}), so later steps copy in step() "
                             "as lowdiff-none does")
            mom, ev = _tail(r)
            lines.append(f"| {name} | {_pct(r['ratio'])} | {_pct(r.get('ratio_cpu'))} | {mom} | {ev} | {note} |")
        lines.append("")
    if out["bandwidth"]:
        lines += ["## Segment write bandwidth", "",
                  "lowdiff's `write_segment` (encode, HDF5 container, pwrite, fsync, rename, directory fsync) on the "
                  "last records captured in training, interleaved with a raw `os.write` + `fsync` of the same "
                  "bytes; medians.", "",
                  "| mode | steps/segment | codec | segment | lowdiff | raw write+fsync | lowdiff / raw |",
                  "|---|---|---|---|---|---|---|"]
        for name, b in out["bandwidth"].items():
            for codec in ("lz4", "none"):
                if codec not in b:
                    continue
                c = b[codec]
                lines.append(f"| {name} | {b['steps_per_segment']} | {codec} | {mb(c['segment_bytes']):.1f} MB | "
                             f"{c['lowdiff_MBps']:.0f} MB/s | {c['raw_MBps']:.0f} MB/s | {c['bandwidth_ratio']:.2f} |")
        lines.append("")
    autos = {n: r for n, r in out["modes"].items() if r.get("snapshot_every_steps") == "auto"}
    if autos:
        lines += ["## Auto settings (issue #7)", "",
                  "`snapshot.every_steps: auto`, `log.batch_steps: auto`; measured overhead vs the `enabled: false` "
                  "twin, next to the tuner's bound and its own prediction (the decision in force at the end).", "",
                  "| mode | tuner.max_overhead | MTBF | chosen F / B | predicted overhead | measured | incl. drain | "
                  "CPU | rounds with a snapshot | statistic |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in autos.items():
            d = r["decisions"][-1] if r["decisions"] else None
            pred = f"{d['predicted_overhead'] * 100:.2f} %" if d else "no decision"
            with_ev = sum(1 for e in r["windows"] if e["events"])
            fb = f"{r['in_force']['every_steps']} / {r['in_force']['batch_steps']}"
            lines.append(f"| {name} | {r['tuner_max_overhead']:.3g} | {r['tuner_mtbf_hours']:g} h | {fb} | {pred} | "
                         f"{_pct(r['ratio'])} | {_pct(r['ratio_incl_drain'])} | {_pct(r.get('ratio_cpu'))} | "
                         f"{with_ev} of {len(r['windows'])} | {r['statistic']} |")
        lines.append("")
        for name, r in autos.items():
            lines += [f"{name}: {r['alignment']}. Decisions:", ""]
            lines += [f"- {d['summary']}" for d in r["decisions"]] + [""]
    caveats = CAVEATS if dev.get("type", "cpu") == "cpu" else GPU_CAVEATS + CAVEATS[2:]
    lines += ["## Notes", ""] + [f"- {n}" for n in caveats + out["notes"]] + [""]
    path.write_text("\n".join(lines))


def plot(path: Path, out: dict[str, Any]) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, key, what in ((axes[0], "ratio", "wall-clock step time"), (axes[1], "ratio_cpu", "process CPU time")):
        fams: dict[str, list[tuple[int, float]]] = {}
        for r in out["modes"].values():
            if r["family"] not in ("plain", "lowdiff") and r["k"] and r.get(key) is not None:
                fams.setdefault(r["family"], []).append((r["k"], (r[key] - 1) * 100))
        for fam, pts in sorted(fams.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{fam} every k (vs plain)")
        for name, r in out["modes"].items():
            if r["family"] == "lowdiff" and r.get("enabled") and r.get(key) is not None:
                ax.plot([1], [(r[key] - 1) * 100], "*", markersize=14,
                        label=f"{name} every step (vs {r['reference']})")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ks = sorted({r["k"] for r in out["modes"].values() if r["family"] not in ("plain", "lowdiff") and r["k"]})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("checkpoint interval k (steps)")
        ax.set_title(f"overhead in {what}", fontsize=10)
    axes[0].set_ylabel("overhead (%)")
    axes[1].legend(fontsize=7)
    mdl = out["model"]
    dev = out.get("machine", {}).get("device", {"type": "cpu"})
    where = "CPU" if dev.get("type", "cpu") == "cpu" else dev.get("name", "GPU")
    fig.suptitle(f"Checkpoint overhead, GPT {mdl['params'] / 1e6:.1f}M, {mdl['tokens_per_step']} tokens/step, {where}; "
                 f"median of {out['protocol']['rounds']} interleaved rounds on a shared "
                 f"{out['machine']['cpu_count']}-core machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
