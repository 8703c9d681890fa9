"""Kill the training process at random moments; every recovery must be exact and reach the last returned step.

A trainer subprocess (``log.persistence: process`` by default, Top-k, batch_steps 16) writes each step to stdout
right after its ``opt.step()`` returned; at a random moment (a random step, then a random delay inside the following
step) it gets SIGKILL or SIGTERM, alone (its persistence process is not signalled). Once the persistence process
has exited, ``lowdiff.recover`` must return a state ``torch.equal`` to the uninterrupted run's at that step, and the
step must be at least the last one reported (one more is allowed: killed between ``opt.step()`` and the report).
``--ints``: SIGINT (a Ctrl-C to the trainer alone): its KeyboardInterrupt ends the trainer, raised outside lowdiff's
code.

    python bench/killtest.py --kills 50 --terms 20 --ints 20   # bench/results/killtest.json
    python bench/killtest.py --persistence thread --kills 10   # the thread: steps are lost
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import lowdiff

REPO = Path(__file__).resolve().parents[1]
STEPS = 120


def make(run_dir: str, persistence: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                                                                  torch.nn.GELU())])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = lowdiff.wrap(inner, model, {"run_dir": run_dir, "compressor": {"name": "topk", "ratio": 0.05},
                                      "snapshot": {"every_steps": 40},
                                      "log": {"batch_steps": 16, "persistence": persistence}})
    return model, inner, opt


def train_step(model: torch.nn.Module, opt: Any, k: int) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(k))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def trainer(run_dir: str, persistence: str) -> None:
    # A Ctrl-C's KeyboardInterrupt, as in a terminal, even when this script was started in the background by a shell
    # without job control (which ignores SIGINT for it and its children).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    model, _, opt = make(run_dir, persistence)
    print("START", flush=True)
    for k in range(1, STEPS + 1):
        train_step(model, opt, k)
        os.write(1, f"{k}\n".encode())
        time.sleep(0.002)
    time.sleep(600)


def reference(work: Path) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    model, inner, opt = make(str(work / "ref"), "thread")
    refs = {}
    for k in range(1, STEPS + 1):
        train_step(model, opt, k)
        refs[k] = ({n: t.clone() for n, t in model.state_dict().items()},
                   {i: {n: v.clone() for n, v in st.items()} for i, st in inner.state_dict()["state"].items()})
    opt.close()
    return refs


def descendants(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


def one(work: Path, i: int, sig: int, rng: random.Random, persistence: str) -> dict[str, Any]:
    run_dir = work / f"run-{i}"
    kill_after = rng.randrange(1, STEPS - 5)
    delay = rng.uniform(0, 0.03)
    proc = subprocess.Popen([sys.executable, __file__, "--trainer", str(run_dir), persistence],
                            stdout=subprocess.PIPE, stderr=(work / f"run-{i}.stderr").open("wb"),
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"START"
    returned = 0
    while returned < kill_after:
        returned = int(proc.stdout.readline())
    time.sleep(delay)
    helpers = descendants(proc.pid)
    proc.send_signal(sig)
    proc.wait()
    rest = proc.stdout.read().split()
    returned = int(rest[-1]) if rest else returned
    t0 = time.monotonic()
    while not all(gone(p) for p in helpers):
        if time.monotonic() - t0 > 60:
            raise RuntimeError(f"run {i}: the persistence process did not exit (see {work}/run-{i}.stderr)")
        time.sleep(0.01)
    commit_s = time.monotonic() - t0
    rec = lowdiff.recover(run_dir, workers=1)
    return {"signal": signal.Signals(sig).name, "kill_after": kill_after, "delay_s": delay, "returned": returned,
            "recovered": rec.step, "helper_exit_s": commit_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--terms", type=int, default=20)
    ap.add_argument("--ints", type=int, default=0, help="runs ended by SIGINT (Ctrl-C)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--persistence", default="process", choices=("thread", "process"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "killtest.json")
    ap.add_argument("--smoke", action="store_true", help="2 kills and 1 SIGTERM: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.kills, args.terms, args.ints = 2, 1, 1
    if args.trainer:
        trainer(*args.trainer)
        return
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-killtest-"))
    refs = reference(work)
    rng = random.Random(args.seed)
    rows = []
    for i, sig in enumerate([signal.SIGKILL] * args.kills + [signal.SIGTERM] * args.terms
                                 + [signal.SIGINT] * args.ints):
        r = one(work, i, sig, rng, args.persistence)
        rec = lowdiff.recover(work / f"run-{i}", step=r["recovered"], workers=1) if r["recovered"] else None
        exact = rec is not None and all(torch.equal(rec.model[n], t) for n, t in refs[r["recovered"]][0].items()) \
            and all(torch.equal(rec.optimizer["state"][j][n], v) for j, st in refs[r["recovered"]][1].items()
                    for n, v in st.items())
        r["exact"] = bool(exact)
        r["reached"] = r["returned"] <= r["recovered"] <= r["returned"] + 1
        rows.append(r)
        print(json.dumps(r), flush=True)
    summary = {sig: {"runs": len(rs), "exact": sum(r["exact"] for r in rs), "reached": sum(r["reached"] for r in rs),
                     "lost_steps_max": max(r["returned"] - r["recovered"] for r in rs),
                     "helper_exit_s_max": max(r["helper_exit_s"] for r in rs)}
               for sig in ("SIGKILL", "SIGTERM", "SIGINT") if (rs := [r for r in rows if r["signal"] == sig])}
    out = {"persistence": args.persistence, "seed": args.seed, "steps": STEPS, "summary": summary, "rows": rows,
           "load": os.getloadavg(), "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    if all(r["exact"] and r["reached"] for r in rows):
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"run directories and trainer stderr kept in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
