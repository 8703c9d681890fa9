"""bench/ddp.py and bench/fsdp.py (the same benchmark, DDP or fully_shard) run end to end in --smoke mode on 2
gloo ranks and write their JSON and Markdown into a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["ddp", "fsdp"])
def test_ranks_bench_smoke(tmp_path: Path, script: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--smoke", "--compressors", "topk",
                        "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    out = json.loads((tmp_path / f"{script}.json").read_text())
    two = [r for r in out["bytes"] if r["world"] == 2]
    assert len(two) == 1 and all(b > 0 for b in two[0]["per_rank_bytes_per_step"])
    assert out["overhead"] and out["overhead"][0]["ratio_median"] > 0
    page = (tmp_path / f"{script}.md").read_text()
    assert page.startswith("# DDP" if script == "ddp" else "# FSDP2") and f"bench/{script}.py --smoke" in page
