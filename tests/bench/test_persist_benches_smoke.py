"""bench/faststep.py, bench/killtest.py, bench/slowdisk.py and bench/directio.py --smoke run end to end (never
writing into bench/results/ or docs/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{script} --smoke failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"


def test_faststep_smoke(tmp_path: Path) -> None:
    _run("faststep.py", "--out-dir", str(tmp_path))
    res = json.loads((tmp_path / "faststep.json").read_text())
    assert {r["mode"] for r in res["rows"]} == {f"{c}-{p}" for c in ("topk", "powersgd", "none")
                                                 for p in ("thread", "process")}
    assert all(r["write_error"] is None for r in res["rows"])
    assert (tmp_path / "faststep.md").exists()


def test_killtest_smoke(tmp_path: Path) -> None:
    _run("killtest.py", "--out", str(tmp_path / "killtest.json"))
    summary = json.loads((tmp_path / "killtest.json").read_text())["summary"]
    assert summary["SIGKILL"]["exact"] == summary["SIGKILL"]["reached"] == 2
    assert summary["SIGTERM"]["exact"] == summary["SIGTERM"]["reached"] == 1


def test_slowdisk_smoke(tmp_path: Path) -> None:
    _run("slowdisk.py", "--out-dir", str(tmp_path))
    res = json.loads((tmp_path / "slowdisk.json").read_text())
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"off", "wait", "replica"}
    assert rows["wait"]["steps_skipped"] == 0 and rows["replica"]["durable_after_close"] == res["steps"]
    assert (tmp_path / "slowdisk.md").exists()


def test_directio_smoke(tmp_path: Path) -> None:
    _run("directio.py", "--out-dir", str(tmp_path))
    res = json.loads((tmp_path / "directio.json").read_text())
    assert {r["persistence"] for r in res["rows"]} == {"process", "thread"}
    assert all(len(r["direct_windows"]) == len(r["cached_windows"]) == 2 for r in res["rows"])
    assert (tmp_path / "directio.md").exists()
