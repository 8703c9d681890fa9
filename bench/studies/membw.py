"""Does work on the second core cost the training thread nothing? Compute against memory traffic (issue 17).

Compressor ``none`` hands each step's full gradient to the writer: a copy of 3.2 MB on faststep's 48-block MLP,
0.4-0.8 ms of a 12.7 ms step when the training thread makes it. Copying on another thread instead (beside the
inner optimizer step, or beside the next forward and backward passes) is only free if the two cores do not share
what the copy uses up. This bench measures that on the machine it runs on:

- *scaling*: the same work on one thread, then on two threads at once (each doing it once): a 256 x 256 matmul loop
  (compute) and copies of a 32 MB tensor (memory traffic). With independent cores the two-thread time equals the
  one-thread time (ratio 1.0); 2.0 means the second thread gained nothing.
- *the copy beside training*: faststep's MLP (1 torch thread, batch 16, AdamW). Per round, each of: forward and
  backward alone (``fb``); forward and backward with the gradient copy of the step before running on another
  thread at the same time (``fb+copy beside``); the inner AdamW step alone and with the copy beside it; and the copy
  alone on the training thread (``copy``). The copy is one ``torch.cat(..., out=)`` of the gradients into a
  preallocated buffer, as a writer's ring slot. Medians over interleaved rounds; ``added`` is the median over
  rounds of (with copy - alone): what the copy beside cost the training thread, against ``copy``, what it costs
  made on the training thread itself.
- *the gradient produced in the slot*: the other way to hand the gradient over without a copy after backward. The
  gradients are set to views of a zeroed slot (one of 16, zeroed off the clock, as a persistence process would
  hand it back) so backward accumulates into it (``fb into slot``), and the same with the zeroing on the clock
  (``zero+fb into slot``), against forward and backward then the copy into a slot (``fb+copy``).

    python bench/studies/membw.py [--rounds 200] [--docs docs/measurements/membw.md]
    python bench/studies/membw.py --smoke --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common.py, faststep.py
from _common import ROOT, machine_info  # noqa: E402
from faststep import make_model  # noqa: E402


def _two_at_once(work: Callable[[], None]) -> float:
    threads = [threading.Thread(target=work) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _timed(work: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def scaling(repeats: int, n_matmul: int, n_copy: int, copy_mb: int) -> dict[str, Any]:
    a = torch.randn(256, 256)
    src, dst = torch.randn(copy_mb << 18), torch.empty(copy_mb << 18)

    def compute() -> None:
        for _ in range(n_matmul):
            a @ a

    def memory() -> None:
        for _ in range(n_copy):
            dst.copy_(src)

    out: dict[str, Any] = {}
    for name, work in (("compute", compute), ("memory", memory)):
        one, two = [], []
        work()
        for _ in range(repeats):  # interleaved
            one.append(_timed(work))
            two.append(_two_at_once(work))
        out[name] = {"one_s": statistics.median(one), "two_s": statistics.median(two),
                     "ratio": statistics.median(t / o for t, o in zip(two, one))}
    return out


def beside_training(rounds: int, blocks: int, width: int, batch: int) -> dict[str, Any]:
    model = make_model(blocks, width, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    buf = torch.empty(sum(p.numel() for p in params))
    buf.zero_()  # its pages faulted in, as a ring slot's are
    pool = ThreadPoolExecutor(max_workers=1)

    def fb() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    def copy(grads: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            torch.cat([g.reshape(-1) for g in grads], out=buf)
        return run

    slots = [torch.zeros_like(buf) for _ in range(16)]

    def into_slot(slot: torch.Tensor, zero: bool) -> Callable[[], None]:
        def run() -> None:
            if zero:
                slot.zero_()
            at = 0
            for p in params:
                p.grad = slot[at:at + p.numel()].view_as(p)
                at += p.numel()
            model(x).pow(2).mean().backward()  # accumulates into the slot's views
        return run

    def fb_then_copy(slot: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            fb()
            torch.cat([p.grad.reshape(-1) for p in params], out=slot)
        return run

    fb()
    opt.step()
    keys = ("fb", "fb+copy beside", "step", "step+copy beside", "copy", "fb+copy", "fb into slot",
            "zero+fb into slot")
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(rounds):
        grads = [p.grad for p in params]  # the step before's gradients (set_to_none: fresh tensors next pass)
        samples["fb"].append(_timed(fb))
        grads = [p.grad for p in params]
        future = pool.submit(copy(grads))
        samples["fb+copy beside"].append(_timed(fb))
        future.result()
        grads = [p.grad for p in params]
        samples["copy"].append(_timed(copy(grads)))
        samples["step"].append(_timed(opt.step))
        future = pool.submit(copy([p.grad for p in params]))
        samples["step+copy beside"].append(_timed(opt.step))
        future.result()
        for key, work in (("fb+copy", fb_then_copy), ("fb into slot", None), ("zero+fb into slot", None)):
            slot = slots[len(samples[key]) % len(slots)]
            if work is None:
                zero = key.startswith("zero")
                if not zero:
                    slot.zero_()
                run_it = into_slot(slot, zero)
            else:
                run_it = work(slot)
            opt.zero_grad(set_to_none=True)
            samples[key].append(_timed(run_it))
        opt.zero_grad(set_to_none=True)
        fb()  # fresh gradients of the model's own for the next round's copies
    pool.shutdown()
    med = {k: statistics.median(v) for k, v in samples.items()}
    added = {
        "fb": statistics.median(b - a for a, b in zip(samples["fb"], samples["fb+copy beside"])),
        "step": statistics.median(b - a for a, b in zip(samples["step"], samples["step+copy beside"])),
    }
    n = sum(p.numel() for p in params)
    return {"median_s": med, "added_s": added, "params": n, "copy_mb": n * 4 / 1e6}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    info = machine_info()
    res = {"machine": info, "args": vars(args),
           "scaling": scaling(args.repeats, args.matmuls, args.copies, args.copy_mb),
           "beside": beside_training(args.rounds, args.blocks, args.width, args.batch)}
    res["machine"]["loadavg_end"] = os.getloadavg()
    return res


def _load(avg: Any) -> str:
    return ", ".join(f"{x:.2f}" for x in avg)


def markdown(res: dict[str, Any]) -> str:
    m, a, sc, bs = res["machine"], res["args"], res["scaling"], res["beside"]
    ms = {k: v * 1e3 for k, v in bs["median_s"].items()}
    add = {k: v * 1e3 for k, v in bs["added_s"].items()}
    lines = [
        "# Work on the second core: compute against memory traffic (`bench/studies/membw.py`)",
        "",
        f"Generated by `python bench/studies/membw.py --rounds {a['rounds']} --docs docs/measurements/membw.md` at "
        f"{m['date']}, git {m['git_commit'][:7]}. Machine: {m['cpu_count']} CPUs ({m['platform']}), shared with "
        f"other jobs; load average (1, 5, 15 min) {_load(m['loadavg_start'])} before and "
        f"{_load(m['loadavg_end'])} after. torch {m['torch']}, Python {m['python']}, 1 torch thread per Python "
        "thread.",
        "",
        "## The same work on one thread, then on two at once",
        "",
        "| work | one thread ms | two threads at once ms | ratio (1.0: independent cores; 2.0: no gain) |",
        "|---|---|---|---|",
    ]
    for name, what in (("compute", f"{a['matmuls']} matmuls 256 x 256"),
                       ("memory", f"{a['copies']} copies of {a['copy_mb']} MB")):
        r = sc[name]
        lines.append(f"| {name} ({what}) | {r['one_s'] * 1e3:.1f} | {r['two_s'] * 1e3:.1f} | {r['ratio']:.2f} |")
    lines += [
        "",
        f"## A gradient copy beside training ({a['blocks']}-block MLP of width {a['width']}, batch {a['batch']}, "
        f"{bs['params'] / 1e6:.2f}M parameters, a {bs['copy_mb']:.1f} MB copy; {a['rounds']} interleaved rounds)",
        "",
        "| | median ms |",
        "|---|---|",
        f"| forward + backward | {ms['fb']:.2f} |",
        f"| forward + backward, the copy on another thread at the same time | {ms['fb+copy beside']:.2f} |",
        f"| AdamW step | {ms['step']:.2f} |",
        f"| AdamW step, the copy on another thread at the same time | {ms['step+copy beside']:.2f} |",
        f"| the copy on the training thread | {ms['copy']:.2f} |",
        "",
        f"What the copy on the other core added to the training thread (median over rounds of the difference): "
        f"{add['fb']:.2f} ms beside forward + backward, {add['step']:.2f} ms beside the AdamW step, against "
        f"{ms['copy']:.2f} ms made on the training thread itself.",
        "",
        "## The gradient produced in a slot instead of copied into one",
        "",
        "| | median ms |",
        "|---|---|",
        f"| forward + backward, then the copy into a slot | {ms['fb+copy']:.2f} |",
        f"| forward + backward into a slot zeroed beforehand (gradients set to its views) | {ms['fb into slot']:.2f} |",
        f"| the same with the zeroing on the clock | {ms['zero+fb into slot']:.2f} |",
        "",
        "Where backward into the slot is not clearly faster than backward and the copy, producing the gradient in "
        "shared memory saves the training thread nothing: accumulating into a cold slot costs what the copy does.",
        "",
        "Reading: where the memory ratio is near 2 the two cores share one memory bandwidth, and a copy moved to "
        "the other core slows the training thread's own memory-bound work (the optimizer step, the backward pass) "
        "by about what it would have cost on it. Design consequences: [design.md](../reference/design.md), "
        "section 7, *Cost on the training thread*.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--repeats", type=int, default=15, help="interleaved repeats of each scaling measurement")
    p.add_argument("--matmuls", type=int, default=400)
    p.add_argument("--copies", type=int, default=50)
    p.add_argument("--copy-mb", type=int, default=32)
    p.add_argument("--blocks", type=int, default=48)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--docs", default=None, help="write the markdown page here")
    p.add_argument("--smoke", action="store_true", help="tiny run: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.repeats, args.matmuls, args.copies, args.copy_mb, args.blocks = 3, 2, 4, 2, 1, 2
    res = run(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "membw.json").write_text(json.dumps(res, indent=1))
    if args.docs:
        Path(args.docs).write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
