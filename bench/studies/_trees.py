"""Two checkouts of lowdiff measured alternately: the same worker command run against each (``PYTHONPATH``), the
order alternating round by round (ABBA), so both see the same machine. Used by the studies that compare commits
(segwrite.py, stepcpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def alternate(trees: Sequence[str], rounds: int, cmd: list[str], describe: Callable[[dict[str, Any]], str],
              timeout: float = 600) -> tuple[str, str, dict[str, list[dict[str, Any]]]]:
    """Run ``cmd`` (which prints one JSON object last) ``rounds`` times against each of ``trees`` (old, new);
    returns their resolved paths and each one's results, printing ``describe(result)`` per run."""
    old, new = (str(Path(t).resolve()) for t in trees)
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for r in range(rounds):
        for name, tree in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            runs[name].append(res)
            print(f"round {r + 1}/{rounds} {name}: {describe(res)}", flush=True)
    return old, new, runs
