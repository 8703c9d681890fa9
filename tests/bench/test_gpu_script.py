"""bench/gpu.sh, the one command for a GPU machine (issue 35): it parses, and its help names its parts. Its dry run
(``bash bench/gpu.sh --dry-run``: the same steps at tiny sizes on the CPU, about a minute and a half) is left to a
person, as the benchmarks' full runs are."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu.sh"


def test_gpu_script_parses_and_says_what_it_runs() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT), "--help"], check=True, capture_output=True, text=True).stdout
    for part in ("install", "guards", "gpu tests", "overhead", "--dry-run"):
        assert part in out, part
