"""2-rank gloo fully_shard (FSDP2) runs, each launched by torchrun with a timeout: exact recovery in one process at
every step, both ranks killed and resumed, resume on one rank, error-feedback residuals per shard, and the setups
lowdiff refuses. The model (fsdp_worker.py) has uneven shards: 145 rows (73 + 72), 5 rows (3 + 2) and a 1-row
layer whose second shard is empty."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ddp import torchrun as ddp_torchrun

import lowdiff
from lowdiff._storage.format import list_segments, list_snapshots

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("fsdp_worker.py")


def torchrun(nproc: int, *args: str, timeout: float = 180.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    return ddp_torchrun(nproc, *args, timeout=timeout, check=check, worker=WORKER)


def assert_same(step: int, got_model: dict, got_optim: dict, model_sd: dict, optim_sd: dict) -> None:
    assert set(got_model) == set(model_sd)
    for k, v in model_sd.items():
        assert torch.equal(v, got_model[k]), (step, k)
    assert got_optim["param_groups"] == optim_sd["param_groups"], step
    assert set(got_optim["state"]) == set(optim_sd["state"]), step
    for i, st in optim_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got_optim["state"][i][k]), (step, i, k)


def load(path: Path) -> list:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("compressor", ["none", "topk", "powersgd"])
def test_every_step_recovers_exactly_in_one_process(tmp_path: Path, compressor: str) -> None:
    run = tmp_path / "run"
    torchrun(2, str(run), compressor, "8", str(tmp_path / "ref.pt"))
    refs = load(tmp_path / "ref.pt")
    assert [s for s, _, _ in refs] == list(range(1, 9))
    for step, model_sd, optim_sd in refs:
        rec = lowdiff.recover(run, step=step, workers=1 if step % 2 else 2)
        assert_same(step, rec.model, rec.optimizer, model_sd, optim_sd)
    # One rank's shards alone (what opt.resume() on two ranks reads): its rows of every tensor, under stored names.
    mine = lowdiff.recover(run, step=8, shard=(1, 2))
    assert mine.shard == (1, 2)
    assert torch.equal(mine.model["0.weight#1-of-2"], rec.model["0.weight"][73:])
    assert mine.model["5.weight#1-of-2"].shape == (0, 5) and "0.weight#0-of-2" not in mine.model
    assert torch.equal(mine.model["1.running_mean"], rec.model["1.running_mean"])
    assert torch.equal(mine.optimizer["state"][0]["exp_avg"], rec.optimizer["state"][0]["exp_avg"][73:])
    # The unsharded result loads into the plain model; so does what lowdiff-recover writes.
    from fsdp_worker import make_model

    make_model().load_state_dict(rec.model)
    out = tmp_path / "state.pt"
    proc = subprocess.run([sys.executable, "-c", "import sys; from lowdiff._recovery.cli import recover_main; "
                           "sys.exit(recover_main(sys.argv[1:]))", str(run), "--output", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = torch.load(out, weights_only=True)
    assert written["step"] == 8
    assert_same(8, written["model"], written["optimizer"], *refs[-1][1:])
    make_model().load_state_dict(written["model"])
    # Each rank wrote its own shard of every snapshot and segment, of about half the bytes.
    segs = list_segments(run)
    assert segs and all(len(f.paths) == 2 for _, _, f in segs)
    assert all(len(f.paths) == 2 for f in list_snapshots(run).values())
    sizes = [sum(f.paths[i].stat().st_size for _, _, f in segs) for i in range(2)]
    assert max(sizes) < 1.3 * min(sizes)
    sharding = json.loads((run / "manifest.json").read_text())["sharding"]
    assert sharding["dim"] == 0 and len(sharding["layouts"]) == 1
    layout = sharding["layouts"][0]
    assert layout["mesh_size"] == 2
    assert layout["shards"]["0.weight"] == [[0, 73], [73, 72]]
    assert layout["shards"]["5.weight"] == [[0, 1], [1, 0]]  # rank 1's shard is empty
    assert lowdiff.verify(run).problems == []
    # Compaction writes its snapshot in the run's layout, one file per rank; the log after it still replays.
    out = lowdiff.compact(run, step=7, keep=1)
    assert out.wrote_snapshot and list(list_snapshots(run)) == [7] and len(list_snapshots(run)[7].paths) == 2
    for step, model_sd, optim_sd in refs[6:]:
        rec = lowdiff.recover(run, step=step)
        assert rec.report.snapshot_step == 7
        assert_same(step, rec.model, rec.optimizer, model_sd, optim_sd)
    assert lowdiff.verify(run).problems == []


def assert_continues(full: Path, resumed: Path, first: int, last: int) -> None:
    a = {s: (m, o) for s, m, o in load(full)}
    b = load(resumed)
    assert [s for s, _, _ in b] == list(range(first, last + 1))
    for step, model_sd, optim_sd in b:
        assert_same(step, model_sd, optim_sd, *a[step])
    for rank in range(2):
        la, lb = dict(torch.load(f"{full}.rank{rank}.losses")), dict(torch.load(f"{resumed}.rank{rank}.losses"))
        assert all(la[s] == lb[s] for s in lb), rank


def test_both_ranks_killed_then_resumed_on_two_ranks_exactly(tmp_path: Path) -> None:
    """Both ranks exit abruptly at the start of step 8 (no close, no flush); the 2-rank resume continues from the
    latest durable step to the end, equal to the uninterrupted run (state and every rank's losses)."""
    torchrun(2, str(tmp_path / "a"), "none", "11", str(tmp_path / "a.pt"))
    proc = torchrun(2, str(tmp_path / "b"), "none", "11", str(tmp_path / "b1.pt"), "--die-at", "8", check=False)
    assert proc.returncode != 0
    out = torchrun(2, str(tmp_path / "b"), "none", "11", str(tmp_path / "b2.pt"), "--resume")
    start = int(out.stdout.split("START ")[1].split()[0])
    assert 5 <= start <= 7
    assert_continues(tmp_path / "a.pt", tmp_path / "b2.pt", start + 1, 11)


def test_persistence_process_per_rank_keeps_every_returned_step(tmp_path: Path) -> None:
    """log.persistence: process under fully_shard (one persistence process per rank): both trainers exit abruptly
    at the start of step 8, each rank's persistence process commits its shards of steps 1-7, and the 2-rank resume
    starts at 7 and continues exactly. torchrun sends SIGTERM to the process group of a rank it has not reaped yet:
    the persistence process, still importing torch, died of it until it got a session of its own."""
    torchrun(2, str(tmp_path / "a"), "none", "11", str(tmp_path / "a.pt"))
    proc = torchrun(2, str(tmp_path / "b"), "none", "11", str(tmp_path / "b1.pt"), "--die-at", "8",
                    "--persistence", "process", check=False)
    assert proc.returncode != 0
    out = torchrun(2, str(tmp_path / "b"), "none", "11", str(tmp_path / "b2.pt"), "--resume", "--persistence",
                   "process")
    assert "START 7" in out.stdout
    assert_continues(tmp_path / "a.pt", tmp_path / "b2.pt", 8, 11)
    for step in (7, 11):
        assert lowdiff.recover(tmp_path / "b", step=step).step == step


@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_resume_at_snapshot_keeps_each_shards_residual(tmp_path: Path, compressor: str) -> None:
    """Error feedback is per shard: a 2-rank run stopped at snapshot step 10 and resumed on 2 ranks continues bit for
    bit (each rank gets back its own shards' residuals, and PowerSGD's warm-start Q of each shard)."""
    torchrun(2, str(tmp_path / "a"), compressor, "13", str(tmp_path / "a.pt"))
    torchrun(2, str(tmp_path / "b"), compressor, "10", str(tmp_path / "b1.pt"))
    out = torchrun(2, str(tmp_path / "b"), compressor, "13", str(tmp_path / "b2.pt"), "--resume", "--resume-at",
                   "snapshot")
    assert "START 10" in out.stdout
    assert_continues(tmp_path / "a.pt", tmp_path / "b2.pt", 11, 13)
    rec = lowdiff.recover(tmp_path / "b", step=10)
    assert rec.compressor_state_exact and torch.count_nonzero(rec.compressor_state["0.weight"]["residual"]) > 0


def test_resume_on_one_rank(tmp_path: Path) -> None:
    """Trained on 2 ranks to step 8, continued on 1 (fully_shard over one rank): the resume starts from the
    2-rank state, writes a snapshot in the 1-rank layout, and every step of both parts recovers exactly."""
    run = tmp_path / "run"
    torchrun(2, str(run), "none", "8", str(tmp_path / "two.pt"))
    out = torchrun(1, str(run), "none", "12", str(tmp_path / "one.pt"), "--resume")
    assert "START 8" in out.stdout
    for step, model_sd, optim_sd in load(tmp_path / "two.pt") + load(tmp_path / "one.pt"):
        rec = lowdiff.recover(run, step=step)
        assert_same(step, rec.model, rec.optimizer, model_sd, optim_sd)
    snaps = list_snapshots(run)
    assert len(snaps[5].paths) == 2 and len(snaps[8].paths) == 1 and len(snaps[10].paths) == 1
    assert {len(f.paths) for _, _, f in list_segments(run)} == {1, 2}
    assert lowdiff.verify(run).problems == []
    # Without the snapshots of the one-rank layout, no chain reaches step 12 in one layout: refused, never
    # replayed across the change.
    for step in (8, 10):
        snaps[step].paths[0].unlink()
    with pytest.raises(lowdiff.StepNotAvailableError, match="layout"):
        lowdiff.recover(run, step=12)


def test_resume_in_one_process_without_fully_shard(tmp_path: Path) -> None:
    """A fully_shard run continued by the plain model in one process: the resume rewrites the resumed step with
    whole tensors, and every step of both parts recovers exactly."""
    run = tmp_path / "run"
    torchrun(2, str(run), "topk", "6", str(tmp_path / "two.pt"))
    assert "START 6" in torchrun(1, str(run), "topk", "9", str(tmp_path / "one.pt"), "--resume", "--plain").stdout
    for step, model_sd, optim_sd in load(tmp_path / "two.pt") + load(tmp_path / "one.pt"):
        rec = lowdiff.recover(run, step=step)
        assert_same(step, rec.model, rec.optimizer, model_sd, optim_sd)
    assert len(list_snapshots(run)[6].paths) == 1


def test_resume_on_four_ranks_then_two(tmp_path: Path) -> None:
    """2 ranks to step 5 (a snapshot step), 4 ranks to 9, 2 again to 12 (Top-k): each resume starts from the
    state the other layout left, rewrites the resumed step in its own layout (moving the other layout's snapshot of
    that step to quarantine/), and every step recovers exactly."""
    run = tmp_path / "run"
    torchrun(2, str(run), "topk", "5", str(tmp_path / "a.pt"))
    assert "START 5" in torchrun(4, str(run), "topk", "9", str(tmp_path / "b.pt"), "--resume", timeout=300).stdout
    assert "START 9" in torchrun(2, str(run), "topk", "12", str(tmp_path / "c.pt"), "--resume").stdout
    layouts = json.loads((run / "manifest.json").read_text())["sharding"]["layouts"]
    assert [lay["mesh_size"] for lay in layouts] == [2, 4]
    assert layouts[1]["shards"]["0.weight"] == [[0, 37], [37, 37], [74, 37], [111, 34]]
    assert layouts[1]["shards"]["3.weight"] == [[0, 2], [2, 2], [4, 1], [5, 0]]
    for step, model_sd, optim_sd in load(tmp_path / "a.pt") + load(tmp_path / "b.pt") + load(tmp_path / "c.pt"):
        rec = lowdiff.recover(run, step=step)
        assert_same(step, rec.model, rec.optimizer, model_sd, optim_sd)
    assert len(list_snapshots(run)[5].paths) == 4
    assert len(list((run / "quarantine").iterdir())) == 2


def test_weights_tied_inside_one_unit(tmp_path: Path) -> None:
    """tinygpt's embedding and head are one parameter inside the root unit: sharded once, logged once, and both
    state_dict keys come back."""
    torchrun(2, str(tmp_path / "run"), "topk", "4", str(tmp_path / "ref.pt"), "--gpt")
    for step, model_sd, optim_sd in load(tmp_path / "ref.pt"):
        rec = lowdiff.recover(tmp_path / "run", step=step)
        assert_same(step, rec.model, rec.optimizer, model_sd, optim_sd)
    assert rec.model["head.weight"] is rec.model["tok_emb.weight"]
    names = [p["name"] for p in json.loads((tmp_path / "run" / "manifest.json").read_text())["params"]]
    assert "tok_emb.weight" in names and "head.weight" not in names


def test_mixed_precision_with_fp32_reduction(tmp_path: Path) -> None:
    torchrun(2, str(tmp_path / "run"), "none", "4", str(tmp_path / "ref.pt"), "--mp")
    for step, model_sd, optim_sd in load(tmp_path / "ref.pt"):
        rec = lowdiff.recover(tmp_path / "run", step=step)
        assert_same(step, rec.model, rec.optimizer, model_sd, optim_sd)


def test_ddp_and_fully_shard_do_not_resume_each_others_runs(tmp_path: Path) -> None:
    """The same loop under DDP (--ddp) and under fully_shard: each run directory is refused by the other on two
    ranks, with an error that says what to do."""
    torchrun(2, str(tmp_path / "ddp"), "none", "3", str(tmp_path / "ddp.pt"), "--ddp")
    proc = torchrun(2, str(tmp_path / "ddp"), "none", "5", str(tmp_path / "x.pt"), "--resume", check=False)
    assert proc.returncode != 0 and "this run was trained under DDP on several ranks" in proc.stdout + proc.stderr
    torchrun(2, str(tmp_path / "fsdp"), "none", "3", str(tmp_path / "fsdp.pt"))
    proc = torchrun(2, str(tmp_path / "fsdp"), "none", "5", str(tmp_path / "y.pt"), "--resume", "--ddp", check=False)
    assert proc.returncode != 0 and "this run was trained with fully_shard" in proc.stdout + proc.stderr
    # Each run recovers in one process as the same model.
    assert set(lowdiff.recover(tmp_path / "ddp").model) == set(lowdiff.recover(tmp_path / "fsdp").model)


def test_unsupported_setups_are_refused_at_wrap(tmp_path: Path) -> None:
    out = torchrun(2, str(tmp_path / "run"), "none", "1", str(tmp_path / "ref.pt"),
                   "--refuse", "hsdp,placement,plain,optimizer").stdout
    assert "ACCEPTED" not in out
    assert "REFUSED hsdp UnsupportedError: parameter '0.weight' is on a 2-D device mesh (HSDP" in out
    assert "REFUSED placement UnsupportedError: parameter '0.weight' has placements (Shard(dim=1),)" in out
    assert "REFUSED plain UnsupportedError: parameter '1.weight' is not sharded by fully_shard" in out
    assert "REFUSED optimizer UnsupportedError: torch.optim.Adafactor under fully_shard" in out
