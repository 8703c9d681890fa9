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
    bw = out["bandwidth"]["lowdiff-topk"]  # the writer's bandwidth in training (opt.stats) beside raw write+fsync
    assert bw["method"] == "in training" and bw["none"]["lowdiff_MBps"] > 0 and bw["none"]["raw_MBps"] > 0
    assert "peak_rss_over_plain_bytes" in modes["lowdiff-topk"]
    # The LowDiff+ variants (issue #8): same reference as lowdiff-none, and the step-time tail for every mode.
    for variant in ("shadow", "layerwise"):
        r = modes[f"lowdiff-none-{variant}"]
        assert r["reference"] == "lowdiff-none-off" and r["variant"] == variant and r["bytes_per_step"] > 0
    assert modes["lowdiff-none-shadow"]["shadow_in_force"] is True
    assert {"hits_timed", "misses_timed", "hooks_active"} <= set(modes["lowdiff-none-layerwise"]["capture"])
    for name, r in modes.items():
        assert r["max_over_median"] >= 1.0, name
        assert all("event_steps" in w for w in r["windows"]), name
    for name in ("lowdiff-none", "lowdiff-none-shadow", "lowdiff-none-layerwise"):
        # --smoke: snapshot every 4 steps, windows of 2: step 4 starts the second round's window
        assert modes[name]["event_steps_timed"] >= 1 and modes[name]["event_steps_over_others"] > 0, name
    assert modes["lowdiff-none-off"]["event_steps_over_others"] is None
    md = (tmp_path / "overhead.md").read_text()
    assert "| max / median step | event steps / others |" in md and "## LowDiff+ variants" in md


def test_overhead_render_only_old_json(tmp_path: Path) -> None:
    """--render-only on a result written before the step-time tail and the LowDiff+ variants: new cells are '-'."""
    old = json.loads((ROOT / "bench" / "results" / "overhead.json").read_text())
    for r in old["modes"].values():
        for key in ("max_over_median", "event_steps_over_others", "event_steps_timed", "variant"):
            r.pop(key, None)
    (tmp_path / "overhead.json").write_text(json.dumps(old))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--render-only",
                        "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [ln for ln in (tmp_path / "overhead.md").read_text().splitlines() if ln.startswith("| lowdiff-none |")]
    assert rows and rows[0].endswith("| - | - |"), rows


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
    assert r["drain_timeouts"] == 0  # a window's end waited for a commit that could not come (120 s each)
    # The windows follow the decision in force at the end of warm-up (a noisy machine may make the tuner
    # re-decide during the rounds: every decision is in r["decisions"]).
    f, b = r["aligned_to"]["every_steps"], r["aligned_to"]["batch_steps"]
    assert f % b == 0 and f % r["window_steps"] == 0 and r["window_steps"] % b == 0


def test_compress_smoke(tmp_path: Path) -> None:
    out = _run("compress.py", tmp_path)
    assert [r["method"] for r in out["rows"]][-1] == "plain training step"
    assert all(len(r["runs_s"]) == out["rounds"] for r in out["rows"])
    # The lowdiff rows are differences of opt.step() times (compressor C minus none): positive unless noise wins
    # on the tiny smoke model, so only the measured steps and the plain rows are held to > 0.
    assert all(r["median_s"] > 0 for r in out["rows"] if not r["method"].startswith("lowdiff"))
    assert set(out["opt_step_runs_s"]) == {"none", "topk", "powersgd"}
    assert all(t > 0 for ts in out["opt_step_runs_s"].values() for t in ts)


def test_startup_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "startup.py"), "--smoke", "--out-dir", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-4000:]
    doc = json.loads((tmp_path / "startup.json").read_text())
    assert {r["mode"] for r in doc["trials_data"]} == {"off", "thread", "process"}
    assert all(r["ten_steps_s"] >= r["first_step_s"] > 0 for r in doc["trials_data"])
    assert (tmp_path / "startup.md").read_text().startswith("# Time to the first steps")
