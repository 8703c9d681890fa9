"""bench/remote.py --smoke runs end to end against moto's S3 server and writes its three outputs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("s3fs", "moto", "flask")),
                    reason="needs s3fs and moto's server: pip install 'lowdiff[remote,test]'")
def test_remote_bench_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "remote.py"), "--smoke", "--out-dir", str(tmp_path),
                        "--work-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"remote.{ext}").stat().st_size > 0
    out = json.loads((tmp_path / "remote.json").read_text())
    assert out["step_ratio_mirror_over_off"] > 0 and out["upload_MBps"] > 0
    assert out["recover_remote_s"] and out["recovered_steps"] == 6
    assert not [q.name for q in tmp_path.iterdir() if q.name.startswith("lowdiff-")]
