"""Issue 20: forged and inconsistent run directories (cases.py), each recovered and verified in a child process
under a memory limit and a timeout (runner.py). Every case must end in an exact state, a reported fallback or a
clear refusal, and `lowdiff verify` must flag it: 0 silently wrong states, 0 hangs, 0 non-lowdiff exceptions,
0 allocations above 2x the model's state (plus the interpreter's working set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import lowdiff

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cases import CASES  # noqa: E402

FAILURES = ("silently-wrong", "hang", "non-lowdiff-exception", "over-allocation")
CASE_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("forged")
    root = str(Path(lowdiff.__file__).resolve().parent.parent)  # the lowdiff under test, also in the runner
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
           "LOWDIFF_FORGED_TIMEOUT_S": str(CASE_TIMEOUT_S)}
    p = subprocess.run([sys.executable, str(HERE / "runner.py"), str(work)], capture_output=True, text=True,
                       env=env, timeout=len(CASES) * (CASE_TIMEOUT_S + 5) + 300)
    assert p.returncode == 0, f"the runner failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    out = {}
    for line in p.stdout.splitlines():
        r = json.loads(line)
        out[r["case"]] = r
    return out


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_forged_case(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert r["category"] == "ok", f"{name} ({r['issue']}): {r['category']}: {r['detail']}"


def test_counts(results: dict[str, dict]) -> None:
    """The numbers issue 20 asks for (printed with -s; tests/hostile/README.md quotes them)."""
    assert set(results) == {c.name for c in CASES}
    counts = Counter(r["category"] for r in results.values())
    by_issue = Counter(r["issue"] for r in results.values())
    peak = max(r.get("peak_growth_bytes", 0) for r in results.values())
    print(f"\nforged cases: {len(results)} ({dict(sorted(by_issue.items()))})")
    for category in (*FAILURES, "unexpected", "verify-missed", "ok"):
        print(f"  {category:24s} {counts.get(category, 0)}")
    print(f"  largest resident growth of a case: {peak / 2**20:.1f} MiB")
    assert all(counts.get(c, 0) == 0 for c in FAILURES), counts
    assert counts["ok"] == len(results), counts
