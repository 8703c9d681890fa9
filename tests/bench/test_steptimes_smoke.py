"""bench/steptimes.py --smoke runs end to end and writes its three outputs (tests/bench/test_bench_smoke.py)."""

from __future__ import annotations

from pathlib import Path

from test_bench_smoke import _run


def test_steptimes_smoke(tmp_path: Path) -> None:
    out = _run("steptimes.py", tmp_path)
    res = out["results"]
    assert set(res) == {"off", "none", "none-shadow", "topk"}
    for r in res.values():
        assert r["median_ms"] > 0 and r["max_over_median"] >= 1 and r["snapshots"] >= 1
