"""The cheap studies of bench/studies/ (writebw, pagecache, membw: seconds each) run end to end with --smoke and
write their JSON (never into bench/results/). Marked ``slow`` and skipped unless LOWDIFF_SLOW=1: studies are
one-off measurements kept runnable, not the benchmarks a user runs (bench/studies/README.md). The other studies
(gil, tuner: ~25 s each; codecs; gpu_writer_split, which needs CUDA) have no test: run them by hand; gilwait,
segwrite, stepcpu and handover run their --smoke here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("LOWDIFF_SLOW") != "1", reason="a study: runs with LOWDIFF_SLOW=1")]


def _run(script: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "studies" / script), "--smoke", *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{script} --smoke failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"


def test_writebw_smoke(tmp_path: Path) -> None:
    _run("writebw.py", "--out", str(tmp_path / "writebw.json"), "--work", str(tmp_path))
    assert json.loads((tmp_path / "writebw.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["writebw.json"]  # scratch files removed


def test_pagecache_smoke(tmp_path: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        return  # the study says so and exits: lowdiff drops nothing on such a platform
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


def test_gilwait_smoke(tmp_path: Path) -> None:
    if not os.path.exists("/proc/thread-self/schedstat"):
        return  # Linux only: the study says so and exits
    _run("gilwait.py", "--out", str(tmp_path / "gilwait.json"))
    res = json.loads((tmp_path / "gilwait.json").read_text())["results"]
    assert set(res) == {"topk", "powersgd"} and set(res["topk"]) == {"off", "thread", "process"}


def test_segwrite_smoke(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    _run("segwrite.py", "--trees", str(ROOT), str(ROOT), "--out", str(tmp_path / "segwrite.json"), "--work", str(work))
    res = json.loads((tmp_path / "segwrite.json").read_text())
    assert [r["compressor"] for r in res["rows"]] == ["topk", "powersgd"]
    assert all(r["new_cpu_ms"] > 0 and len(r["old_runs"]) == 2 for r in res["rows"])
    assert list(work.iterdir()) == []  # its segments removed


def test_stepcpu_smoke(tmp_path: Path) -> None:
    _run("stepcpu.py", "--trees", str(ROOT), str(ROOT), "--out", str(tmp_path / "stepcpu.json"))
    res = json.loads((tmp_path / "stepcpu.json").read_text())
    assert [(r["compressor"], r["persistence"]) for r in res["rows"]] == [
        ("topk", "thread"), ("topk", "process"), ("powersgd", "thread"), ("powersgd", "process")]
    assert all(len(r["old_runs"]) == 2 and len(r["new_runs"]) == 2 for r in res["rows"])


def test_handover_smoke(tmp_path: Path) -> None:
    _run("handover.py", "--out", str(tmp_path / "handover.json"))
    res = json.loads((tmp_path / "handover.json").read_text())
    assert set(res["median"]) == {"socket", "mailbox", "socket-small", "mailbox-small", "none"}
    assert all(v > 0 for v in res["median"].values())
