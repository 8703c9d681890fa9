"""Compression time per step on the CPU: lowdiff's Top-k and PowerSGD against a plain training step.

Measured through lowdiff's public API: the gradients of one backward pass of the GPT are stepped by ``opt.step()``
of ``lowdiff.wrap(SGD(lr=0), model, {"enabled": False, "compressor": C})``, which compresses them and decodes the
payload into ``.grad`` with error feedback (what the optimizer wrapper does every step, without writing anything),
then runs the inner step; the same gradients (restored before every step) are stepped by the same wrapper with
compressor none, which compresses nothing. A method's time is the median over rounds of (its step - the
compressor-none step of the same round): compress + decode. The inner optimizer is SGD at learning rate 0, whose
step costs the same whatever the gradient holds: AdamW's would not (its sqrt is several times slower on the exact
zeros a sparse decoded gradient leaves in a young ``exp_avg_sq``; that would be charged to the compressor). The
rounds run every method round-robin so machine drift cancels, next to a plain training step (forward, backward,
clipping, AdamW) measured in the same rounds. ``torch.topk`` is the selection the issue names as too slow
(exact top-k of |g| per tensor, indices sorted, no error feedback or decode: a lower bound on its cost).

    python bench/compress.py            # 49.5M GPT: bench/results/compress.json, docs/measurements/compress.md
    python bench/compress.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import (
    GPT50M_MODEL,
    SMOKE_MODEL,
    k_for,
    machine_info,
    median,
    output_paths,
    pyplot,
    train_step,
    write_json,
)

import lowdiff

RATIO, RANK = 0.01, 4
METHODS = {"lowdiff topk 1 %": "topk", "lowdiff powersgd r=4": "powersgd"}


def wrapped_steps(model: torch.nn.Module, grads: dict[str, torch.Tensor], work: Path
                  ) -> tuple[dict[str, Callable[[], float]], list[Any]]:
    """Per compressor (none, topk, powersgd): a function that restores ``grads`` into ``.grad`` (untimed) and
    returns the seconds of one ``opt.step()`` of an ``enabled: false`` wrapper with that compressor around an SGD
    of learning rate 0 (module docstring); and the wrappers, to close."""
    params = dict(model.named_parameters())
    opts = {c: lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model,
                            {"run_dir": str(work / c), "enabled": False,
                             "compressor": {"name": c, "ratio": RATIO, "rank": RANK}})
            for c in ("none", *METHODS.values())}

    def timed(opt: Any) -> Callable[[], float]:
        def run() -> float:
            for n, g in grads.items():
                params[n].grad = g.clone()
            t0 = time.perf_counter()
            opt.step()
            return time.perf_counter() - t0
        return run

    return {c: timed(o) for c, o in opts.items()}, list(opts.values())


def torch_topk(grads: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for g in grads.values():
        flat = g.reshape(-1)
        torch.sort(torch.topk(flat.abs(), k_for(flat.numel(), RATIO), sorted=False).indices)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--work-dir", default=None, help="where the enabled: false wrappers' run directories are named "
                                                     "(nothing is written there; default: system tmp)")
    ap.add_argument("--out-name", default="compress")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SMOKE_MODEL if args.smoke else dataclasses.replace(GPT50M_MODEL, batch=2, block=128)
    rounds = 2 if args.smoke else args.rounds
    model = spec.build()
    batches = spec.batches(4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    n_params = sum(p.numel() for p in model.parameters())
    x, y = batches[0]
    model(x, y)[1].backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.zero_grad(set_to_none=True)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-compress-", dir=args.work_dir))
    try:
        steps, wrappers = wrapped_steps(model, grads, work)
        for f in steps.values():  # warm-up: first calls allocate the residuals, Q and scratch buffers
            f(), f()
        torch_topk(grads)
        for b in batches[:2]:  # and the plain AdamW's state, and the first forward/backward's allocations
            train_step(model, opt, b)
        step_s: dict[str, list[float]] = {c: [] for c in steps}
        times: dict[str, list[float]] = {name: [] for name in [*METHODS, "torch.topk selection only",
                                                               "plain training step"]}
        for r in range(rounds):
            for c, f in steps.items():  # none first: each method's difference is to the none step of its round
                step_s[c].append(f())
            for name, c in METHODS.items():
                times[name].append(step_s[c][-1] - step_s["none"][-1])
            times["torch.topk selection only"].append(torch_topk(grads))
            t0 = time.perf_counter()
            train_step(model, opt, batches[r % len(batches)])
            times["plain training step"].append(time.perf_counter() - t0)
        for w in wrappers:
            w.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    step = median(times["plain training step"])
    rows = [{"method": name, "median_s": median(ts), "runs_s": ts, "of_plain_step": median(ts) / step}
            for name, ts in times.items()]
    out = {"benchmark": "compress", "machine": machine_info(), "model": spec.as_dict(), "parameters": n_params,
           "rounds": rounds, "topk_ratio": RATIO, "powersgd_rank": RANK, "torch_threads": args.threads,
           "command": "python3 bench/compress.py" + (" --smoke" if args.smoke else "")
           + (f" --rounds {args.rounds}" if args.rounds != 7 else ""), "rows": rows,
           "method": "opt.step() of an enabled: false wrapper with the compressor minus one with compressor none, "
                     "same gradients, same round", "opt_step_runs_s": step_s}
    jpath, mpath, ppath = output_paths(args.out_dir, args.out_name)
    write_json(jpath, out)
    m = out["machine"]
    lines = [
        "# Compression time per step (CPU)", "",
        f"Generated by `{out['command']}` on {m['date']} (git {m['git_commit'][:10]}); {m['cpu_count']} CPUs, "
        f"torch {m['torch']}, {args.threads} torch thread(s); load average at start {m['loadavg_start'][0]:.1f}.",
        "",
        f"GPT {spec.n_layer} layers, d_model {spec.d_model}, {n_params / 1e6:.1f} M parameters, batch {spec.batch} x "
        f"{spec.block} tokens. The gradients of one backward pass, stepped by `opt.step()` of "
        f"`lowdiff.wrap(SGD(lr=0), model, {{enabled: false, compressor: C}})` (compress, decode into `.grad` with "
        f"error feedback, an inner step whose cost does not depend on the values), minus the same step with "
        f"compressor none in the same round; {rounds} rounds round-robin with `torch.topk` and a plain training "
        f"step; medians.", "",
        "| method | median per step | of a plain training step |", "|---|---|---|",
    ]
    lines += [f"| {r['method']} | {r['median_s'] * 1e3:.0f} ms | {r['of_plain_step']:.2f} |" for r in rows]
    lines += ["", "`torch.topk selection only`: the exact top-k of |g| per tensor with `torch.topk`, indices sorted; "
              "no error feedback, no decode (a lower bound on a Top-k built on it).", ""]
    mpath.write_text("\n".join(lines))
    _plot(rows, ppath)
    print("\n".join(lines))


def _plot(rows: list[dict[str, Any]], path: Any) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.barh([r["method"] for r in rows], [r["median_s"] * 1e3 for r in rows])
    ax.set_xlabel("ms per step (median)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
