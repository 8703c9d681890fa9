"""The modes bench/overhead.py times, part 2: lowdiff, through its public API only (``lowdiff.wrap``, ``opt.stats``,
``opt.flush``).

``lowdiff-C`` logs every step with compressor C (``topk``, ``powersgd``, ``none``); its reference ``lowdiff-C-off``
is the same configuration with ``enabled: false`` (it compresses and decodes identically and writes nothing).
``lowdiff-C-process`` is ``lowdiff-C`` with ``log.persistence: process`` (same reference); run only when named in
``--modes``.

Auto mode (``lowdiff-C-auto``, issue #7): ``snapshot.every_steps: auto`` and ``log.batch_steps: auto`` with
``tuner.max_overhead`` (``--auto-max-overhead``, 0.02) and ``tuner.mtbf_hours`` (``--auto-mtbf-hours``). It warms
up continuously until the tuner has decided and a snapshot has followed the decision (so the chosen batch size is
in force), then its windows are W steps, W a multiple of the chosen batch B dividing the chosen interval F, aligned
so snapshot steps start windows; the reference is its ``enabled: false`` twin ``lowdiff-C-off``; the interval F
is stratified as for the fixed modes (rounds >= F / W are needed to see a snapshot). At a window's end it waits for
the writer to commit the complete segments and snapshots of the iterations that have ended (the window's last
step is held until the next ``opt.step()``; no flush: that would cut segments shorter than B). Where
the complete segments end follows from ``opt.stats`` (the last snapshot step and the tuner's decisions) by the tuned
policy's documented rules for cutting segments (``AutoLowDiffMode.segment_start``).

LowDiff+ variants (issue #8), compressor none, each with the reference ``lowdiff-none-off`` and otherwise like
``lowdiff-none``: ``lowdiff-none-shadow`` (``snapshot.shadow: true``: full snapshots are written from a CPU replica
that the writer keeps in step; CPU only) and ``lowdiff-none-layerwise`` (``log.capture: layerwise``: post-accumulate-
grad hooks copy gradients during backward). The hooks live on the parameters of the model they are wrapped with, and
lowdiff has no public way to pause them, so ``lowdiff-none-layerwise`` trains a replica of the shared model (a deep
copy of the model and its AdamW, taken at setup; same shapes, same batches): on the shared model its hooks would copy
gradients in every other mode's windows. Every step clips its gradients (clip_grad_norm_ 1.0) unless ``--no-clip``;
clipping changes the gradients after backward, so lowdiff finds the layer-wise captures stale and removes its hooks
after 3 steps (the JSON's ``capture`` says when): ``--modes lowdiff-none-layerwise --no-clip`` measures the hooks.

Compression time per step (``compress_s_per_step``) of every lowdiff mode is measured apart, after the rounds,
through the public API: the time of ``opt.step()`` of ``lowdiff.wrap(SGD(lr=0), model, {"enabled": False,
"compressor": C})`` minus that of the same wrapper with compressor none, stepped alternately over the same gradients
(restored before every step) on a copy of the shared model; the median of the paired differences after a warm-up
(a fresh Top-k compressor is slower for ~20 steps; on a GPU synchronized, so it is real GPU time). With
``enabled: false`` ``opt.step()`` compresses, decodes into ``.grad`` and runs the inner step, and compressor none
compresses nothing, so the difference is the compressor's compress + decode with error feedback. The inner SGD at
learning rate 0 costs the same whatever the gradient holds (AdamW's sqrt is several times slower on the exact zeros
a sparse decoded gradient leaves in a young ``exp_avg_sq``: bench/compress.py).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from _common import mb, median, payload_bytes
from overhead_modes import PSGD_RANK, TOPK_RATIO, Ctx, Mode, sync, train_step

import lowdiff
from lowdiff import CheckpointStats
from lowdiff.config import resolve_codec

DRAIN_TIMEOUT_S = 120.0  # an auto mode's drain gives up (and flushes) after this long


class LowDiffMode(Mode):
    family = "lowdiff"
    bandwidth_test = True  # its newest records are re-written by overhead_bandwidth.measure_bandwidth

    def __init__(self, comp: str, enabled: bool, every: int, batch_steps: int, codec: str, align: int,
                 warm_snapshot: bool = True, persistence: str = "thread") -> None:
        super().__init__(f"lowdiff-{comp}" + ("" if enabled else "-off") + ("-process" if persistence == "process"
                                                                            else ""))
        self.comp, self.enabled, self.every, self.batch_steps, self.codec = comp, enabled, every, batch_steps, codec
        self.persistence = persistence
        self.ref = f"lowdiff-{comp}-off" if enabled else "plain"
        self.k = every if enabled else None
        # The same for both twins: a fresh Top-k compressor is slower for ~20 steps. With warm_snapshot the first
        # snapshot falls in the warm-up: it allocates the host buffers every later snapshot reuses (once per run).
        self.warmup = align - 1 + (every if warm_snapshot else 0)
        self.compress_step_s = 0.0
        self.writes: list[dict[str, Any]] = []
        """Per timed window: what the writer committed by its end (deltas of ``opt.stats``)."""
        self._seen: CheckpointStats | None = None

    def config(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "enabled": self.enabled,
                "compressor": {"name": self.comp, "ratio": TOPK_RATIO, "rank": PSGD_RANK},
                "snapshot": {"every_steps": self.every, "keep": self.ctx.settings.snapshot_keep},
                "log": {"batch_steps": self.batch_steps, "codec": self.codec, "persistence": self.persistence}}

    def trained(self, ctx: Ctx) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model and inner optimizer this mode wraps: the shared ones."""
        return ctx.model, ctx.inner

    def setup(self, ctx: Ctx) -> None:
        super().setup(ctx)
        self.run_dir = ctx.work / self.name
        self.model, inner = self.trained(ctx)
        self.opt = lowdiff.wrap(inner, self.model, self.config())

    def step(self, batch: Any) -> bool:
        train_step(self.ctx.settings, self.model, self.opt, batch)
        return self.enabled and self.opt.step_count % self.every == 0

    def start_timed(self) -> None:
        self.end_window()  # commit the warm-up's partial batch: segments then align with windows
        self.writes, self._seen = [], self.opt.stats

    def end_window(self) -> float:
        t0 = time.perf_counter()
        self.opt.flush()
        wait = time.perf_counter() - t0
        self.record_writes()
        return wait

    def record_writes(self) -> None:
        """Append what the writer committed since the previous window's end (untimed: after the window)."""
        st = self.opt.stats
        if st is None or self._seen is None:
            return
        prev, self._seen = self._seen, st
        self.writes.append({"segments": st.segments - prev.segments, "bytes": st.log_bytes - prev.log_bytes,
                            "steps": st.steps_committed - prev.steps_committed,
                            "snapshots": st.snapshots - prev.snapshots, "write_s": st.write_s - prev.write_s})

    def finish(self, next_batch: Any) -> None:
        self.compress_step_s = compression_s_per_step(self.ctx, self.comp, next_batch)

    def compress_s_per_step(self, since_s: float, steps: int) -> float:
        return self.compress_step_s

    def bytes_written(self) -> int:
        st = self.opt.stats
        return st.log_bytes + st.snapshot_bytes if st else 0

    def info(self) -> dict[str, Any]:
        st = self.opt.stats
        writer = None if st is None else {
            "segments": st.segments, "snapshots": st.snapshots, "log_bytes": st.log_bytes,
            "log_steps": st.steps_committed, "snapshot_bytes": st.snapshot_bytes, "write_s": st.write_s,
            "blocked_s": st.blocked_s}
        return {"compressor": self.comp, "enabled": self.enabled, "persistence": self.persistence,
                "snapshot_every_steps": self.every,
                "batch_steps": self.batch_steps, "codec": self.codec,
                "codec_resolved": resolve_codec(self.codec, self.comp), "writer_stats": writer}

    def results(self, total_steps: int) -> dict[str, Any]:
        out: dict[str, Any] = {"payload_bytes_per_step": payload_bytes_per_step(self.model, self.comp)}
        st = self.opt.stats
        if st is None:
            return out
        # Per window, not per segment: opt.stats counts what the writer committed, not each write. A window that
        # also committed a snapshot is left out of the bandwidth (write_s counts both).
        out["log_bytes_per_step"] = None
        out["segments_in_training"] = self.writes
        if sum(w["segments"] for w in self.writes):
            out["log_bytes_per_step"] = sum(w["bytes"] for w in self.writes) / total_steps
            logs_only = [w for w in self.writes if w["segments"] and not w["snapshots"]]
            ts = sum(w["write_s"] for w in logs_only)
            out["segment_MBps_in_training"] = mb(sum(w["bytes"] for w in logs_only)) / ts if ts else None
        out["blocked_s_total"] = st.blocked_s
        return out

    def close(self) -> None:
        self.opt.close()


class LowDiffPlusMode(LowDiffMode):
    """A LowDiff+ variant of ``lowdiff-C`` (compressor none): ``lowdiff-C-shadow`` (``snapshot.shadow: true``: the
    writer keeps a CPU replica and writes full snapshots from it) or ``lowdiff-C-layerwise`` (``log.capture:
    layerwise``: post-accumulate-grad hooks copy gradients during backward). Otherwise like ``lowdiff-C``, with the
    same reference ``lowdiff-C-off``. The layer-wise variant trains a replica of the shared model (module
    docstring); if lowdiff removes its hooks (captures stale in 3 steps in a row, e.g. by gradient clipping), they
    stay removed, as in training."""

    VARIANTS = ("shadow", "layerwise")
    bandwidth_test = False  # same records as lowdiff-C: no second bandwidth test

    def __init__(self, comp: str, variant: str, every: int, batch_steps: int, codec: str, align: int,
                 warm_snapshot: bool = True) -> None:
        assert variant in self.VARIANTS, variant
        super().__init__(comp, True, every, batch_steps, codec, align, warm_snapshot)
        self.variant = variant
        self.name = f"lowdiff-{comp}-{variant}"
        self.hooks_removed_by_lowdiff_at: int | None = None
        self._captures0 = (0, 0)  # (hits, misses) at the start of the timed rounds

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        if self.variant == "shadow":
            cfg["snapshot"]["shadow"] = True
        else:
            cfg["log"]["capture"] = "layerwise"
        return cfg

    def trained(self, ctx: Ctx) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if self.variant != "layerwise" or not ctx.shared:
            return super().trained(ctx)
        # One deepcopy of both: the copied optimizer's groups and state then refer to the copied parameters.
        model, inner = copy.deepcopy((ctx.model, ctx.inner))
        return model, inner

    def start_timed(self) -> None:
        super().start_timed()
        lw = self.opt.stats.layerwise
        if lw is not None:
            self._captures0 = (lw.hits, lw.misses)

    def step(self, batch: Any) -> bool:
        event = super().step(batch)
        if self.variant == "layerwise" and self.hooks_removed_by_lowdiff_at is None:
            # One opt.stats reading (~10 us) per step while the hooks are on, to tell the step lowdiff removed them.
            lw = self.opt.stats.layerwise
            if lw is not None and not lw.active:
                self.hooks_removed_by_lowdiff_at = self.opt.step_count
        return event

    def info(self) -> dict[str, Any]:
        out = super().info()
        out["variant"] = self.variant
        st = self.opt.stats
        if self.variant == "shadow":
            # False when the replica failed and snapshots fell back to the training thread (logged as an error).
            out["shadow_in_force"] = st.shadow
        lw = st.layerwise
        if lw is not None:
            # Gradients of the timed steps taken from the hooks' copies (hits) or captured but changed after
            # backward, so copied again in step() (misses); the last partial bucket is always copied in step().
            out["capture"] = {"hits_timed": lw.hits - self._captures0[0],
                              "misses_timed": lw.misses - self._captures0[1],
                              "hooks_active": lw.active,
                              "hooks_removed_by_lowdiff_at_step": self.hooks_removed_by_lowdiff_at}
        return out


class AutoLowDiffMode(LowDiffMode):
    """lowdiff with ``snapshot.every_steps: auto`` and ``log.batch_steps: auto`` (see the module docstring)."""

    bandwidth_test = False

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
        self.flushed_at = 0
        self.bootstrap_batch = 0  # the writer's batch size before any decision (read at setup)

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["snapshot"] = {"every_steps": "auto", "keep": self.ctx.settings.snapshot_keep}
        cfg["log"] = {"batch_steps": "auto", "codec": self.codec}
        cfg["tuner"] = {"mtbf_hours": self.mtbf_hours, "max_overhead": self.max_overhead}
        if self.retune_drift is not None:
            cfg["tuner"]["retune_drift"] = self.retune_drift
        return cfg

    def setup(self, ctx: Ctx) -> None:
        super().setup(ctx)
        self.bootstrap_batch = self.stats.batch_steps

    @property
    def stats(self) -> CheckpointStats:
        st = self.opt.stats
        assert st is not None  # enabled
        return st

    def step(self, batch: Any) -> bool:
        train_step(self.ctx.settings, self.model, self.opt, batch)
        # One opt.stats reading (~10 us) per step: the tuner's interval may change between windows.
        event = self.stats.last_snapshot_step == self.opt.step_count
        self.snapshots_submitted += event
        return event

    def warm(self, next_batch: Any) -> None:
        """Until the tuner has decided and a snapshot has followed its latest decision (its B then in force), then
        to alignment."""
        t0 = time.perf_counter()
        while True:
            seen = len(self.stats.tuner_decisions)
            while self.warmup_steps < self.max_warmup_steps:
                self.step(next_batch())
                self.warmup_steps += 1
                # The LATEST decision followed by a snapshot: a re-decision during warm-up must not leave the
                # windows aligned to an interval no longer in force. Settled: no probe in force and no decision
                # still waiting for alpha (its re-decision would fall inside the timed rounds).
                st = self.stats
                if st.tuner_settled and st.tuner_decisions and st.last_snapshot_step > st.tuner_decisions[-1].step:
                    break
            st = self.stats
            f, b = st.every_steps, st.batch_steps
            self.k = f
            # The window: a multiple of B dividing F, closest to the target (snapshot steps then start windows);
            # of two as close, the longer (F = 19, B = 1: 19-step windows, not 1-step ones).
            cands = [w for w in range(b, f + 1, b) if f % w == 0]
            self.window = min(cands, key=lambda w: (abs(w - self.target_window), -w))
            # Windows start at steps = last snapshot (mod W): run to the step before the next such start.
            while (self.opt.step_count + 1 - self.stats.last_snapshot_step) % self.window:
                self.step(next_batch())
                self.warmup_steps += 1
            # Decided again while aligning: align to the new decision (within the warm-up budget).
            if len(self.stats.tuner_decisions) == seen or self.warmup_steps >= self.max_warmup_steps:
                break
        self.warmup_s = time.perf_counter() - t0
        decided = bool(self.stats.tuner_decisions)
        self.aligned_to = {"every_steps": f, "batch_steps": b}
        self.alignment = (f"every_steps={f} batch_steps={b} window={self.window} after {self.warmup_steps} warm-up "
                          f"steps ({self.warmup_s:.0f} s){'' if decided else ' - NO DECISION YET (bootstrap values)'}")
        print(f"  {self.name}: {self.alignment}", flush=True)

    def finish(self, next_batch: Any) -> None:
        super().finish(next_batch)
        # The interval the stratification weighs with: the tuner's choice in force at the end (it may have
        # re-decided during the rounds; every decision is in info()).
        self.k = self.stats.every_steps

    def segment_start(self, st: CheckpointStats) -> tuple[int, int]:
        """(A, B): the writer's segments hold B steps each after step A, by the documented rules of the tuned
        policy (docs/reference/tuner-model.md, section 4) applied to ``opt.stats``: a snapshot cuts the open
        segment and puts the B of the latest decision before it in force; a probe cuts at its first step (its B)
        and again at its last (the B of the decision that ends it); a non-probe decision's B waits for the next
        snapshot; ``opt.flush()`` (only after a drain timeout here) restarts the count."""
        decisions = st.tuner_decisions
        before = [d for d in decisions if d.step < st.last_snapshot_step]  # one at the snapshot's step comes after it
        cuts = [(st.last_snapshot_step, 0, before[-1].batch_steps if before else self.bootstrap_batch)]
        for i, d in enumerate(decisions):
            if d.is_probe:  # the probe's own cut, after the snapshot's at the same step
                cuts.append((d.step, 1, d.batch_steps))
                if i + 1 < len(decisions):  # no other decision is made while a probe is in force
                    cuts.append((decisions[i + 1].step, 1, decisions[i + 1].batch_steps))
        anchor, _, b = max(cuts)
        return max(anchor, self.flushed_at), b

    def end_window(self) -> float:
        """Wait for the writer to commit every complete segment and every snapshot submitted (the open segment
        stays open: a flush would cut it)."""
        t0 = time.perf_counter()
        # The window's last step is held until its iteration ends (the next opt.step(); docs/guide/durability.md):
        # neither it nor a snapshot taken at it can be committed yet.
        cur = self.opt.step_count
        ended = cur - 1
        st = self.stats
        anchor, b = self.segment_start(st)
        target = min(anchor + max(0, ended - anchor) // b * b, ended)  # the last step of the complete segments
        snapshots = self.snapshots_submitted - (st.last_snapshot_step == cur)
        while st.durable_step < target or st.snapshots < snapshots:
            if st.write_error is not None:
                raise RuntimeError(f"{self.name}: lowdiff's writer failed: {st.write_error}")
            if time.perf_counter() - t0 > DRAIN_TIMEOUT_S:
                self.drain_timeouts += 1
                self.opt.flush()
                self.flushed_at = cur
                break
            time.sleep(0.0005)
            st = self.stats
        wait = time.perf_counter() - t0
        self.record_writes()
        return wait

    def info(self) -> dict[str, Any]:
        out = super().info()
        st = self.stats
        out.update({
            "snapshot_every_steps": "auto", "batch_steps": "auto", "tuner_mtbf_hours": self.mtbf_hours,
            "tuner_max_overhead": self.max_overhead, "alignment": self.alignment, "warmup_steps": self.warmup_steps,
            "in_force": {"every_steps": st.every_steps, "batch_steps": st.batch_steps},
            "aligned_to": self.aligned_to,
            "drain_timeouts": self.drain_timeouts,
            "decisions": [{"step": d.step, "reason": d.reason, "every_steps": d.every_steps,
                           "batch_steps": d.batch_steps, "predicted_overhead": d.overhead,
                           "waste_s_per_hour": d.waste_s_per_hour, "feasible": d.feasible,
                           "predicted_writer_load": d.breakdown.writer_load,
                           "sources": dict(d.costs.sources), "summary": d.summary()} for d in st.tuner_decisions],
        })
        return out


def payload_bytes_per_step(model: torch.nn.Module, comp: str) -> int:
    """Expected payload bytes of one step, from the bench's own arithmetic (bench/_common.py's payload_bytes)."""
    return sum(payload_bytes(p.shape, p.element_size(), comp, TOPK_RATIO, PSGD_RANK) for p in model.parameters())


def compression_s_per_step(ctx: Ctx, comp: str, next_batch: Any, warm: int = 20, reps: int = 10) -> float:
    """Seconds compressor ``comp`` adds to ``opt.step()`` per step (module docstring), once per compressor: kept in
    ``ctx.measured``; 0 for compressor none, the reference. Untimed by the protocol: runs after the rounds."""
    key = f"compress_s_per_step/{comp}"
    if comp == "none":
        ctx.measured[key] = 0.0
    if key not in ctx.measured:
        settings = ctx.settings
        if settings.quick:
            warm, reps = 2, 2
        # A copy: the timed steps write its parameters (SGD writes them in place even at learning rate 0) and its
        # .grad; the shared model's are written only by the modes' own steps.
        model = copy.deepcopy(ctx.model)
        x, y = next_batch()
        _, loss = model(x, y)
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad.detach().clone() for p in params]
        opts = {c: lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                {"run_dir": str(ctx.work / f"compress-{comp}-vs-{c}"), "enabled": False,
                                 "compressor": {"name": c, "ratio": TOPK_RATIO, "rank": PSGD_RANK}})
                for c in (comp, "none")}
        times: dict[str, list[float]] = {c: [] for c in opts}
        try:
            for i in range(warm + reps):
                for c, opt in opts.items():  # alternately, so the machine's drift cancels in the differences
                    for p, g in zip(params, grads):
                        p.grad.copy_(g)  # the decode wrote the previous step's decoded gradient into .grad
                    sync(settings.device)
                    t0 = time.perf_counter()
                    opt.step()
                    sync(settings.device)
                    if i >= warm:
                        times[c].append(time.perf_counter() - t0)
        finally:
            for opt in opts.values():
                opt.close()
        ctx.measured[key] = median([a - b for a, b in zip(times[comp], times["none"])])
    return float(ctx.measured[key])
