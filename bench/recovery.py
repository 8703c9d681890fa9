"""Recovery time: replaying the lowdiff log vs recomputing the iterations vs loading a full checkpoint.

    python bench/recovery.py            # the real run (~15 min on 2 cores); writes bench/results, docs/
    python bench/recovery.py --smoke --out-dir /tmp/x   # seconds; what tests/bench runs

One training run (Top-k 1 %, AdamW, one full snapshot at step 0, log segments of 10 steps) of ``max(lengths)``
steps. Then, interleaved over repetitions:
  * ``lowdiff.recover(run_dir, step=L, workers=W)`` for every log length L and worker count W (wall time and the
    report's phases); the first repetition checks the result bit for bit against the training state at L;
  * recompute: load the step-0 state (torch.load) and re-run the same L iterations (forward, backward, the same
    Top-k compression, optimizer step) -- measured for L <= ``--recompute-max``, extrapolated linearly beyond
    (marked as such);
  * torch.load(weights_only=True) of a full torch.save'd model + optimizer state (what a full checkpoint at L
    would cost to load).
Peak memory of recovery is measured in a fresh process per configuration: the proportional set size (PSS) of
the process and its replay workers, sampled every 20 ms, above the interpreter's own footprint before recovery.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import (  # noqa: E402
    FULL_MODEL,
    ROOT,
    SMOKE_MODEL,
    PssSampler,
    machine_info,
    mb,
    median,
    output_paths,
    peak_rss_bytes,
    pss_tree_bytes,
    pyplot,
    train_step,
    write_json,
)

import lowdiff  # noqa: E402

TOPK_RATIO = 0.01
BATCH_POOL = 16


def _cfg(run_dir: Path, enabled: bool, snapshot_every: int, batch_steps: int) -> dict[str, Any]:
    return {"run_dir": str(run_dir), "enabled": enabled, "compressor": {"name": "topk", "ratio": TOPK_RATIO},
            "snapshot": {"every_steps": snapshot_every}, "log": {"batch_steps": batch_steps}}


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _equal(ref: tuple[dict[str, Any], dict[str, Any]], model_sd: dict[str, Any], opt_sd: dict[str, Any]) -> bool:
    ms, os_ = ref
    if set(ms) != set(model_sd) or not all(torch.equal(ms[k], model_sd[k]) for k in ms):
        return False
    if set(os_["state"]) != set(opt_sd["state"]):
        return False
    for i, st in os_["state"].items():
        for k, v in st.items():
            w = opt_sd["state"][i][k]
            if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                return False
    return True


def _recompute(spec: Any, start_path: Path, batches: list[Any], steps: int, work: Path) -> tuple[float, Any]:
    """Load the step-0 state and redo ``steps`` iterations exactly as training did them."""
    t0 = time.perf_counter()
    model = spec.build(seed=1)  # the weights come from the checkpoint, not from this init
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sd = torch.load(start_path, weights_only=True)
    model.load_state_dict(sd["model"])
    inner.load_state_dict(sd["optim"])
    opt = lowdiff.wrap(inner, model, _cfg(work / "recompute", False, 1 << 30, 10))  # compress+decode, no writes
    for i in range(steps):
        train_step(model, opt, batches[i % len(batches)])
    dt = time.perf_counter() - t0
    return dt, (model.state_dict(), inner.state_dict())


def probe(args: argparse.Namespace) -> None:
    """``--probe-recover RUN_DIR STEP WORKERS`` (or ``--probe-load PATH``): peak memory in a fresh process."""
    torch.set_num_threads(args.threads)
    before = pss_tree_bytes(os.getpid())
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if args.probe_load:
        with PssSampler() as s:
            obj = torch.load(args.probe_load, weights_only=True)
        extra["pss_peak_bytes"] = s.peak_bytes
    else:
        # No sampler thread here: with another thread running, recover() would not fork its replay workers.
        # The parent samples this process and its workers (_run_sampled_probe).
        run_dir, step, workers = args.probe_recover
        obj = lowdiff.recover(run_dir, step=int(step), workers=int(workers))
        extra.update(mode=obj.report.mode, workers_used=obj.report.workers)
    dt = time.perf_counter() - t0
    del obj
    print(json.dumps({"pss_before_bytes": before, "peak_rss_self_bytes": peak_rss_bytes(), "wall_s": dt,
                      **extra}))


def _run_sampled_probe(probe_args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run a probe in a fresh interpreter while this process samples its PSS (and its workers')."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.Popen([sys.executable, str(Path(__file__)), *probe_args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    with PssSampler(pid=p.pid) as s:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
    if p.returncode != 0:
        raise RuntimeError(f"probe {probe_args} failed (rc {p.returncode}):\n{err[-3000:]}")
    v = json.loads(out.strip().splitlines()[-1])
    v.setdefault("pss_peak_bytes", s.peak_bytes)
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short log: finishes in seconds")
    ap.add_argument("--out-dir", help="write recovery.json/.md/.png here instead of bench/results and docs/")
    ap.add_argument("--work-dir", default=None, help="where the run directory is written (default: system tmp)")
    ap.add_argument("--lengths", help="comma-separated log lengths (default 10,50,100,250,500)")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--reps", type=int, help="repetitions of every measurement (default 2)")
    ap.add_argument("--recompute-max", type=int, help="longest log recomputed for real (default 50)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in the parent (default 1)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--probe-recover", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--probe-load", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe_recover or args.probe_load:
        probe(args)
        return

    torch.set_num_threads(args.threads)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
        ([4, 8, 12] if args.smoke else [10, 50, 100, 250, 500])
    workers = [int(x) for x in args.workers.split(",")]
    reps = args.reps or (1 if args.smoke else 2)
    recompute_max = args.recompute_max or (8 if args.smoke else 50)
    batch_steps = 2 if args.smoke else 10
    json_path, md_path, png_path = output_paths(args.out_dir, "recovery")
    t_start = time.perf_counter()
    info = machine_info()
    work = Path(tempfile.mkdtemp(prefix="lowdiff-recovery-", dir=args.work_dir))
    print(f"recovery: model {spec}, lengths {lengths}, workers {workers}, reps {reps}, work dir {work}", flush=True)
    try:
        # -- the training run that produces the log --------------------------------------------------------------
        nsteps = max(lengths)
        model = spec.build()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        nparams = sum(p.numel() for p in model.parameters())
        batches = spec.batches(BATCH_POOL)
        start_path = work / "full-step0.pt"
        torch.save({"model": model.state_dict(), "optim": inner.state_dict()}, start_path)
        run_dir = work / "run"
        opt = lowdiff.wrap(inner, model, _cfg(run_dir, True, nsteps + 1, batch_steps))
        refs: dict[int, Any] = {}
        step_s: list[float] = []
        for i in range(nsteps):
            t0 = time.perf_counter()
            train_step(model, opt, batches[i % BATCH_POOL])
            step_s.append(time.perf_counter() - t0)
            if i + 1 in lengths:
                refs[i + 1] = _state(model, inner)
            if (i + 1) % 50 == 0:
                print(f"  trained {i + 1}/{nsteps} steps at {time.perf_counter() - t_start:.0f} s", flush=True)
        opt.close()
        full_path = work / f"full-step{nsteps}.pt"
        torch.save({"model": model.state_dict(), "optim": inner.state_dict()}, full_path)
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        state_bytes += sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor))
        log_bytes = sum(p.stat().st_size for p in (run_dir / "log").iterdir())
        snap_bytes = sum(p.stat().st_size for p in (run_dir / "snapshots").iterdir())
        del model, inner, opt
        print(f"  training done at {time.perf_counter() - t_start:.0f} s (median step {median(step_s):.3f} s); "
              f"log {mb(log_bytes):.1f} MB", flush=True)

        # Memory first: the probes are fresh interpreters, so they run the lowdiff on disk *now*; measuring them
        # right after training keeps them on the same code as the parent.
        memory: dict[str, Any] = {"state_bytes_model_plus_adam": state_bytes, "probes": {}, "errors": {}}
        if not args.no_memory:
            jobs = {f"recover L={nsteps} workers={w}": ["--probe-recover", str(run_dir), str(nsteps), str(w)]
                    for w in workers}
            jobs["torch.load full state"] = ["--probe-load", str(full_path)]
            for name, probe_args in jobs.items():
                try:
                    v = _run_sampled_probe([*probe_args, "--threads", str(args.threads)], timeout_s=900)
                except (RuntimeError, subprocess.SubprocessError) as e:
                    memory["errors"][name] = str(e)[-1500:]
                    print(f"  memory probe {name} FAILED: {str(e)[-300:]}", flush=True)
                    continue
                v["peak_over_before_bytes"] = v["pss_peak_bytes"] - v["pss_before_bytes"]
                v["peak_over_state"] = v["peak_over_before_bytes"] / state_bytes
                memory["probes"][name] = v
                print(f"  peak memory {name}: {mb(v['peak_over_before_bytes']):.0f} MB above start "
                      f"({v['peak_over_state']:.2f} x state){', ' + v['mode'] if 'mode' in v else ''}", flush=True)

        # -- interleaved measurements ------------------------------------------------------------------------------
        replay: dict[str, list[dict[str, Any]]] = {}
        recompute: dict[int, list[float]] = {}
        load_s: list[float] = []
        exact: dict[str, bool] = {}
        for rep in range(reps):
            for L in lengths:
                for w in workers:
                    t0, c0 = time.perf_counter(), _cpu_s()
                    rec = lowdiff.recover(run_dir, step=L, workers=w)
                    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
                    rp = rec.report
                    replay.setdefault(f"{L}/{w}", []).append({
                        "wall_s": wall, "cpu_s": cpu, "total_s": rp.total_s, "loadavg": os.getloadavg()[0],
                        "steps_replayed": rp.steps_replayed,
                        "workers_used": rp.workers, "mode": rp.mode, "bytes_read": rp.bytes_read, **vars(rp.times)})
                    if rep == 0:
                        exact[f"{L}/{w}"] = _equal(refs[L], rec.model, rec.optimizer)
                    del rec
                if L <= recompute_max:
                    dt, st = _recompute(spec, start_path, batches, L, work / f"rc{rep}-{L}")
                    recompute.setdefault(L, []).append(dt)
                    if rep == 0:
                        exact[f"recompute/{L}"] = _equal(refs[L], *st)
                    del st
            t0 = time.perf_counter()
            sd = torch.load(full_path, weights_only=True)
            load_s.append(time.perf_counter() - t0)
            del sd
            print(f"  repetition {rep + 1}/{reps} done at {time.perf_counter() - t_start:.0f} s", flush=True)

        # -- summary -----------------------------------------------------------------------------------------------
        rc_per_step = median([t / L for L, ts in recompute.items() for t in ts])
        rows = []
        for L in lengths:
            row: dict[str, Any] = {"steps": L}
            for w in workers:
                samples = replay[f"{L}/{w}"]
                row[f"replay_w{w}_s"] = median([s["wall_s"] for s in samples])
                row[f"replay_w{w}_cpu_s"] = median([s["cpu_s"] for s in samples])
                phase_keys = [k for k, v in samples[0].items() if k.endswith("_s") and k not in ("wall_s", "total_s")
                              and k != "cpu_s" and isinstance(v, float)]
                row[f"phases_w{w}"] = {k: median([s[k] for s in samples]) for k in phase_keys}
                row[f"mode_w{w}"] = samples[0]["mode"]
                row[f"workers_used_w{w}"] = samples[0]["workers_used"]
            if L in recompute:
                row["recompute_s"], row["recompute_measured"] = median(recompute[L]), True
            else:
                row["recompute_s"], row["recompute_measured"] = median(load_s) + rc_per_step * L, False
            row["full_load_s"] = median(load_s)
            w1 = row.get("replay_w1_s")
            if w1:
                row["recompute_over_replay_w1"] = row["recompute_s"] / w1
                if "replay_w2_s" in row:
                    row["speedup_w2_over_w1"] = w1 / row["replay_w2_s"]
            rows.append(row)
        out = {
            "benchmark": "recovery", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "machine": info, "model": {**spec.as_dict(), "params": nparams},
            "training": {"steps": nsteps, "median_step_s": median(step_s), "compressor": f"topk {TOPK_RATIO}",
                         "optimizer": "AdamW(lr=3e-4), clip_grad_norm 1.0", "log_batch_steps": batch_steps,
                         "log_bytes": log_bytes, "snapshot_bytes": snap_bytes, "state_bytes": state_bytes},
            "protocol": {"lengths": lengths, "workers": workers, "reps": reps, "recompute_max": recompute_max,
                         "recompute_per_step_s": rc_per_step, "torch_threads_parent": args.threads},
            "rows": rows, "exact": exact, "raw": {"replay": replay, "recompute": recompute, "full_load_s": load_s},
            "memory": memory, "runtime_s": time.perf_counter() - t_start, "loadavg_end": os.getloadavg(),
        }
        write_json(json_path, out)
        write_markdown(md_path, out)
        plot(png_path, out)
        print(f"recovery: done in {out['runtime_s']:.0f} s -> {json_path}, {md_path}, {png_path}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_markdown(path: Path, out: dict[str, Any]) -> None:
    mdl, tr, pr = out["model"], out["training"], out["protocol"]
    ws = pr["workers"]
    lines = [
        "# Recovery time",
        "",
        f"Generated by `{out['command']}` on {out['machine']['date']} (git {out['machine']['git_commit'][:10]}); "
        f"{out['machine']['cpu_count']} CPUs (shared), torch {out['machine']['torch']}; runtime "
        f"{out['runtime_s']:.0f} s; load average at start {out['machine']['loadavg_start'][0]:.1f}, at end "
        f"{out['loadavg_end'][0]:.1f}.",
        "",
        f"Model: GPT, {mdl['n_layer']} layers, d_model {mdl['d_model']}, {mdl['params'] / 1e6:.1f} M parameters, "
        f"batch {mdl['batch']} x {mdl['block']}; {tr['optimizer']}; compressor {tr['compressor']}; one snapshot "
        f"at step 0, {tr['steps']} logged steps in segments of {tr['log_batch_steps']} "
        f"({mb(tr['log_bytes']) / tr['steps']:.2f} MB/step on disk). Model + AdamW state "
        f"{mb(tr['state_bytes']):.0f} MB; training step median {tr['median_step_s']:.3f} s. Medians of "
        f"{pr['reps']} interleaved repetitions. Recompute = torch.load of the step-0 state + re-running the "
        f"iterations (measured up to {pr['recompute_max']} steps, then extrapolated at "
        f"{pr['recompute_per_step_s']:.3f} s/step, marked *).",
        "",
        "| log steps | " + " | ".join(f"replay, {w} worker(s)" for w in ws) + " | recompute | full torch.load | "
        "recompute / replay(1) | " + ("speedup 2 vs 1 worker |" if 2 in ws and 1 in ws else ""),
        "|---|" + "---|" * (len(ws) + 3) + ("---|" if 2 in ws and 1 in ws else ""),
    ]
    for r in out["rows"]:
        cells = [f"{r['steps']}"] + [f"{r[f'replay_w{w}_s']:.2f} s" for w in ws]
        cells.append(f"{r['recompute_s']:.2f} s" + ("" if r["recompute_measured"] else " *"))
        cells.append(f"{r['full_load_s']:.2f} s")
        cells.append(f"{r.get('recompute_over_replay_w1', float('nan')):.1f}x")
        if "speedup_w2_over_w1" in r:
            cells.append(f"{r['speedup_w2_over_w1']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "CPU time of the recovery (the process, all its threads and its replay worker processes; less "
              "sensitive than wall time to other jobs on the shared machine): " + "; ".join(
                  f"L={r['steps']}: " + ", ".join(f"{w} worker(s) {r[f'replay_w{w}_cpu_s']:.2f} s" for w in ws
                                                 if f"replay_w{w}_cpu_s" in r) for r in out["rows"]) + ".",
              "", "Phases of the longest replay (seconds of wall time in the recovering process, which replays share 0 "
              "while the worker processes replay the others; `apply` is the optimizer steps):", ""]
    last = out["rows"][-1]
    for w in ws:
        ph = last[f"phases_w{w}"]
        lines.append(f"- {w} worker(s), {last[f'mode_w{w}']}: " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    bad = [k for k, v in out["exact"].items() if not v]
    lines += ["", f"Bit-exact against the training state (torch.equal on every parameter and AdamW tensor): "
              f"{'all ' + str(len(out['exact'])) + ' checks pass' if not bad else 'FAILED: ' + ', '.join(bad)}.", ""]
    for name, err in out["memory"].get("errors", {}).items():
        lines += [f"Memory probe '{name}' failed: `{err.strip().splitlines()[-1]}`", ""]
    if out["memory"]["probes"]:
        lines += ["## Peak memory", "",
                  "Fresh process per row; PSS of the process and any children sampled every 20 ms, minus the "
                  "PSS before recovery (interpreter + torch + lowdiff imported). Replay worker processes are "
                  "forked children; the parameters and optimizer state they step are in memory shared with the "
                  "parent, which PSS counts once.", "",
                  "| what | peak above start | / model+AdamW state | peak RSS of the parent process (VmHWM) |",
                  "|---|---|---|---|"]
        for name, v in out["memory"]["probes"].items():
            how = f" ({v['mode']}, {v['workers_used']} process(es))" if "mode" in v else ""
            lines.append(f"| {name}{how} | {mb(v['peak_over_before_bytes']):.0f} MB | {v['peak_over_state']:.2f} | "
                         f"{mb(v['peak_rss_self_bytes']):.0f} MB |")
        lines.append("")
    lines += DESIGN_NOTES
    path.write_text("\n".join(lines))


DESIGN_NOTES = [
    "## How parallel replay works, and what was tried before",
    "",
    "`workers=W` cuts the model's 64K-element chunks (parameter order) into W contiguous shares of about equal "
    "elements. After the snapshot is loaded (and, for a step-0 snapshot, after the first step has created the "
    "optimizer state), every parameter and per-element optimizer tensor is moved into one anonymous `MAP_SHARED` "
    "mapping and W - 1 worker processes are forked (lowdiff/_recovery/procs.py). Each process, the caller "
    "included, reads only its tensors' columns of every segment (with one segment of read-ahead), decodes them "
    "and steps its own optimizer instance over its chunks through every step in order, in place. At the end a "
    "worker sends only its chunks' scalar state (Adam's `step`) and PowerSGD's newest Q through a pipe. A worker "
    "that fails sends its error (a damaged file is stepped around as in one process); one that dies is an error, "
    "never a partial state. `fork` is used only when the process runs no other thread (a thread holding h5py's "
    "or the allocator's lock at the fork would deadlock the child); otherwise recovery replays in one process and "
    "the report says why. The anonymous mapping needs no /dev/shm space.",
    "",
    "Before this, workers were threads over the same chunks (one optimizer instance each): on these 2 cores they "
    "were slower than one worker (0.80-0.94x wall, 1.6x the CPU time: the per-chunk optimizer Python serializes "
    "on the GIL). Before that, worker processes each loaded their own copy of their tensors and returned them "
    "by pickling: 0.79-1.78x, with 4.6x the state in peak memory.",
    "",
]


def _cpu_s() -> float:
    """CPU seconds of this process (all threads) plus its reaped children (the replay worker processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def plot(path: Path, out: dict[str, Any]) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    rows = out["rows"]
    xs = [r["steps"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w in out["protocol"]["workers"]:
        ax.plot(xs, [r[f"replay_w{w}_s"] for r in rows], "o-", label=f"lowdiff replay, {w} worker(s)")
    meas = [(r["steps"], r["recompute_s"]) for r in rows if r["recompute_measured"]]
    extra = [(r["steps"], r["recompute_s"]) for r in rows if not r["recompute_measured"]]
    ax.plot([p[0] for p in meas], [p[1] for p in meas], "s-", color="C3", label="recompute (measured)")
    if extra:
        start = meas[-1:]  # the extrapolated line continues the measured one, when there is one
        ax.plot([*[p[0] for p in start], *[p[0] for p in extra]], [*[p[1] for p in start], *[p[1] for p in extra]],
                "s--", color="C3", alpha=0.5, label="recompute (extrapolated)")
    ax.axhline(rows[0]["full_load_s"], color="grey", ls=":", label="torch.load full state")
    ax.set_xlabel("logged steps replayed")
    ax.set_ylabel("time to recovered state (s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    mdl = out["model"]
    ax.set_title(f"Recovery, GPT {mdl['params'] / 1e6:.1f}M, Top-k 1 %, AdamW (CPU)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
