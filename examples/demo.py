"""lowdiff end to end: train, crash for real, recover with the CLI, and prove the recovered state is exact.

    python3 examples/demo.py [--workdir ./demo-run] [--steps 60] [--kill-at 38]

1. Writes a lowdiff YAML config (Top-k 1% with error feedback, a full snapshot every 20 steps, one log segment
   per 4 steps, lz4) into the work directory.
2. Runs this script again as a child (``--train``): a ~1.9M-parameter GPT trained on the Python standard
   library's sources with AdamW, a warm-up + cosine LR schedule and gradient clipping, through ``lowdiff.wrap``.
   At step ``--kill-at`` the child sends itself SIGKILL: no ``close()``, no flush, a real crash.
3. Runs ``lowdiff-recover RUN_DIR --output recovered.pt``.
4. Recomputes the uninterrupted run in this process up to the recovered step, with the very same code path
   (``train()`` below) and lowdiff wrapped with ``enabled: false``, so compression and decoding are identical
   but nothing is written.
5. Loads recovered.pt with ``torch.load(weights_only=True)`` and checks ``torch.equal`` on every model tensor and
   every optimizer state tensor, and that the recovered step is the last one the trainer printed (``--kill-at``:
   the default persistence process outlives the trainer, so no step whose ``opt.step()`` returned is lost).
   Exits 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

# Run as `python3 examples/demo.py` from anywhere: make the repository root importable for `examples.tinygpt`.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

import lowdiff  # noqa: E402
from examples.tinygpt import GPT, StdlibText, param_groups  # noqa: E402

# The model and the training recipe. Small enough that the whole demo runs in well under a minute on 2 cores.
MODEL = dict(vocab_size=256, n_layer=4, n_head=4, d_model=192, block_size=128, dropout=0.1)
BATCH_SIZE = 16
LR = 3e-3
WEIGHT_DECAY = 0.1
WARMUP_STEPS = 5
CLIP_NORM = 1.0
DATA_BYTES = 2_000_000


def lowdiff_config(run_dir: Path) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir),
        "compressor": {"name": "topk", "ratio": 0.01, "error_feedback": True},
        "snapshot": {"every_steps": 20},
        "log": {"batch_steps": 4, "codec": "lz4"},
    }


def lr_lambda(total_steps: int):
    def f(step: int) -> float:  # `step` = optimizer steps taken so far
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def train(config: str | dict[str, Any], *, seed: int, steps: int, threads: int, stop_after: int | None = None,
          kill_at: int | None = None, verbose: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """THE training loop, shared by the crashing child and the in-process reference so that both draw the same
    random numbers in the same order: model init and dropout from torch's global RNG (seeded here), batches
    from their own generator. Returns right after optimizer step ``stop_after`` (before the LR scheduler
    advances, which is the state a lowdiff step holds); sends itself SIGKILL right after step ``kill_at``."""
    torch.set_num_threads(threads)  # same thread count in both processes: same float reduction order
    torch.manual_seed(seed)
    data = StdlibText(max_bytes=DATA_BYTES)
    batches = torch.Generator().manual_seed(seed + 1)
    model = GPT(**MODEL)
    inner = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(steps))
    opt = lowdiff.wrap(inner, model, config)
    start = opt.resume()
    if start != 0:
        raise SystemExit(f"expected a fresh run directory, found a run at step {start}")
    if verbose:
        print(f"[train] GPT with {model.num_params():,} parameters; data: {data}", flush=True)
    model.train()
    if stop_after == 0:
        return model, inner
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = data.get_batch(BATCH_SIZE, MODEL["block_size"], batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()  # lowdiff: top-k compress -> decode into .grad -> AdamW step -> log the step
        if verbose and (step % 5 == 0 or step == 1 or step == kill_at):
            print(f"[train] step {step:3d}  loss {loss.item():.4f}  lr {inner.param_groups[0]['lr']:.2e}  "
                  f"durable step {opt.durable_step:3d}  ({time.perf_counter() - t0:.1f} s)", flush=True)
        if step == stop_after:
            return model, inner
        if step == kill_at:
            print(f"[train] step {step}: simulating a crash with SIGKILL (no close(), no flush)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        sched.step()
    opt.close()
    return model, inner


# -- the parent: orchestration and the check ------------------------------------------------------------------


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 74 - len(text)), flush=True)


def find_console_script(name: str) -> str:
    """``name`` as pip installed it from [project.scripts]: on PATH, else next to this interpreter."""
    found = shutil.which(name)
    if found:
        return found
    for d in (sysconfig.get_path("scripts"), sysconfig.get_path("scripts", f"{os.name}_user"),
              str(Path(sys.executable).parent)):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    raise SystemExit(f"console script {name!r} not found; install lowdiff first: bash scripts/setup.sh "
                     "(or python3 -m pip install -e .)")


def fresh_dir(path: Path) -> None:
    """Remove a previous demo run (only if it looks like one), so the demo can be re-run."""
    if path.exists():
        if (path / "manifest.json").exists() or (path / "snapshots").is_dir() or not any(path.iterdir()):
            shutil.rmtree(path)
        else:
            raise SystemExit(f"{path} exists and is not a lowdiff run directory; choose another --workdir")


def log_size(run_dir: Path) -> tuple[int, int, int]:
    """(segments, steps they hold, bytes) of the committed log (segment files are steps-FIRST-LAST.h5)."""
    segs = sorted((run_dir / "log").glob("steps-*-*.h5"))
    steps = 0
    for p in segs:
        first, last = p.stem.split("-")[1:3]
        steps += int(last) - int(first) + 1
    return len(segs), steps, sum(p.stat().st_size for p in segs)


def compare(name: str, ref: Any, got: Any, problems: list[str]) -> int:
    """Bit-exact comparison; returns the number of tensors compared."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            problems.append(f"{name}: expected a tensor, recovered {type(got).__name__}")
        elif ref.dtype != got.dtype or ref.shape != got.shape:
            problems.append(f"{name}: {ref.dtype}{tuple(ref.shape)} vs recovered {got.dtype}{tuple(got.shape)}")
        elif not torch.equal(ref, got):
            diff = (ref.double() - got.double()).abs().max().item()
            problems.append(f"{name}: values differ (max abs diff {diff:.3e})")
        return 1
    if ref != got:
        problems.append(f"{name}: {ref!r} vs recovered {got!r}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("demo-run"), help="where the config, run directory and "
                    "recovered.pt go (default ./demo-run)")
    ap.add_argument("--steps", type=int, default=60, help="steps the run would take without the crash")
    ap.add_argument("--kill-at", type=int, default=38, help="step after which the trainer is SIGKILLed")
    ap.add_argument("--seed", type=int, default=1234)
    # One intra-op thread: with 2, torch's CPU kernels for this model are not run-to-run deterministic here (the
    # in-process reference then drifts from the crashed run in about half the runs, while recovery still equals
    # the crashed run's own log); the comparison needs a reproducible reference.
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (both runs; > 1 makes the reference itself non-reproducible on CPU)")
    ap.add_argument("--workers", type=int, default=None, help="passed to lowdiff-recover --workers")
    ap.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the child
    ap.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 1 <= args.kill_at < args.steps:
        ap.error(f"--kill-at must be in [1, --steps) = [1, {args.steps}), got {args.kill_at}")

    if args.train:
        train(str(args.config), seed=args.seed, steps=args.steps, threads=args.threads, kill_at=args.kill_at)
        return 0  # not reached: the child kills itself

    t_demo = time.perf_counter()
    workdir = args.workdir.resolve()
    run_dir = workdir / "run"
    recovered_path = workdir / "recovered.pt"
    config_path = workdir / "lowdiff.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    fresh_dir(run_dir)
    recovered_path.unlink(missing_ok=True)

    banner("1. config")
    cfg = lowdiff_config(run_dir)
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"{config_path}:\n{config_path.read_text()}")

    banner(f"2. train {args.steps} steps in a child process, SIGKILL at step {args.kill_at}")
    t0 = time.perf_counter()
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--train", "--config", str(config_path),
                            "--steps", str(args.steps), "--kill-at", str(args.kill_at), "--seed", str(args.seed),
                            "--threads", str(args.threads)])
    t_train = time.perf_counter() - t0
    if child.returncode != -signal.SIGKILL:
        print(f"FAIL: the trainer exited with {child.returncode}, expected to be killed by SIGKILL")
        return 1
    print(f"trainer killed by SIGKILL (exit {child.returncode}) after {t_train:.1f} s")
    n_seg, log_steps, log_bytes = log_size(run_dir)
    snaps = sorted(run_dir.glob("snapshots/step-*.h5"))
    print(f"on disk: {len(snaps)} snapshots ({', '.join(p.name for p in snaps)}), {n_seg} log segments, "
          f"leftover temporary files: {len(list(run_dir.rglob('*.tmp')))}")

    banner("3. lowdiff-recover")
    cmd = [find_console_script("lowdiff-recover"), str(run_dir), "--output", str(recovered_path)]
    if args.workers is not None:
        cmd += ["--workers", str(args.workers)]
    print("$ " + " ".join(["lowdiff-recover"] + cmd[1:]), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd).returncode
    t_recover = time.perf_counter() - t0
    if rc != 0 or not recovered_path.is_file():
        print(f"FAIL: lowdiff-recover exited with {rc}" + ("" if recovered_path.is_file() else
                                                            f" and wrote no {recovered_path}"))
        return 1
    rec = torch.load(recovered_path, weights_only=True)
    rec_step = int(rec["step"])
    print(f"lowdiff-recover took {t_recover:.1f} s; {recovered_path.name} holds step {rec_step}")

    banner(f"4. reference: the uninterrupted run, recomputed in-process up to step {rec_step}")
    t0 = time.perf_counter()
    ref_cfg = dict(lowdiff_config(workdir / "reference-not-written"), enabled=False)
    model, inner = train(ref_cfg, seed=args.seed, steps=args.steps, threads=args.threads, stop_after=rec_step,
                         verbose=False)
    t_ref = time.perf_counter() - t0
    print(f"recomputed {rec_step} steps in {t_ref:.1f} s")

    banner("5. compare")
    problems: list[str] = []
    ref_model = model.state_dict()
    ref_opt = inner.state_dict()
    n_model = n_opt = 0
    if set(ref_model) != set(rec["model"]):
        problems.append(f"model keys differ: missing {sorted(set(ref_model) - set(rec['model']))}, "
                        f"extra {sorted(set(rec['model']) - set(ref_model))}")
    for k in ref_model:
        if k in rec["model"]:
            n_model += compare(f"model[{k}]", ref_model[k], rec["model"][k], problems)
    rec_state = rec["optimizer"]["state"]
    if set(ref_opt["state"]) != set(rec_state):
        problems.append(f"optimizer state indices differ: {sorted(ref_opt['state'])} vs {sorted(rec_state)}")
    for i, st in ref_opt["state"].items():
        got = rec_state.get(i, {})
        if set(st) != set(got):
            problems.append(f"optimizer state[{i}] keys differ: {sorted(st)} vs {sorted(got)}")
        for k, v in st.items():
            if k in got:
                n_opt += compare(f"optimizer.state[{i}][{k}]", v, got[k], problems)
    rec_groups = rec["optimizer"]["param_groups"]
    if len(rec_groups) != len(ref_opt["param_groups"]):
        problems.append(f"{len(rec_groups)} param groups recovered, expected {len(ref_opt['param_groups'])}")
    for gi, (g_ref, g_rec) in enumerate(zip(ref_opt["param_groups"], rec_groups)):
        for k in ("lr", "weight_decay", "betas", "eps", "params"):
            want, got = g_ref.get(k), g_rec.get(k)
            if isinstance(want, tuple) and isinstance(got, list):
                got = tuple(got)
            compare(f"optimizer.param_groups[{gi}][{k}]", want, got, problems)

    # Counted again: the persistence process may still have been committing the last steps when the first count ran.
    n_seg, log_steps, log_bytes = log_size(run_dir)
    # The newest snapshot is a full one (step 0's holds no optimizer state or residuals yet).
    snap_bytes = snaps[-1].stat().st_size if snaps else 0
    snap_step = int(snaps[-1].stem.split("-")[1]) if snaps else 0
    t_demo = time.perf_counter() - t_demo
    banner("summary")
    print(f"crash after step        {args.kill_at}")
    print(f"recovered step          {rec_step}  (returned steps lost: {args.kill_at - rec_step}; a snapshot-only "
          f"checkpoint every 20 steps would have lost {args.kill_at - (args.kill_at // 20) * 20})")
    print(f"compared                {n_model} model tensors, {n_opt} optimizer state tensors, "
          f"{len(rec_groups)} param groups' hyperparameters")
    per_step = log_bytes / max(1, log_steps)
    print(f"log on disk             {log_bytes:,} bytes: {n_seg} segments holding {log_steps} steps "
          f"({per_step:,.0f} bytes/step)")
    print(f"one full snapshot       {snap_bytes:,} bytes (step {snap_step}: weights, AdamW moments, top-k residuals)")
    if log_bytes and snap_bytes:
        print(f"                        one logged step = {per_step / snap_bytes:.2%} of a snapshot; "
              f"all {log_steps} logged steps = {log_bytes / snap_bytes:.2f} snapshots")
    print(f"time                    train {t_train:.1f} s, recover {t_recover:.1f} s, reference {t_ref:.1f} s, "
          f"demo total {t_demo:.1f} s")
    if rec_step != args.kill_at:
        # The default persistence process outlives the trainer: every step whose opt.step() returned is kept.
        problems.insert(0, f"recovered step {rec_step}, but opt.step() had returned for step {args.kill_at} before "
                           "the crash: a returned step was lost")
    if problems:
        print(f"\nFAIL: {len(problems)} problem(s) with recovered.pt:")
        for p in problems[:20]:
            print(f"  {p}")
        if len(problems) > 20:
            print(f"  ... and {len(problems) - 20} more")
        return 1
    print(f"\nPASS: step {rec_step} recovered from snapshot + log is bit-identical to the uninterrupted run "
          "(torch.equal on every tensor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
