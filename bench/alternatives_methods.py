"""The methods bench/alternatives.py compares, built on the modes of bench/overhead.py (overhead_modes.py,
overhead_lowdiff.py): plain training; DCP ``async_save`` in thread mode and in process mode (``DefaultStager``);
CheckFreq-style snapshot-then-persist; ``torch.save`` + fsync; lowdiff every step with each compressor and each
``log.persistence``. Also what a restarted process does to resume from each method's files.

DCP here saves every checkpoint into a new directory (``save-NNNNNN``, as torchtitan's ``step-N`` folders) and
deletes the older ones once a newer one is complete: rewriting one directory in place, a kill during an upload would
leave the previous ``.metadata`` beside half-rewritten data. One save in flight: the next save first waits for the
previous one's upload. The process mode needs a process group: a one-rank gloo group (:func:`ensure_process_group`);
its staging (``DefaultStager``, shared memory, no pinned memory on the CPU) runs in the background, so the next
``optimizer.step()`` first waits for the staging to finish (the forward and backward passes overlap it).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import dir_bytes
from overhead_lowdiff import LowDiffMode
from overhead_modes import CheckFreqMode, Ctx, DCPMode, IntervalMode, Mode, TorchSaveMode

COMPRESSORS = ("topk", "powersgd", "none")
PERSISTENCE = ("thread", "process")
FAMILIES = ("dcp-thread", "dcp-process", "checkfreq", "torchsave")


def ensure_process_group() -> None:
    """A one-rank gloo group (DCP's process mode needs one); the same in every process of the benchmark."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="alt-pg-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


class _DCPBase(DCPMode):
    """DCP async_save into a new directory per save; one save in flight."""

    family = "dcp"

    def __init__(self, family: str, k: int) -> None:
        IntervalMode.__init__(self, family, k)
        self.pending: Any = None
        self.pending_dir: Path | None = None
        self.staging: Any = None

    def save_kwargs(self) -> dict[str, Any]:
        return {}

    def checkpoint(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._wait()
        msd, osd = get_state_dict(self.ctx.model, self.ctx.inner)
        target = self.dir / f"save-{self.saves:06d}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resp = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(target), **self.save_kwargs())
        self.staging = getattr(resp, "staging_completion", None)
        self.pending = getattr(resp, "upload_completion", resp)
        self.pending_dir = target

    def _wait(self) -> None:
        self.wait_staged()
        if self.pending is not None:
            self.pending.result()
            assert self.pending_dir is not None
            self.nbytes += dir_bytes(self.pending_dir)
            for old in self.dir.glob("save-*"):
                if old.name < self.pending_dir.name:
                    shutil.rmtree(old, ignore_errors=True)
            self.pending = None

    def wait_staged(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def tidy(self) -> None:
        pass  # the finished saves are deleted by _wait


class DCPThreadMode(_DCPBase):
    """``dcp.async_save`` with the default thread mode: the state is staged (copied) on the training thread, the
    upload runs in a thread of the trainer."""

    def __init__(self, k: int) -> None:
        super().__init__("dcp-thread", k)


class _StagingWaitOpt:
    """The inner optimizer, made to wait for DCP's background staging before it changes the parameters."""

    def __init__(self, mode: DCPProcessMode) -> None:
        self.mode = mode

    def step(self) -> None:
        self.mode.wait_staged()
        self.mode.ctx.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mode.ctx.inner.zero_grad(set_to_none=set_to_none)


class DCPProcessMode(_DCPBase):
    """``dcp.async_save(async_checkpointer_type=PROCESS, async_stager=DefaultStager(...))``: staging into shared
    memory in the background, the upload in a separate process (started at the first save)."""

    def __init__(self, k: int) -> None:
        super().__init__("dcp-process", k)
        self.stager: Any = None

    def setup(self, ctx: Ctx) -> None:
        super().setup(ctx)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        ensure_process_group()
        cuda = ctx.settings.device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))

    def save_kwargs(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        return {"async_checkpointer_type": AsyncCheckpointerType.PROCESS, "async_stager": self.stager}

    def optimizer(self) -> Any:
        return _StagingWaitOpt(self)

    def close(self) -> None:
        self._wait()
        if self.stager is not None:
            self.stager.close()


class AltLowDiffMode(LowDiffMode):
    """``lowdiff-C-thread`` / ``lowdiff-C-process`` (reference ``lowdiff-C-off``). No compression-time measurement
    after the rounds (overhead.py has it); the first snapshot after the run's step-0 one is timed (no warm-up of a
    whole snapshot interval: the bench cannot afford it), so the snapshot cost is if anything overstated."""

    def __init__(self, comp: str, enabled: bool, every: int, batch_steps: int, align: int,
                 persistence: str = "process") -> None:
        super().__init__(comp, enabled, every, batch_steps, "auto", align, warm_snapshot=False,
                         persistence=persistence)
        self.name = f"lowdiff-{comp}-{persistence}" if enabled else f"lowdiff-{comp}-off"

    def finish(self, next_batch: Any) -> None:
        pass

    def per_step_bytes(self) -> float | None:
        """Log bytes per logged step + snapshot bytes per snapshot / snapshot interval (opt.stats)."""
        st = self.opt.stats
        if st is None or not st.steps_committed:
            return None
        snap = st.snapshot_bytes / st.snapshots / self.every if st.snapshots else 0.0
        return st.log_bytes / st.steps_committed + snap


def batch_steps_for(comp: str) -> int:
    """overhead.py's defaults: 2 steps per segment for Top-k and PowerSGD, 1 for none."""
    return 1 if comp == "none" else 2


def interval_mode(family: str, k: int) -> IntervalMode:
    if family == "dcp-thread":
        return DCPThreadMode(k)
    if family == "dcp-process":
        return DCPProcessMode(k)
    if family == "checkfreq":
        return CheckFreqMode(k)
    if family == "torchsave":
        return TorchSaveMode(k)
    raise ValueError(family)


def build_modes(ks: list[int], every: int, window: int, ld_window: int) -> list[Mode]:
    modes: list[Mode] = [Mode("plain")]
    for comp in COMPRESSORS:
        modes.append(AltLowDiffMode(comp, False, every, batch_steps_for(comp), ld_window))
        for pers in PERSISTENCE:
            modes.append(AltLowDiffMode(comp, True, every, batch_steps_for(comp), ld_window, pers))
    for k in ks:
        modes += [interval_mode(f, k) for f in FAMILIES]
    for m in modes:
        m.window = ld_window if m.family == "lowdiff" else window
        if m.family == "lowdiff":
            m.warmup = ld_window - 1
    return modes


def sequence(modes: list[Mode], r: int) -> list[Mode]:
    """Round ``r``: P X1 P X2 ... Xn P (baselines rotated by r), and per compressor C-off C-thread C-off C-process
    C-off (the two persistence modes swap places on odd rounds); the lowdiff block after the baselines on even
    rounds, before them on odd ones."""
    plain = next(m for m in modes if m.name == "plain")
    base = [m for m in modes if m.family not in ("plain", "lowdiff")]
    rot = base[r % len(base):] + base[: r % len(base)] if base else []
    seq: list[Mode] = [plain]
    for m in rot:
        seq += [m, plain]
    by = {m.name: m for m in modes}
    ld: list[Mode] = []
    for comp in COMPRESSORS:
        off = by[f"lowdiff-{comp}-off"]
        a, b = (by[f"lowdiff-{comp}-{p}"] for p in (PERSISTENCE if r % 2 == 0 else PERSISTENCE[::-1]))
        ld += [off, a, off, b, off]
    return seq + ld if r % 2 == 0 else ld + seq


def method_names(ks: list[int]) -> list[str]:
    """Every checkpointing method (the references plain and lowdiff-C-off excluded)."""
    return [f"lowdiff-{c}-{p}" for c in COMPRESSORS for p in PERSISTENCE] + \
        [f"{f}-k{k}" for k in ks for f in FAMILIES]


def make_method(name: str, every: int) -> Mode:
    """One method by name, for a fresh process (the kill trials)."""
    if name.startswith("lowdiff-"):
        _, comp, pers = name.split("-")
        return AltLowDiffMode(comp, True, every, batch_steps_for(comp), 1, pers)
    family, k = name.rsplit("-k", 1)
    return interval_mode(family, int(k))


def _adam_step_of(inner: torch.optim.Optimizer) -> int:
    st = next(iter(inner.state.values()), None)
    return int(st["step"]) if st else 0


def resume(name: str, ctx: Ctx, every: int) -> tuple[int, Any]:
    """What a restarted trainer does to load the newest complete checkpoint of method ``name`` from
    ``ctx.work / name`` (where its killed run wrote); returns (step, the optimizer to train with)."""
    model, inner, mode_dir = ctx.model, ctx.inner, ctx.work / name
    if name.startswith("lowdiff-"):
        import lowdiff

        m = make_method(name, every)
        assert isinstance(m, AltLowDiffMode)
        m.ctx, m.run_dir = ctx, mode_dir
        opt = lowdiff.wrap(inner, model, m.config())
        return opt.resume(), opt
    if name.startswith("dcp-"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = sorted(d for d in mode_dir.glob("save-*") if (d / ".metadata").is_file())
        if not done:
            return 0, inner
        for p in model.parameters():  # AdamW's state exists only after a step: make one, then overwrite it
            p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        msd, osd = get_state_dict(model, inner)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(done[-1]))
        set_state_dict(model, inner, model_state_dict=msd, optim_state_dict=osd)
        return _adam_step_of(inner), inner
    path = mode_dir / "ckpt.pt"
    if not path.is_file():
        return 0, inner
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    inner.load_state_dict(sd["optim"])
    return _adam_step_of(inner), inner
