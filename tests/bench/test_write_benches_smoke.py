"""bench/gil.py, bench/writebw.py, bench/pagecache.py and bench/membw.py --smoke run end to end and write their
JSON (never into bench/results/)."""

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


def test_gil_smoke(tmp_path: Path) -> None:
    _run("gil.py", "--out", str(tmp_path / "gil.json"))
    assert json.loads((tmp_path / "gil.json").read_text())


def test_writebw_smoke(tmp_path: Path) -> None:
    _run("writebw.py", "--out", str(tmp_path / "writebw.json"), "--work", str(tmp_path))
    assert json.loads((tmp_path / "writebw.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["writebw.json"]  # scratch files removed


def test_pagecache_smoke(tmp_path: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        return  # the bench says so and exits: lowdiff drops nothing on such a platform
    work = tmp_path / "work"
    work.mkdir()
    _run("pagecache.py", "--out-dir", str(tmp_path), "--dir", str(work))
    res = json.loads((tmp_path / "pagecache.json").read_text())
    assert [r["mode"] for r in res["rows"]] == ["kept", "dropped"] and all(r["writes"] == 2 for r in res["rows"])
    assert list(work.iterdir()) == []  # its files removed


def test_membw_smoke(tmp_path: Path) -> None:
    _run("membw.py", "--out-dir", str(tmp_path), "--docs", str(tmp_path / "membw.md"))
    res = json.loads((tmp_path / "membw.json").read_text())
    assert set(res["scaling"]) == {"compute", "memory"} and res["beside"]["median_s"]["copy"] > 0
    assert "## A gradient copy beside training" in (tmp_path / "membw.md").read_text()
