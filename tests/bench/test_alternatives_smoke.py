"""bench/alternatives.py --smoke (issue 36): every method's overhead, k=8 derived from k=4, two kill trials and
goodput, in a temporary directory. About 40 s on a quiet 2-core machine (most of it fresh interpreters importing
torch), several times that under other jobs' load."""

from __future__ import annotations

from pathlib import Path

from test_bench_smoke import _run


def test_alternatives_smoke(tmp_path: Path) -> None:
    out = _run("alternatives.py", tmp_path)
    modes, methods = out["modes"], out["methods"]
    fams = ("dcp-thread", "dcp-process", "checkfreq", "torchsave")
    assert {f"lowdiff-{c}-{p}" for c in ("topk", "powersgd", "none") for p in ("thread", "process")} <= set(methods)
    assert {f"{f}-k{k}" for f in fams for k in (4, 8)} <= set(methods)
    for name in methods:
        assert modes[name]["ratio"] > 0 and modes[name]["bytes_per_step"] > 0, name
    assert modes["lowdiff-topk-process"]["reference"] == "lowdiff-topk-off"
    assert modes["dcp-process-k8"]["derived_from"] == "dcp-process-k4"
    assert {r["method"] for r in out["kills"]} == {"lowdiff-topk-process", "torchsave-k4"}
    for r in out["kills"]:
        assert r["returned"] >= 1 and 0 <= r["lost_steps"] <= r["returned"]
        assert r["restart_to_first_step_s"] > 0 and r["peak_rss_trainer_bytes"] > 0
    ld = next(r for r in out["kills"] if r["method"] == "lowdiff-topk-process")
    assert ld["lost_steps"] == 0  # the persistence process keeps every returned step
    md = (tmp_path / "alternatives.md").read_text()
    assert "goodput = (1 - o) x (1 - C / MTBF)" in md and "| lowdiff-topk-process |" in md
