"""Command-line tools: ``lowdiff-recover RUN_DIR`` and ``lowdiff {recover,inspect,verify}``.

Errors a user can act on print one line and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch

from lowdiff._recovery.api import recover
from lowdiff._recovery.run_info import inspect
from lowdiff._storage.remote import is_url
from lowdiff.errors import LowDiffError

OPTIMIZER_CLASS_HELP = ("MODULE:CLASS of the run's optimizer when it is not one of torch.optim's (imported because "
                        "you name it here; nothing named in a run directory is imported). Importing MODULE runs its "
                        "top-level code: name a module that defines CLASS, not a training script. A class the "
                        "training script itself defined is recorded as __main__.CLASS: name a module defining CLASS")


def _optimizer_class(spec: str | None) -> type | None:
    """The class ``--optimizer-class MODULE:CLASS`` names, imported (the user asks for it: it is trusted)."""
    if spec is None:
        return None
    module, sep, qualname = spec.partition(":")
    if not sep or not module or not qualname:
        raise LowDiffError(f"--optimizer-class {spec!r}: expected MODULE:CLASS, e.g. mypkg.optim:Lion")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # anything importing it raised: a one-line error, never a traceback
        raise LowDiffError(f"--optimizer-class {spec}: cannot import it ({type(e).__name__}: {e}); is its package on "
                           "PYTHONPATH?") from e
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise LowDiffError(f"--optimizer-class {spec} is not a torch.optim.Optimizer subclass")
    return obj


class _Bar:
    """``recover()``'s ``progress``: advances a tqdm bar, and gives it the number of steps to replay (its total, so
    it shows an ETA) once recovery knows it."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def set_total(self, total: int) -> None:
        self.bar.reset(total=total)


def _add_recover_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory (holds manifest.json), or the URL it is mirrored to "
                   "(s3://bucket/prefix; endpoint and credentials from the store's environment)")
    p.add_argument("--optimizer-class", default=None, metavar="MODULE:CLASS", help=OPTIMIZER_CLASS_HELP)
    p.add_argument("--step", type=int, default=None, help="step to rebuild (default: latest durable)")
    p.add_argument("--workers", type=int, default=None, help="replay worker processes (default: automatic)")
    p.add_argument("--output", default=None, help="write {step, model, optimizer} here (torch.save, plain tensors)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _check_recover_args(args: argparse.Namespace) -> None:
    """Refuse what would fail only after the whole replay (an unwritable --output) or make no sense, up front."""
    if args.workers is not None and args.workers < 1:
        raise LowDiffError(f"--workers must be at least 1, got {args.workers}")
    if args.step is not None and args.step < 0:
        raise LowDiffError(f"--step must be 0 or more, got {args.step}")
    if args.output:
        out = Path(args.output)
        parent = out.parent if str(out.parent) else Path(".")
        if out.is_dir():
            raise LowDiffError(f"--output {out} is a directory; name the file to write")
        if not parent.is_dir():
            raise LowDiffError(f"--output {out}: directory {parent} does not exist; create it first")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise LowDiffError(f"--output {out}: directory {parent} is not writable")
        run_dir = Path(args.run_dir).resolve()
        if not is_url(args.run_dir) and (out.resolve() == run_dir or run_dir in out.resolve().parents):
            raise LowDiffError(f"--output {out} is inside the run directory {args.run_dir}, where it could replace "
                               "one of the run's files; write it elsewhere")


def _cmd_recover(args: argparse.Namespace) -> int:
    _check_recover_args(args)
    bar: Any = None
    progress = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        # No monitor thread: replay worker processes are forked only from a process without other threads.
        tqdm.monitor_interval = 0
        bar = tqdm(desc="replaying", unit="step", file=sys.stderr)
        progress = _Bar(bar)
    try:
        rec = recover(args.run_dir, step=args.step, workers=args.workers, progress=progress,
                      optimizer_class=_optimizer_class(args.optimizer_class))
    finally:
        if bar is not None:
            bar.close()
    print(rec.report.summary())
    if args.output:
        out = Path(args.output)
        tmp = out.with_name(out.name + ".tmp")
        torch.save({"step": rec.step, "model": dict(rec.model), "optimizer": rec.optimizer}, tmp)
        os.replace(tmp, out)
        print(f"wrote {out} (load with torch.load(path, weights_only=True))")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    print(inspect(args.run_dir).summary())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """Every check recovery makes, on every file, plus decoding every payload; exit 0 only if all is well."""
    from lowdiff._recovery.verify import verify

    report = verify(args.run_dir, optimizer_class=_optimizer_class(args.optimizer_class))
    print(report.summary())
    return 0 if report.ok else 1


def _cmd_compact(args: argparse.Namespace) -> int:
    from lowdiff._recovery.compact import compact

    res = compact(args.run_dir, step=args.step, keep=args.keep, workers=args.workers,
                  optimizer_class=_optimizer_class(args.optimizer_class))
    what = "wrote a snapshot" if res.wrote_snapshot else "a snapshot already existed"
    print(f"compacted {args.run_dir} at step {res.step}: {what}; removed {len(res.removed)} file(s)")
    for p in res.removed:
        print(f"  removed {p.name}")
    return 0


def _run(fn: Any, args: argparse.Namespace, prog: str) -> int:
    try:
        return int(fn(args))
    except (LowDiffError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def recover_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lowdiff-recover", description="Rebuild the latest (or a given) step of a "
                                "lowdiff run exactly, from its snapshots and differential log.")
    _add_recover_args(p)
    args = p.parse_args(argv)
    return _run(_cmd_recover, args, "lowdiff-recover")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lowdiff", description="Inspect, verify and recover lowdiff run directories.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_recover_args(sub.add_parser("recover", help="rebuild a step (same as lowdiff-recover)"))
    sub.add_parser("inspect", help="summarize snapshots, log and model").add_argument("run_dir")
    vp = sub.add_parser("verify", help="check every file as recovery would and decode every payload; exit 1 if "
                        "recovery would skip or refuse anything")
    vp.add_argument("run_dir")
    vp.add_argument("--optimizer-class", default=None, metavar="MODULE:CLASS", help=OPTIMIZER_CLASS_HELP)
    cp = sub.add_parser("compact", help="fold the log up to a step into a new full snapshot; apply retention")
    cp.add_argument("run_dir")
    cp.add_argument("--step", type=int, default=None, help="step to snapshot (default: latest durable)")
    cp.add_argument("--keep", type=int, default=None, help="then keep only the newest N snapshots (and their log)")
    cp.add_argument("--workers", type=int, default=None, help="replay worker processes")
    cp.add_argument("--optimizer-class", default=None, metavar="MODULE:CLASS", help=OPTIMIZER_CLASS_HELP)
    args = p.parse_args(argv)
    fn = {"recover": _cmd_recover, "inspect": _cmd_inspect, "verify": _cmd_verify,
          "compact": _cmd_compact}[args.command]
    return _run(fn, args, f"lowdiff {args.command}")


if __name__ == "__main__":
    sys.exit(main())
