"""Overhead of checkpointing every iteration, against the same training without it and against full-checkpoint
baselines (torch.save, CheckFreq-style async, torch.distributed.checkpoint async_save, naive differential).

    python bench/overhead.py            # the real run (~18 min on 2 cores); writes bench/results, docs/
    python bench/overhead.py --smoke --out-dir /tmp/x   # seconds; what tests/bench runs
    python bench/overhead.py --device cuda --model-size 50m   # on a GPU: bench/results/overhead-cuda.json, docs/
        # 50m: a full checkpoint is 595 MB and compressor none logs 200 MB per step; on a small disk add --tidy
        # and leave lowdiff-none(-layerwise) out (--modes); the 9 GB free on the H100 test machine did not hold a
        # full run
    python bench/overhead.py --modes lowdiff-topk-auto --out-name overhead-auto   # tuner-chosen settings only

On ``--device cuda`` the model, the optimizer state and the batches live on the GPU.

This file is the command line; the rest lives beside it:
  * overhead_protocol.py: the measurement protocol (rounds, interleaved windows, ratios, stratification);
  * overhead_modes.py: plain training and the full-checkpoint baselines;
  * overhead_lowdiff.py: the lowdiff modes (fixed, LowDiff+ variants, auto);
  * overhead_bandwidth.py: the segment write-bandwidth test after the rounds;
  * overhead_report.py: the Markdown page and the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import (  # noqa: E402
    MODEL_SIZES,
    SMOKE_MODEL,
    device_info,
    machine_info,
    maxrss_bytes,
    mb,
    output_paths,
    peak_rss_bytes,
    run_probe,
    to_device,
    write_json,
)
from overhead_bandwidth import measure_bandwidth  # noqa: E402
from overhead_lowdiff import AutoLowDiffMode, LowDiffMode, LowDiffPlusMode  # noqa: E402
from overhead_modes import PSGD_RANK, TOPK_RATIO, Ctx, Mode, Settings, baselines, dcp_available, train_step  # noqa: E402
from overhead_protocol import run  # noqa: E402
from overhead_report import plot, write_markdown  # noqa: E402

COMPRESSION_NOTE = ("compress/step of the lowdiff modes: opt.step() of lowdiff.wrap(SGD(lr=0), enabled: false, "
                    "compressor C) minus the same with compressor none (compress + decode), stepped alternately over "
                    "the same gradients on a copy of the model, median of the paired differences after a warm-up, "
                    "timed apart from the windows after the rounds (synchronized on a GPU); naivediff's is its own "
                    "delta computation, timed inside its steps.")

WATCH_NOTE = ("lowdiff's parameter-write watch (it warns once when parameters change outside opt.step(), "
              "docs/guide/exact-resume.md) fires in every lowdiff mode at its first window after another mode's, "
              "since all modes train one shared model, and checks nothing after its warning: its per-step cost "
              "(about 0.1 ms of training-thread CPU in an in-loop probe on the 2-core machine) is not in these "
              "figures; bench/faststep.py and bench/studies/stepcpu.py give each twin a model of its own.")


def build_modes(names: list[str] | None, ks: list[int], every: int, window: int, ld_window: int, codec: str,
                batch_steps: dict[str, int], with_dcp: bool, device: torch.device, auto: dict[str, Any] | None = None,
                warm_snapshot: bool = True) -> list[Mode]:
    """``auto``: {"compressors": [...], "mtbf_hours", "max_overhead", "max_warmup_steps"} adds lowdiff-C-auto for
    those compressors (and for any named in ``names``). Compressor none also gets the LowDiff+ variants
    lowdiff-none-shadow (CPU only) and lowdiff-none-layerwise."""
    modes: list[Mode] = [Mode("plain")]
    for comp in ("topk", "powersgd", "none"):
        modes.append(LowDiffMode(comp, False, every, batch_steps[comp], codec, ld_window, warm_snapshot))
        modes.append(LowDiffMode(comp, True, every, batch_steps[comp], codec, ld_window, warm_snapshot))
        if names is not None and f"lowdiff-{comp}-process" in names:  # only when named: not in the default run
            modes.append(LowDiffMode(comp, True, every, batch_steps[comp], codec, ld_window, warm_snapshot,
                                     persistence="process"))
        if comp == "none":  # the LowDiff+ variants (the shadow replica is refused when training on a GPU)
            for variant in LowDiffPlusMode.VARIANTS:
                if not (variant == "shadow" and device.type != "cpu"):
                    modes.append(LowDiffPlusMode(comp, variant, every, batch_steps[comp], codec, ld_window,
                                                 warm_snapshot))
        if auto is not None and (comp in auto["compressors"] or f"lowdiff-{comp}-auto" in (names or [])):
            modes.append(AutoLowDiffMode(comp, codec, ld_window, auto["mtbf_hours"], auto["max_overhead"],
                                         auto["max_warmup_steps"], auto.get("retune_drift")))
    modes += baselines(ks, with_dcp)
    for m in modes:
        m.window = ld_window if m.family == "lowdiff" else window  # an auto mode picks its own in warm()
    if names:
        keep = set(names) | {"plain"} | {m.ref for m in modes if m.name in names}
        modes = [m for m in modes if m.name in keep]
    return modes


def model_spec(args: argparse.Namespace) -> Any:
    spec = SMOKE_MODEL if args.smoke else MODEL_SIZES[args.model_size]
    changes = {k: v for k, v in (("batch", args.batch), ("block", args.block)) if v}
    return dataclasses.replace(spec, **changes) if changes else spec


def settings(args: argparse.Namespace) -> Settings:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    return Settings(device=torch.device(args.device), clip=not args.no_clip, snapshot_keep=1 if args.tidy else 0,
                    quick=args.smoke)


def run_probe_mode(args: argparse.Namespace) -> None:
    """``--probe MODE``: fresh process, train a few steps of one mode, print peak RSS as JSON."""
    torch.set_num_threads(args.threads)
    cfg = settings(args)
    spec = model_spec(args)
    every = 2  # a full snapshot is in flight during the probe, as it is every `snapshot.every_steps` in training
    modes = build_modes(None, [1], every, 1, 1, args.codec, _batch_steps(args), with_dcp=True, device=cfg.device)
    mode = next(m for m in modes if m.name == args.probe)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-probe-", dir=args.work_dir))
    try:
        model = spec.build().to(cfg.device)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        batches = to_device(spec.batches(2), cfg.device)
        mode.setup(Ctx(model, inner, work, cfg, shared=False))  # one mode: it may keep the model to itself
        for i in range(args.probe_steps):
            mode.step(batches[i % 2])
        mode.end_window()
        mode.close()
        gpu = torch.cuda.max_memory_allocated(cfg.device) if cfg.device.type == "cuda" else None
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
        [m.name for m in build_modes(None, [1], every, 1, 1, args.codec, _batch_steps(args), with_dcp,
                                     torch.device(args.device))]
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


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
    ap.add_argument("--bw-reps", type=int,
                    help="raw os.write + fsync repetitions of the bandwidth test (default 9; the writer's own "
                         "bandwidth comes from the timed windows)")
    ap.add_argument("--render-only", action="store_true", help="re-render .md and .png from an existing overhead.json")
    ap.add_argument("--memory-only", action="store_true",
                    help="only re-measure peak memory into an existing overhead.json (timings are kept)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--probe-steps", type=int, default=6, help=argparse.SUPPRESS)
    return ap, ap.parse_args()


def main() -> None:
    ap, args = parse_args()
    if args.probe:
        run_probe_mode(args)
        return
    if args.memory_only:
        settings(args)  # refuses --device cuda without CUDA
        memory_only(args)
        return
    if args.render_only:
        json_path, md_path, png_path = output_paths(args.out_dir, out_name(args))
        out = json.loads(json_path.read_text())
        write_markdown(md_path, out)
        plot(png_path, out)
        return

    torch.set_num_threads(args.threads)
    cfg = settings(args)
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
    bw_reps = args.bw_reps or (1 if args.smoke else 9)
    for k, w in [*((k, s) for k in ks), (every, s_ld)]:
        if (k > w and k % w) or (k <= w and w % k):
            ap.error(f"interval {k} and window {w}: one must divide the other (events must start windows)")
    if every < s_ld * rounds and not args.smoke:
        print(f"note: lowdiff snapshot every {every} steps; it lands in round {every // s_ld - 1}", flush=True)
    for b in (args.batch_steps, args.batch_steps_none):
        if s_ld % b:
            ap.error(f"batch steps {b} must divide --lowdiff-window {s_ld}")
    json_path, md_path, png_path = output_paths(args.out_dir, out_name(args))
    notes: list[str] = []
    with_dcp, dcp_note = dcp_available()
    notes.append(dcp_note)
    have = [m.name for m in build_modes(None, ks, every, s, s_ld, args.codec, _batch_steps(args), with_dcp, cfg.device,
                                        auto)]
    unknown = sorted(set(names or []) - set(have) - {f"lowdiff-{c}-{v}" for c in ("topk", "powersgd", "none")
                                                     for v in ("auto", "process")})
    if unknown:
        ap.error(f"--modes: unknown or not available here: {', '.join(unknown)} (have: {', '.join(have)})")
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="lowdiff-overhead-", dir=args.work_dir))
    info = machine_info()
    info["device"] = device_info(cfg.device)
    print(f"overhead: device {cfg.device}, model {spec}, {rounds} rounds, windows {s}/{s_ld} steps, ks {ks}, "
          f"work dir {work}", flush=True)
    try:
        model = spec.build().to(cfg.device)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
        nparams = sum(p.numel() for p in model.parameters())
        batches = to_device(spec.batches(8), cfg.device)
        ctx = Ctx(model, inner, work, cfg)
        modes = build_modes(names, ks, every, s, s_ld, args.codec, _batch_steps(args), with_dcp, cfg.device, auto,
                            warm_snapshot=not args.time_first_snapshot)
        train_step(cfg, model, inner, batches[0])  # AdamW state exists before anyone snapshots it
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        state_bytes += sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor))
        results = run(modes, ctx, batches, rounds, args.tidy, t_start)
        if any(isinstance(m, LowDiffMode) for m in modes):
            notes.append(COMPRESSION_NOTE)
            notes.append(WATCH_NOTE)
        print(f"  rounds done at {time.perf_counter() - t_start:.0f} s; bandwidth test", flush=True)
        bandwidth = measure_bandwidth(modes, work, bw_reps)
        for m in modes:
            m.close()
        shutil.rmtree(work, ignore_errors=True)
        memory = {"skipped": True} if args.no_memory else measure_memory(args, every, with_dcp)
        attach_memory(results, memory)
        out = {
            "benchmark": "overhead", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "machine": info, "device": cfg.device.type,
            "model": {**spec.as_dict(), "params": nparams, "state_bytes_model_plus_adam": state_bytes,
                      "size": "smoke" if args.smoke else args.model_size},
            "protocol": {"rounds": rounds, "window_steps": s, "lowdiff_window_steps": s_ld, "ks": ks,
                         "first_snapshot_timed": bool(args.time_first_snapshot),
                         "lowdiff_snapshot_every_steps": every,
                         "lowdiff_batch_steps": _batch_steps(args), "codec": args.codec, "torch_threads": args.threads,
                         "auto": auto, "tidy": args.tidy, "snapshot_keep": cfg.snapshot_keep,
                         "optimizer": "AdamW(lr=3e-4)" + (", clip_grad_norm 1.0" if cfg.clip else ", no clipping"),
                         "clip_grad_norm": cfg.clip, "topk_ratio": TOPK_RATIO,
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


if __name__ == "__main__":
    main()
