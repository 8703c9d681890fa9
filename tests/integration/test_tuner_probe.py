"""The tuner's probe of the writer's interference (issue #7, docs/reference/tuner-model.md section 4) in a real
training run: auto settings, a tiny MTBF, a writer busy at every step. The tuner probes (no snapshot and 8 steps
per segment for 24 steps), measures alpha and re-solves; the decision log records the probe; nothing is lost."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff._persist.tuner import DECISIONS_FILE, PROBE_BATCH_STEPS, PROBE_STEPS, format_decisions
from lowdiff._storage.format import list_segments, list_snapshots
from lowdiff.testing import intercept_writes


def test_probe_measures_alpha_and_loses_nothing(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # A disk with 4 ms more per committed file: at a segment per step every step overlaps a write, whatever the
    # machine's own disk (tmpfs included).
    slow_disk = intercept_writes(before_commit=lambda path: time.sleep(0.004))
    slow_disk.__enter__()
    request.addfinalizer(lambda: slow_disk.__exit__(None, None, None))
    run = tmp_path / "run"
    run.mkdir()
    # As if resumed from a decision that keeps the writer busy at every step (a snapshot every 4 steps, a segment
    # per step): from the first decision on, steps without a write are missing and alpha can only be probed.
    (run / DECISIONS_FILE).write_text(json.dumps({"decisions": [{"step": 0, "every_steps": 4, "batch_steps": 1}]}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = lowdiff.wrap(inner, model, {
        "run_dir": str(run), "compressor": {"name": "topk", "ratio": 0.1},
        "snapshot": {"every_steps": "auto"}, "log": {"batch_steps": "auto"},
        "tuner": {"mtbf_hours": 0.001, "max_overhead": 0.02}})
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    refs, sched = {}, []
    for step in range(1, 401):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        # ~10 ms per step: the writer keeps up with a segment per step (no backlog spills into the probe), and a
        # segment write of 8 steps touches one or two steps, leaving most of the probe's steps without a write.
        time.sleep(0.01)
        refs[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()))
        st = opt.stats
        sched.append((st.every_steps, st.batch_steps, st.tuner_probing, st.last_snapshot_step))
        decided = st.tuner_decisions
        if st.tuner_settled and any(d.is_probe for d in decided) and step >= decided[-1].step + 8:
            break
    opt.close()

    decisions = json.loads((run / DECISIONS_FILE).read_text())["decisions"]
    assert decisions[0]["every_steps"] == 4  # the seed, kept as history
    mine = decisions[1:]
    assert mine[0]["reason"] == "initial" and "alpha not measured" in mine[0]["rationale"]
    probes = [d for d in mine if d["probe_steps"]]
    assert len(probes) == 1, format_decisions(mine)
    p = probes[0]
    start, end = p["step"], p["step"] + PROBE_STEPS
    assert p["probe_steps"] == PROBE_STEPS and p["batch_steps"] == PROBE_BATCH_STEPS
    assert p["reason"].startswith("probe: alpha not measured") and "nothing is skipped" in p["rationale"]
    # The probe is recorded and shown (lowdiff inspect prints format_decisions of tuner.json).
    assert f"step {start}: PROBE for {PROBE_STEPS} steps" in format_decisions(decisions)
    # Then (F, B) re-solved with the alpha it measured.
    after = [d for d in mine if d["step"] == end]
    assert after and after[0]["reason"].startswith(f"after the probe of steps {start + 1}-{end}: alpha measured")
    assert after[0]["costs"]["write_interference_high"] is not None
    # In force for steps start + 1 .. end: the probe's settings, then the new decision's; no snapshot in between.
    # sched[k - 1], read right after opt.step() of step k, holds the settings in force for step k: the checkpointer
    # takes a step's record when its iteration ends, at the next opt.step().
    for f, b, probing, _ in sched[start:end]:
        assert (f, b, probing) == (p["every_steps"], PROBE_BATCH_STEPS, True)
    assert sched[end][:3] == (after[0]["every_steps"], after[0]["batch_steps"], False)
    assert sched[end][3] <= start
    snaps = sorted(list_snapshots(run))
    assert not any(start < s <= end for s in snaps)
    # Nothing lost: every step in exactly one segment, the probe's of 8 steps, cut at its start and end.
    segs = [(a, b) for a, b, _ in list_segments(run)]
    assert [a for a, _ in segs] == [1] + [b + 1 for _, b in segs[:-1]] and segs[-1][1] == step
    assert [s for s in segs if start < s[0] <= end] == [(a, a + 7) for a in range(start + 1, end, 8)]
    assert not any(a <= s < b for a, b in segs for s in snaps)
    # Recovery is exact inside the probe, at its end and at the last step.
    for at in (start + 5, end, step):
        rec = lowdiff.recover(run, step=at)
        model_sd, optim_sd = refs[at]
        assert rec.step == at
        assert all(torch.equal(rec.model[k], v) for k, v in model_sd.items()), at
        for i, st in optim_sd["state"].items():
            assert all(torch.equal(v, rec.optimizer["state"][i][k]) for k, v in st.items()), at
    rec = lowdiff.recover(run)
    assert rec.step == step and all(torch.equal(rec.model[k], v) for k, v in model.state_dict().items())
