"""2-rank gloo DDP runs (torchrun, each with a timeout): exact recovery for every compressor, sharded
writes, resume at another world size, and a rank that dies mid-run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff._storage.format import list_segments, list_snapshots
from lowdiff._storage.manifest import read_manifest
from lowdiff._storage.snapshot import read_rank_state

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("ddp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, *args: str, timeout: float = 150.0, check: bool = True,
             worker: Path = WORKER) -> subprocess.CompletedProcess[str]:
    """``worker`` with ``args`` on ``nproc`` local gloo ranks (a fresh port each launch), within ``timeout``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(worker), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def assert_matches(rec: lowdiff.Recovered, model_sd: dict, optim_sd: dict) -> None:
    assert set(rec.model) == set(model_sd)
    for k, v in model_sd.items():
        assert torch.equal(v, rec.model[k]), k
    assert set(rec.optimizer["state"]) == set(optim_sd["state"])
    for i, st in optim_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, rec.optimizer["state"][i][k]), (i, k)


@pytest.fixture(scope="module")
def topk_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    d = tmp_path_factory.mktemp("ddp-topk")
    torchrun(2, str(d / "run"), "topk", "12", str(d / "ref.pt"))
    return d / "run", torch.load(d / "ref.pt", weights_only=False)


def test_topk_every_step_exact_and_sharded(topk_run: tuple[Path, list]) -> None:
    run, refs = topk_run
    for step, model_sd, optim_sd in refs:
        assert_matches(lowdiff.recover(run, step=step), model_sd, optim_sd)
    # Every segment and snapshot is written as two shards, one per rank, of comparable size.
    segs = list_segments(run)
    assert segs and all(len(f.paths) == 2 for _, _, f in segs)
    assert all(len(f.paths) == 2 for f in list_snapshots(run).values())
    sizes = [sum(f.paths[i].stat().st_size for _, _, f in segs) for i in range(2)]
    assert max(sizes) < 3 * min(sizes)


@pytest.mark.parametrize("compressor", ["powersgd", "none"])
def test_exact_recovery(tmp_path: Path, compressor: str) -> None:
    torchrun(2, str(tmp_path / "run"), compressor, "8", str(tmp_path / "ref.pt"))
    refs = torch.load(tmp_path / "ref.pt", weights_only=False)
    for step, model_sd, optim_sd in refs[-4:]:
        assert_matches(lowdiff.recover(tmp_path / "run", step=step), model_sd, optim_sd)


@pytest.mark.parametrize(("compressor", "persistence"), [("topk", "thread"), ("powersgd", "process")])
def test_grad_scaler_exact_and_no_device_sync(tmp_path: Path, compressor: str, persistence: str) -> None:
    """A tracked GradScaler under DDP: the hook logs the scaled gradients and each step the factor the scaler
    unscaled them by; replay gives every step's state bit for bit, iterations the scaler skipped included. Each
    rank's training thread (the hook in backward, the step, the scaler's update) makes no device sync from lowdiff's
    code in the steps watched (tests/sync_watch.py)."""
    ref = tmp_path / "ref.pt"
    torchrun(2, str(tmp_path / "run"), compressor, "10", str(ref), "--scaler", "--skip", "4", "7",
             "--sync-watch", "3", "--persistence", persistence)
    refs = torch.load(ref, weights_only=False)
    assert [s for s, _, _ in refs] == list(range(1, 11))
    for step, model_sd, optim_sd in refs:
        assert_matches(lowdiff.recover(tmp_path / "run", step=step), model_sd, optim_sd)
    for rank in (0, 1):
        found = torch.load(f"{ref}.rank{rank}.syncs")
        assert not found, (rank, found)
    # It found two: Top-k's merge of the ranks' selections took their union with torch.unique, once per parameter
    # per step in backward (the writer now drops the repeats: lowdiff._compressors.topk.merge_gathered), and a
    # tracked GradScaler's state_dict() read its scale with .item() at every iteration's end (read without it since:
    # lowdiff._training.iteration.scaler_state).


def test_process_persistence_one_process_per_rank_exact(tmp_path: Path) -> None:
    torchrun(2, str(tmp_path / "run"), "topk", "8", str(tmp_path / "ref.pt"), "--persistence", "process")
    refs = torch.load(tmp_path / "ref.pt", weights_only=False)
    for step, model_sd, optim_sd in refs:
        assert_matches(lowdiff.recover(tmp_path / "run", step=step), model_sd, optim_sd)
    assert any(".shard-00001-of-00002" in p.name for p in (tmp_path / "run" / "log").iterdir())


def test_compiled_ddp_model_is_exact(tmp_path: Path) -> None:
    """``torch.compile(DDP(model))`` handed to lowdiff: its DDP is found inside (the compression hook, each rank's
    share of the files) and the run records the model's own names."""
    torchrun(2, str(tmp_path / "run"), "topk", "8", str(tmp_path / "ref.pt"), "--compiled")
    refs = torch.load(tmp_path / "ref.pt", weights_only=False)
    for step, model_sd, optim_sd in refs:
        assert_matches(lowdiff.recover(tmp_path / "run", step=step), model_sd, optim_sd)
    assert any(".shard-00001-of-00002" in p.name for p in (tmp_path / "run" / "log").iterdir())


def test_resume_on_another_world_size(tmp_path: Path, topk_run: tuple[Path, list]) -> None:
    src, refs = topk_run
    run = tmp_path / "run"
    # Train 8 steps on 2 ranks, then continue to 12 on 1 rank from the same run directory.
    torchrun(2, str(run), "topk", "8", str(tmp_path / "ref2.pt"))
    torchrun(1, str(run), "topk", "12", str(tmp_path / "ref1.pt"), "--resume")
    two = torch.load(tmp_path / "ref2.pt", weights_only=False)
    one = torch.load(tmp_path / "ref1.pt", weights_only=False)
    assert [s for s, _, _ in one] == [9, 10, 11, 12]
    assert_matches(lowdiff.recover(run, step=8), two[-1][1], two[-1][2])
    for step, model_sd, optim_sd in one:
        assert_matches(lowdiff.recover(run, step=step), model_sd, optim_sd)
    # Steps 1-8 are 2-shard files, 9-12 single files: no conversion step was needed.
    counts = {len(f.paths) for _, _, f in list_segments(run)}
    assert counts == {1, 2}


def test_rank_dies_mid_run(tmp_path: Path, topk_run: tuple[Path, list]) -> None:
    _, refs = topk_run
    proc = torchrun(2, str(tmp_path / "run"), "topk", "12", str(tmp_path / "ref.pt"), "--die-at", "8", check=False)
    assert proc.returncode != 0
    rec = lowdiff.recover(tmp_path / "run")
    # Rank 1 vanished before step 8 without flushing: whatever both ranks had committed is recoverable (the
    # exact step depends on how far rank 1's writer got), never anything from an incomplete shard set.
    assert 0 <= rec.step < 8
    step, model_sd, optim_sd = refs[rec.step - 1]
    assert step == rec.step
    assert_matches(rec, model_sd, optim_sd)


def test_two_rank_resume_continues_exactly(tmp_path: Path) -> None:
    """Dropout + per-rank RNG: a 2-rank run stopped at step 6 and resumed on 2 ranks matches the uninterrupted
    run bit for bit (parameters, optimizer state and every rank's per-step losses)."""
    torchrun(2, str(tmp_path / "a"), "none", "10", str(tmp_path / "a.pt"), "--continuous-rng")
    torchrun(2, str(tmp_path / "b"), "none", "6", str(tmp_path / "b1.pt"), "--continuous-rng")
    torchrun(2, str(tmp_path / "b"), "none", "10", str(tmp_path / "b2.pt"), "--continuous-rng", "--resume")
    full = torch.load(tmp_path / "a.pt", weights_only=False)
    resumed = torch.load(tmp_path / "b2.pt", weights_only=False)
    assert [s for s, _, _ in resumed] == [7, 8, 9, 10]
    for (s1, m1, o1), (s2, m2, o2) in zip(full[6:], resumed):
        assert s1 == s2
        for k, v in m1.items():
            assert torch.equal(v, m2[k]), (s1, k)
        for i, st in o1["state"].items():
            for k, v in st.items():
                assert torch.equal(v, o2["state"][i][k]), (s1, i, k)
    for rank in range(2):
        a = dict(torch.load(f"{tmp_path / 'a.pt'}.rank{rank}.losses"))
        b = dict(torch.load(f"{tmp_path / 'b2.pt'}.rank{rank}.losses"))
        assert all(a[s] == b[s] for s in range(7, 11)), rank


def assert_continues_exactly(full: Path, resumed: Path, first: int) -> None:
    """Steps ``first``.. of the resumed run equal the uninterrupted run's, on both ranks (state and losses)."""
    a = {s: (m, o) for s, m, o in torch.load(full, weights_only=False)}
    b = torch.load(resumed, weights_only=False)
    assert b and b[0][0] == first
    for step, model_sd, optim_sd in b:
        for k, v in a[step][0].items():
            assert torch.equal(v, model_sd[k]), (step, k)
        assert a[step][1]["param_groups"] == optim_sd["param_groups"]
        for i, st in a[step][1]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, optim_sd["state"][i][k]), (step, i, k)
    for rank in range(2):
        la, lb = dict(torch.load(f"{full}.rank{rank}.losses")), dict(torch.load(f"{resumed}.rank{rank}.losses"))
        assert all(la[s] == lb[s] for s in lb), rank


def test_topk_resume_at_snapshot_step_is_exact(tmp_path: Path) -> None:
    """Top-k's error-feedback residuals differ per rank: each rank snapshots its own (FORMAT.md section 4), so a
    2-rank run stopped at snapshot step 10 and resumed on 2 ranks continues bit for bit from the first step."""
    torchrun(2, str(tmp_path / "a"), "topk", "14", str(tmp_path / "a.pt"), "--continuous-rng")
    torchrun(2, str(tmp_path / "b"), "topk", "10", str(tmp_path / "b1.pt"), "--continuous-rng")
    out = torchrun(2, str(tmp_path / "b"), "topk", "14", str(tmp_path / "b2.pt"), "--continuous-rng", "--resume")
    assert "START 10" in out.stdout
    assert_continues_exactly(tmp_path / "a.pt", tmp_path / "b2.pt", 11)
    snap = list_snapshots(tmp_path / "b")[10]
    residuals = [read_rank_state(snap, read_manifest(tmp_path / "b"), r) for r in range(2)]
    assert residuals[0].keys() == residuals[1].keys() and residuals[0]
    assert any(not torch.equal(residuals[0][n]["residual"], residuals[1][n]["residual"]) for n in residuals[0])
    # The resume started a branch of the run's history (FORMAT.md section 2): both ranks stamp their shards of
    # every later file with the one the manifest records, or recovery would refuse them.
    assert [step for _, step in read_manifest(tmp_path / "b").history] == [10]
    for step, model_sd, optim_sd in torch.load(tmp_path / "b2.pt", weights_only=False)[-2:]:
        assert_matches(lowdiff.recover(tmp_path / "b", step=step), model_sd, optim_sd)


def test_powersgd_resume_at_snapshot_between_snapshots(tmp_path: Path) -> None:
    """Stopped at step 12, between snapshots 10 and 15: resume(at="snapshot") goes back to 10 on both ranks and the
    redone steps 11-14 equal the uninterrupted run's."""
    torchrun(2, str(tmp_path / "a"), "powersgd", "14", str(tmp_path / "a.pt"), "--continuous-rng")
    torchrun(2, str(tmp_path / "b"), "powersgd", "12", str(tmp_path / "b1.pt"), "--continuous-rng")
    out = torchrun(2, str(tmp_path / "b"), "powersgd", "14", str(tmp_path / "b2.pt"), "--continuous-rng", "--resume",
                   "--resume-at", "snapshot")
    assert "START 10" in out.stdout
    assert_continues_exactly(tmp_path / "a.pt", tmp_path / "b2.pt", 11)


def test_auto_settings_rank0_decides_for_all(tmp_path: Path) -> None:
    """snapshot.every_steps / log.batch_steps auto on 2 ranks: rank 0's tuner decides, both ranks have the same
    values in force at every step, so every snapshot and segment is a complete 2-shard set; recovery is exact."""
    from lowdiff._persist.tuner import DECISIONS_FILE
    from lowdiff._storage.format import LOG_DIR, SNAPSHOT_DIR, parse_segment_name, parse_snapshot_name

    steps = 400
    torchrun(2, str(tmp_path / "run"), "topk", str(steps), str(tmp_path / "ref.pt"), "--auto", timeout=240.0)
    run = tmp_path / "run"
    decisions = json.loads((run / DECISIONS_FILE).read_text())["decisions"]
    assert decisions and decisions[0]["step"] > 128  # rank 0 decided after the bootstrap snapshot
    s0 = torch.load(f"{tmp_path / 'ref.pt'}.rank0.sched")
    s1 = torch.load(f"{tmp_path / 'ref.pt'}.rank1.sched")
    assert s0 == s1 and len(s0) == steps
    # Decisions are taken at multiples of 8 and in force from the next step on, on both ranks. s1[k - 1] is read
    # right after opt.step() of step k: the settings in force for step k (the checkpointer takes a step's record
    # when its iteration ends, at the next opt.step()).
    for d in decisions:
        assert d["step"] % 8 == 0
        if d["step"] < steps:
            assert s1[d["step"]][1:3] == (d["every_steps"], d["batch_steps"]), d
    assert {(f, b) for _, f, b, _ in s1} != {(128, 16)}  # the schedule did move off the bootstrap values
    # Every file belongs to a complete shard set: the ranks cut segments and snapshotted at the same steps.
    snap_files = [parse_snapshot_name(p.name) for p in (run / SNAPSHOT_DIR).iterdir()]
    seg_files = [parse_segment_name(p.name) for p in (run / LOG_DIR).iterdir()]
    assert None not in snap_files and None not in seg_files
    snaps, segs = list_snapshots(run), list_segments(run)
    assert len(snap_files) == 2 * len(snaps) and len(seg_files) == 2 * len(segs)
    # The last step's own snapshot, when the schedule puts one there, is taken as that iteration ends (at close),
    # after s0 recorded the step: then the newest snapshot is the last step, one interval after the recorded one.
    last = sorted(snaps)[-1]
    assert last == s0[-1][3] or (last == steps and steps - s0[-1][3] >= s0[-1][1]), (last, s0[-1])
    assert len(snaps) >= 3  # 0, 128 (bootstrap) and the tuned ones
    # The log covers every step once, and no segment straddles a snapshot.
    assert [a for a, _, _ in segs] == [1] + [b + 1 for _, b, _ in segs[:-1]] and segs[-1][1] == steps
    assert not any(a <= s < b for a, b, _ in segs for s in snaps)
    refs = torch.load(tmp_path / "ref.pt", weights_only=False)
    step, model_sd, optim_sd = refs[-1]
    assert step == steps
    assert_matches(lowdiff.recover(run, step=step), model_sd, optim_sd)
    # Resumed, both ranks start from rank 0's last decision (tuner.json) and stay in step.
    torchrun(2, str(run), "topk", str(steps + 40), str(tmp_path / "ref2.pt"), "--auto", "--resume", timeout=240.0)
    r0 = torch.load(f"{tmp_path / 'ref2.pt'}.rank0.sched")
    assert r0 == torch.load(f"{tmp_path / 'ref2.pt'}.rank1.sched") and r0[0][0] == steps + 1
    assert r0[0][1:3] == (decisions[-1]["every_steps"], decisions[-1]["batch_steps"])
    step, model_sd, optim_sd = torch.load(tmp_path / "ref2.pt", weights_only=False)[-1]
    assert step == steps + 40
    assert_matches(lowdiff.recover(run, step=step), model_sd, optim_sd)


def test_auto_probe_is_broadcast(tmp_path: Path) -> None:
    """A probe of the writer's interference under DDP (docs/reference/tuner-model.md, section 4): rank 0 starts
    it and both ranks put its settings in force at the same step (no snapshot, 8 steps per segment, cut at once),
    then the decision after it; every file is a complete 2-shard set, and nothing is lost: recovery is exact
    inside the probe, at its end and at the last step."""
    from lowdiff._persist.tuner import DECISIONS_FILE
    from lowdiff._storage.format import LOG_DIR, SNAPSHOT_DIR

    run = tmp_path / "run"
    run.mkdir()
    # As if resumed from a decision that keeps the writer busy at every step (a snapshot every 4 steps, a segment
    # per step; the worker slows snapshot writes): no step without a write, so alpha can only be probed.
    (run / DECISIONS_FILE).write_text(json.dumps({"decisions": [{"step": 0, "every_steps": 4, "batch_steps": 1}]}))
    steps = 80
    torchrun(2, str(run), "topk", str(steps), str(tmp_path / "ref.pt"), "--auto", "--probe", timeout=240.0)
    decisions = json.loads((run / DECISIONS_FILE).read_text())["decisions"][1:]
    probes = [d for d in decisions if d["probe_steps"]]
    assert len(probes) == 1, decisions
    p = probes[0]
    start, end = p["step"], p["step"] + p["probe_steps"]
    assert start % 8 == 0 and p["batch_steps"] == 8 and p["every_steps"] % 8 == 0
    after = [d for d in decisions if d["step"] == end]
    assert after and after[0]["reason"].startswith(f"after the probe of steps {start + 1}-{end}"), decisions
    s0 = torch.load(f"{tmp_path / 'ref.pt'}.rank0.sched")
    s1 = torch.load(f"{tmp_path / 'ref.pt'}.rank1.sched")
    assert s0 == s1 and len(s0) == steps
    for d in decisions:  # s1[k - 1]: read after opt.step() of step k, the settings in force for step k
        assert d["step"] % 8 == 0 and (d["step"] >= steps or s1[d["step"]][1:3] == (d["every_steps"],
                                                                                   d["batch_steps"])), d
    # In force for steps start + 1 .. end on both ranks (taken after step start): the probe's settings; no snapshot.
    for step, f, b, _ in s1[start:end]:
        assert (f, b) == (p["every_steps"], p["batch_steps"]), (step, f, b)
    assert s1[end][3] <= start
    snaps, segs = list_snapshots(run), list_segments(run)
    assert len(list((run / SNAPSHOT_DIR).iterdir())) == 2 * len(snaps)
    assert len(list((run / LOG_DIR).iterdir())) == 2 * len(segs)
    # Every step logged once; the probe's segments hold 8 steps each, cut at its start and end.
    assert [a for a, _, _ in segs] == [1] + [b + 1 for _, b, _ in segs[:-1]] and segs[-1][1] == steps
    assert [(a, b) for a, b, _ in segs if start < a <= end] == [(a, a + 7) for a in range(start + 1, end, 8)]
    assert not any(a <= s < b for a, b, _ in segs for s in snaps)
    refs = {s: (m, o) for s, m, o in torch.load(tmp_path / "ref.pt", weights_only=False)}
    for step in (start + 12, end, steps):
        assert_matches(lowdiff.recover(run, step=step), *refs[step])


def test_a_run_resumed_at_step_0_on_more_ranks_recovers_what_they_trained(tmp_path: Path) -> None:
    """A run made by one process that took no step, resumed on 2 ranks that load weights after wrap(): their first
    step writes snapshot 0 again as 2 shards, owned by the resume's branch. The 1-file snapshot 0 is moved aside
    (recovery listed it first and then refused it, or before branches replayed the new log on it)."""
    run = tmp_path / "run"
    torchrun(1, str(run), "none", "0", str(tmp_path / "r0.pt"))
    torchrun(2, str(run), "none", "6", str(tmp_path / "r1.pt"), "--resume", "--load-after-wrap")
    refs = torch.load(tmp_path / "r1.pt", weights_only=False)
    assert [s for s, _, _ in refs] == list(range(1, 7))
    assert [s for _, s in read_manifest(run).history] == [-1]
    for step, model_sd, optim_sd in refs[::5]:
        assert_matches(lowdiff.recover(run, step=step), model_sd, optim_sd)
    assert list((run / "quarantine").iterdir())


REFUSED_WORKER = '''
import json, os, sys, time
import torch, torch.distributed as dist
import lowdiff
run_dir, url, out = sys.argv[1:4]
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
t0 = time.monotonic()
try:
    lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model,
                 {"run_dir": run_dir, "compressor": {"name": "topk"}, "remote": {"url": url}})
    said = {"raised": None}
except Exception as e:
    said = {"raised": type(e).__name__, "message": str(e)}
said["s"] = time.monotonic() - t0
with open(f"{out}-{dist.get_rank()}.json", "w") as f:
    json.dump(said, f)
while dist.get_rank() == 0 and not os.path.exists(f"{out}-1.json") and time.monotonic() - t0 < 30:
    time.sleep(0.1)  # a rank 0 that lives on after the error (a program that catches it)
'''


def test_rank_0_failing_to_open_the_run_stops_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 0 alone opens the run directory and meets the remote prefix at wrap(); when that raises (here: a prefix
    another run claimed) and rank 0 lives on (a program that catches the error), the other ranks raise at once,
    saying rank 0 failed, instead of waiting at the barrier until rank 0 exits or the barrier's 300 s timeout."""
    prefix = tmp_path / "bucket"
    prefix.mkdir()
    (prefix / "claim.json").write_text(json.dumps({"run_id": "0123456789abcdef" * 2, "by": "pid 7 on elsewhere"}))
    worker = tmp_path / "refused_worker.py"
    worker.write_text(REFUSED_WORKER)
    torchrun(2, str(tmp_path / "run"), prefix.as_uri(), str(tmp_path / "said"), worker=worker, timeout=120)
    rank0 = json.loads((tmp_path / "said-0.json").read_text())
    rank1 = json.loads((tmp_path / "said-1.json").read_text())
    assert rank0["raised"] == "RemoteStoreError" and "claimed by another run" in rank0["message"], rank0
    assert rank1["raised"] == "LowDiffError" and "rank 0 could not open the run directory" in rank1["message"], rank1
    assert rank1["s"] < 20, rank1  # rank 0 waits up to 30 s for it
