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
