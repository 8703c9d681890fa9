"""Before/after: the same benchmark run against two commits of lowdiff, alternately, so drift of a shared machine
falls on both sides.

    python bench/ab.py beb4529 HEAD --reps 2 -- bench/overhead.py --modes lowdiff-topk --rounds 3 --no-memory
    python bench/ab.py beb4529 HEAD --reps 2 -- bench/recovery.py --lengths 40,200 --reps 1 --no-memory

The benchmark script is this checkout's (it measures through lowdiff's public API only); what changes between the
two sides is the library it imports: each commit is checked out into a temporary git worktree and put first on
``PYTHONPATH``. Runs alternate A B A B ...; each writes its JSON under ``--out-dir/<side>-<rep>/`` (the benchmark's
``--out-dir``). Prints, per side, the JSON files each run wrote; compare them with the benchmark's own fields.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, parent: Path) -> Path:
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    path = parent / sha[:10]
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), sha], check=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="the 'before' commit")
    ap.add_argument("b", help="the 'after' commit")
    ap.add_argument("--reps", type=int, default=2, help="runs per side, alternating (default 2)")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: a new temporary directory")
    ap.epilog = "after --: the benchmark, SCRIPT ARGS... (SCRIPT relative to the repository root)"
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    bench = argv[cut + 1:]
    if not bench:
        ap.error("give the benchmark after --, e.g. -- bench/overhead.py --smoke")
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="lowdiff-ab-"))
    trees = Path(tempfile.mkdtemp(prefix="lowdiff-ab-trees-"))
    sides = {"A": worktree(args.a, trees), "B": worktree(args.b, trees)}
    results: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        for rep in range(args.reps):
            for side, tree in sides.items():
                run_out = out / f"{side}-{rep}"
                run_out.mkdir(parents=True, exist_ok=True)
                env = dict(os.environ, PYTHONPATH=str(tree))
                where = subprocess.run([sys.executable, "-c", "import lowdiff; print(lowdiff.__file__)"], env=env,
                                       cwd=tree, check=True, capture_output=True, text=True).stdout.strip()
                if not where.startswith(str(tree)):
                    raise SystemExit(f"side {side} imports lowdiff from {where}, not from {tree}")
                cmd = [sys.executable, str(ROOT / bench[0]), *bench[1:], "--out-dir", str(run_out)]
                print(f"[ab] {side} ({tree.name}) rep {rep + 1}/{args.reps}: {' '.join(cmd[1:])}", flush=True)
                t0 = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                results[side].append({"rep": rep, "seconds": round(time.perf_counter() - t0, 1),
                                      "json": sorted(str(p) for p in run_out.glob("*.json"))})
    finally:
        for tree in sides.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    summary = {"a": args.a, "b": args.b, "bench": bench, "out_dir": str(out), "runs": results}
    (out / "ab.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
