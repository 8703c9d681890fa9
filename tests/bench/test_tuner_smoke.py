"""bench/tuner.py --smoke runs end to end (tiny model, tiny grid, few simulated failures) and writes its three
outputs into a temporary directory, never into docs/ or bench/results/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # ~20 s on a quiet machine; the shared CI box can be several times slower


def test_tuner_bench_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "tuner.py"), "--smoke", "--out-dir", str(tmp_path),
                        "--fast-dir", str(tmp_path), "--slow-dir", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"bench/tuner.py --smoke failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    for ext in ("json", "md", "png"):
        f = tmp_path / f"tuner.{ext}"
        assert f.is_file() and f.stat().st_size > 0, f"{f} was not written"
    assert not [q.name for q in tmp_path.iterdir() if q.name.startswith("lowdiff-")], "work directories left behind"
    out = json.loads((tmp_path / "tuner.json").read_text())
    assert out["smoke"] and len(out["scenarios"]) == 6  # fast, slow, throttled disk x MTBF 1 h, 24 h
    for s in out["scenarios"]:
        t = s["tuner"]
        assert t["every"] % t["batch"] == 0 and t["waste_s_per_hour"] > 0 and t["failures"] > 0
        assert s["grid_best"]["waste_s_per_hour"] > 0 and s["checkfreq"]["k_final"] >= s["checkfreq"]["k_initial"]
        assert set(s["fixed"]) == {"50", "100", "500"}
        # The closed-form model and the event simulation agree at the tuner's point (loose: few failures).
        assert 0.5 < t["model_waste_s_per_hour"] / t["waste_s_per_hour"] < 2.0
    for c in out["costs"].values():
        assert c["iteration_s"] > 0 and c["diff_bytes"] > 0 and c["snapshot_bytes"] > c["diff_bytes"]
        assert c["write_bytes_per_s"] > 0 and c["replay_step_s"] > 0
