"""The benchmarks' --smoke modes run end to end (tiny model, a few steps) and write their three outputs into a
temporary directory, never into docs/ or bench/results/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # seconds on a quiet machine; the shared CI box can be several times slower


def _run(script: str, out_dir: Path, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", "--out-dir", str(out_dir),
                        "--work-dir", str(out_dir), *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"{script} --smoke failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    name = script.removesuffix(".py")
    for ext in ("json", "md", "png"):
        f = out_dir / f"{name}.{ext}"
        assert f.is_file() and f.stat().st_size > 0, f"{f} was not written"
    leftovers = [p.name for p in out_dir.iterdir() if p.name.startswith("lowdiff-")]
    assert not leftovers, f"work directories left behind: {leftovers}"
    return json.loads((out_dir / f"{name}.json").read_text())


def test_overhead_smoke(tmp_path: Path) -> None:
    out = _run("overhead.py", tmp_path)
    modes = out["modes"]
    assert {"plain", "lowdiff-topk", "lowdiff-topk-off", "lowdiff-powersgd", "lowdiff-none", "torchsave-k1",
            "checkfreq-k1", "naivediff-k1"} <= set(modes)
    for name, r in modes.items():
        assert r["ratio"] > 0, name
        assert isinstance(r["round_ratios"], list), name
    for comp in ("topk", "powersgd", "none"):
        assert modes[f"lowdiff-{comp}"]["bytes_per_step"] > 0
        assert modes[f"lowdiff-{comp}-off"]["bytes_per_step"] == 0
    assert modes["torchsave-k1"]["bytes_per_step"] > modes["lowdiff-topk"]["log_bytes_per_step"]
    assert "lowdiff-topk" in out["bandwidth"]
    assert "peak_rss_over_plain_bytes" in modes["lowdiff-topk"]


def test_recovery_smoke(tmp_path: Path) -> None:
    out = _run("recovery.py", tmp_path)
    assert out["exact"] and all(out["exact"].values()), out["exact"]
    assert [r["steps"] for r in out["rows"]] == out["protocol"]["lengths"]
    for r in out["rows"]:
        assert r["replay_w1_s"] > 0 and r["replay_w2_s"] > 0 and r["full_load_s"] > 0
    assert out["memory"]["probes"]


def test_overhead_smoke_auto(tmp_path: Path) -> None:
    """The auto mode (issue #7): the tuner decides during warm-up, its windows follow its choice."""
    out = _run("overhead.py", tmp_path, "--modes", "lowdiff-topk-auto", "--no-memory")
    r = out["modes"]["lowdiff-topk-auto"]
    assert r["reference"] == "lowdiff-topk-off" and r["ratio"] > 0
    assert r["decisions"] and r["decisions"][0]["reason"] == "initial"
    f, b = r["in_force"]["every_steps"], r["in_force"]["batch_steps"]
    assert f % b == 0 and f % r["window_steps"] == 0 and r["window_steps"] % b == 0
