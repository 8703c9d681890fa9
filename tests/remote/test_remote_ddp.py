"""2-rank gloo DDP and FSDP2 (fully_shard) runs mirrored to the bucket (rank 0's persistence side uploads both ranks'
shards), recovered exactly from the bucket alone."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowdiff

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parents[1] / "distributed" / "ddp_worker.py"
FSDP_WORKER = WORKER.with_name("fsdp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("worker", ["ddp", "fsdp"])
def test_run_mirrored_and_recovered_from_the_bucket(tmp_path: Path, s3, worker: str) -> None:
    if worker == "fsdp" and not hasattr(torch.distributed, "fsdp"):
        pytest.skip("this torch has no FSDP2")
    url = f"s3://{s3.new_bucket()}/{worker}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER if worker == "ddp" else FSDP_WORKER), str(tmp_path / "run"),
           "topk", "12", str(tmp_path / "ref.pt"), "--persistence", "process", "--remote", url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    refs = torch.load(tmp_path / "ref.pt", weights_only=False)
    shutil.rmtree(tmp_path / "run")  # the machine is lost
    names = s3.fs().find(url[len("s3://"):])
    assert any(".shard-00001-of-00002" in n for n in names), names  # rank 1's shards went up too
    claim = json.loads(s3.fs().cat(f"{url[len('s3://'):]}/claim.json"))  # rank 0's mirror claimed the prefix
    assert claim["run_id"] == lowdiff.inspect(url).manifest.run_id
    for step, model_sd, optim_sd in refs[-3:]:
        rec = lowdiff.recover(url, step=step)
        assert set(rec.model) == set(model_sd)
        for k, v in model_sd.items():
            assert torch.equal(v, rec.model[k]), k
        for i, st in optim_sd["state"].items():
            for k, v in st.items():
                assert torch.equal(v, rec.optimizer["state"][i][k]), (i, k)
    assert lowdiff.recover(url).step == refs[-1][0]


def _torchrun(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_a_set_missing_a_shard_in_the_bucket_is_stepped_around_and_said(tmp_path: Path, s3) -> None:
    """Rank 1's shards of snapshot 10 and of the newest segment (steps 13-14) are not in the bucket (uploads that
    never happened: deleted here), rank 0's are. Recovery from the bucket alone reaches step 12, the newest step
    every rank's shards hold whole (snapshot 5 and the log after it), naming each missing object by its URL; a
    resume on 2 ranks of a new machine continues from step 12 exactly as the uninterrupted run did."""
    url = f"s3://{s3.new_bucket()}/ddp"
    prefix = url[len("s3://"):]
    _torchrun(str(tmp_path / "a"), "none", "14", str(tmp_path / "a.pt"), "--continuous-rng", "--persistence",
              "process", "--remote", url)
    shutil.rmtree(tmp_path / "a")  # the machine is lost
    gone = ["snapshots/step-0000000010.shard-00001-of-00002.h5",
            "log/steps-0000000013-0000000014.shard-00001-of-00002.h5"]
    fs = s3.fs()
    for name in gone:
        assert fs.exists(f"{prefix}/{name.replace('00001-of', '00000-of')}")
        fs.rm(f"{prefix}/{name}")
    refs = {step: (model_sd, optim_sd) for step, model_sd, optim_sd in torch.load(tmp_path / "a.pt",
                                                                                   weights_only=False)}
    rec = lowdiff.recover(url)
    assert rec.step == 12 and rec.report.snapshot_step == 5
    for name in gone:
        assert [s for s in rec.report.skipped if s.startswith(f"{url}/{name}: missing")], rec.report.skipped
        assert f"skipped: {url}/{name}" in rec.report.summary()
    for k, v in refs[12][0].items():
        assert torch.equal(v, rec.model[k]), k
    for i, st in refs[12][1]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, rec.optimizer["state"][i][k]), (i, k)

    out = _torchrun(str(tmp_path / "b"), "none", "14", str(tmp_path / "b.pt"), "--continuous-rng", "--persistence",
                    "process", "--remote", url, "--resume")
    assert "START 12" in out
    resumed = torch.load(tmp_path / "b.pt", weights_only=False)
    assert [s for s, _, _ in resumed] == [13, 14]
    for step, model_sd, optim_sd in resumed:
        for k, v in refs[step][0].items():
            assert torch.equal(v, model_sd[k]), (step, k)
        for i, st in refs[step][1]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, optim_sd["state"][i][k]), (step, i, k)
    for rank in range(2):
        a = dict(torch.load(f"{tmp_path / 'a.pt'}.rank{rank}.losses"))
        b = dict(torch.load(f"{tmp_path / 'b.pt'}.rank{rank}.losses"))
        assert all(a[s] == b[s] for s in b), rank
    assert lowdiff.recover(url).step == 14
