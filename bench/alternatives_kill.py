"""The kill trials of bench/alternatives.py: per method, a trainer in a fresh process is killed with SIGKILL at a
random moment, then a fresh process resumes from what the method left on disk and trains one step.

Trainer (``--trainer METHOD WORK SIZE``): builds the model, trains with the method and writes each step's number to
stdout once its step returned. Interval methods (DCP, CheckFreq-style, torch.save) save at step 1 (their first save
starts their helpers: a thread, DCP's upload process) and then at steps s0, s0 + k, s0 + 2k, ... (s0 = 5); lowdiff
logs every step and snapshots at the multiples of ``snapshot.every_steps`` F. The kill comes after a step drawn
uniformly from [s0, s0 + P) (P = k, or F for lowdiff) has returned, plus a delay drawn uniformly within the next
step: a uniform moment of one checkpoint period in the steady state. Before the kill the peak resident set
(VmHWM) of the trainer and of each of its child processes is read. Helpers the trainer started (lowdiff's
persistence process, DCP's upload process) are left to finish on their own, as after a crash of the trainer alone;
any still alive after ``HELPER_GRACE_S`` is killed (counted in ``helpers_killed``).

Resume (``--resume METHOD WORK SIZE``): a fresh interpreter that imports torch, builds the model and optimizer,
loads the newest complete checkpoint (``alternatives_methods.resume``: torch.load, dcp.load, ``opt.resume()``,
which replays the log) and trains one step. Restart time = wall time from starting that process to its first
step's end, measured by the parent (interpreter start and imports included: the same for every method).
Steps lost = last step the trainer reported - step the resumed run starts from (0 when the kill fell between a
step's return and its report, which may recover one more step than reported).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HELPER_GRACE_S = 30.0
S0 = 5
DEVICE_ENV = "LOWDIFF_ALTERNATIVES_DEVICE"
"""Where the trainers and resumes train (bench/alternatives.py --device sets it for the processes it starts)."""


def _spec(size: str) -> Any:
    from _common import FULL_MODEL, SMOKE_MODEL

    return SMOKE_MODEL if size == "smoke" else FULL_MODEL


def _ctx(work: Path, size: str) -> Any:
    import torch
    from _common import to_device
    from overhead_modes import Ctx, Settings

    torch.set_num_threads(1)
    device = torch.device(os.environ.get(DEVICE_ENV, "cpu"))
    spec = _spec(size)
    model = spec.build().to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return Ctx(model, inner, work, Settings(device=device), shared=False), to_device(spec.batches(8), device)


def trainer(name: str, work: str, size: str, every: int) -> None:
    from alternatives_methods import make_method
    from overhead_modes import IntervalMode

    ctx, batches = _ctx(Path(work), size)
    m = make_method(name, every)
    m.setup(ctx)
    if isinstance(m, IntervalMode):
        m.counter = (1 - S0) % m.interval  # saves at steps S0, S0 + k, ...
    os.write(1, b"START\n")
    n = 0
    while True:
        n += 1
        ev = m.step(batches[n % len(batches)])
        if n == 1 and isinstance(m, IntervalMode) and not ev:
            m.checkpoint()
            m.saves += 1
        os.write(1, f"{n}\n".encode())


def resume_probe(name: str, work: str, size: str, every: int) -> None:
    t0 = time.perf_counter()
    from alternatives_methods import resume
    from overhead_modes import train_step

    ctx, batches = _ctx(Path(work), size)
    t_built = time.perf_counter()
    step, opt = resume(name, ctx, every)
    t_loaded = time.perf_counter()
    train_step(ctx.settings, ctx.model, opt, batches[(step + 1) % len(batches)])
    t_first = time.perf_counter()
    print(json.dumps({"step": step, "build_s": t_built - t0, "load_s": t_loaded - t_built,
                      "first_step_s": t_first - t_loaded}), flush=True)
    if hasattr(opt, "close"):
        opt.close()


def _tree(pid: int) -> list[int]:
    from _common import children

    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += children(p)
    return seen


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (OSError, IndexError):
        return True


def _env() -> dict[str, str]:
    from _common import ROOT

    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def one_trial(script: Path, name: str, work: Path, size: str, every: int, period: int,
              rng: random.Random) -> dict[str, Any]:
    """One kill and one resume of method ``name``; ``period``: k, or F for lowdiff."""
    work.mkdir(parents=True)
    kill_after = rng.randrange(S0, S0 + period)
    frac = rng.random()
    err = (work / "trainer.stderr").open("wb")
    proc = subprocess.Popen([sys.executable, str(script), "--trainer", name, str(work), size, str(every)],
                            stdout=subprocess.PIPE, stderr=err, env=_env())
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"START":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{name}: the trainer did not start: {(work / 'trainer.stderr').read_text()[-2000:]}")
    returned, t_prev, step_s = 0, time.perf_counter(), 0.0
    while returned < kill_after:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{name}: trainer died: {(work / 'trainer.stderr').read_text()[-2000:]}")
        returned = int(line)
        now = time.perf_counter()
        step_s, t_prev = now - t_prev, now
    time.sleep(frac * step_s)
    from _common import proc_kib_bytes

    tree = _tree(proc.pid)
    hwm = {pid: proc_kib_bytes(pid, "status", "VmHWM") for pid in tree}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rest = proc.stdout.read().split()
    returned = int(rest[-1]) if rest else returned
    err.close()
    helpers = [p for p in tree if p != proc.pid]
    t0 = time.monotonic()
    while not all(_gone(p) for p in helpers) and time.monotonic() - t0 < HELPER_GRACE_S:
        time.sleep(0.02)
    killed = 0
    for p in helpers:
        if not _gone(p):
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    helper_exit_s = time.monotonic() - t0
    t_start = time.perf_counter()
    r = subprocess.run([sys.executable, str(script), "--resume", name, str(work), size, str(every)],
                       capture_output=True, text=True, env=_env(), timeout=600)
    restart_s = time.perf_counter() - t_start
    if r.returncode != 0:
        raise RuntimeError(f"{name}: resume failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"method": name, "kill_after": kill_after, "delay_frac": frac, "returned": returned,
            "recovered": res["step"], "lost_steps": max(0, returned - res["step"]),
            "restart_to_first_step_s": restart_s, "resume_phases": res, "helper_exit_s": helper_exit_s,
            "helpers_killed": killed, "peak_rss_trainer_bytes": hwm.get(proc.pid, 0),
            "peak_rss_helpers_bytes": sum(v for p, v in hwm.items() if p != proc.pid), "helpers": len(helpers),
            "step_s_before_kill": step_s}
