"""Exact resume: RNG state and data position (issue 9).

A run with dropout, torch / numpy / python randomness in the training loop and a shuffled DataLoader is
killed mid-epoch (a real SIGKILL, in a child process), resumed with fresh objects from a fresh RNG state, and
finished: the batches, per-step losses, parameters and optimizer state equal the uninterrupted run's
(``torch.equal`` / ``==``). Compressor none resumes wherever the log ends; Top-k and PowerSGD resume at a
snapshot step (between snapshots their error-feedback residuals restart at zero, docs/reference/FORMAT.md).

The file is also the child process: ``python test_resume_exact.py RESULT.pt RUN_DIR COMPRESSOR ...``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import lowdiff
from lowdiff import rng as lowdiff_rng
from lowdiff.data import DistributedResumableSampler, ResumableLoader, ResumableSampler

N_SAMPLES = 90
BATCH = 8  # 12 batches per epoch, the last one of 2 samples
TOTAL_STEPS = 30  # epochs 0, 1 and half of 2
SEED = 0
HERE = Path(__file__).resolve()


# --- the training run (shared by the test process and the child) ----------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 24)
        self.bn = nn.BatchNorm1d(24)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(N_SAMPLES, 6, generator=g), torch.randint(0, 3, (N_SAMPLES,), generator=g),
                         torch.arange(N_SAMPLES))


def config(run_dir: Path, compressor: str, enabled: bool = True) -> dict[str, Any]:
    return {"run_dir": str(run_dir), "enabled": enabled,
            "compressor": {"name": compressor, "ratio": 0.25, "rank": 2},
            "snapshot": {"every_steps": 5}, "log": {"batch_steps": 5, "codec": "lz4"}}


def train(run_dir: Path, compressor: str, *, steps: int = TOTAL_STEPS, num_workers: int = 0, enabled: bool = True,
          flush_at: int | None = None, kill_at: int | None = None) -> dict[str, Any]:
    """Train (or resume and finish) to ``steps``. Starts as a fresh process would: every global RNG seeded,
    fresh model, optimizer and loader. ``kill_at``: SIGKILL this process right after that step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float reduction order in every process
    try:
        torch.manual_seed(SEED)
        np.random.seed(SEED)
        random.seed(SEED)
        model = Net()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        opt = lowdiff.wrap(inner, model, config(run_dir, compressor, enabled))
        sampler = ResumableSampler(N_SAMPLES, seed=7)
        loader = opt.track(ResumableLoader(DataLoader(dataset(), batch_size=BATCH, sampler=sampler,
                                                      num_workers=num_workers)))
        start = step = opt.resume()
        losses: dict[int, float] = {}
        batches: dict[int, list[int]] = {}
        while step < steps:
            for x, y, idx in loader:
                # Randomness from every source the run directory records: numpy, python, torch (and dropout).
                x = x * float(np.random.uniform(0.5, 1.5)) + 0.05 * torch.randn_like(x)
                if random.random() < 0.5:
                    x = -x
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                losses[step], batches[step] = loss.item(), idx.tolist()
                if step == flush_at:
                    opt.flush()
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == steps:
                    break
        opt.close()
        return {"start": start, "losses": losses, "batches": batches, "model": model.state_dict(),
                "optimizer": inner.state_dict(), "position": loader.state_dict()}
    finally:
        torch.set_num_threads(threads)


def run_child(tmp_path: Path, run_dir: Path, compressor: str, **kwargs: Any) -> dict[str, Any]:
    """``train`` in a fresh Python interpreter (nothing inherited from this process); its result."""
    out = tmp_path / "child.pt"
    cmd = [sys.executable, str(HERE), str(out), str(run_dir), compressor, json.dumps(kwargs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(HERE.parents[2])})
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return torch.load(out, weights_only=True)


def crash_child(run_dir: Path, compressor: str, *, kill_at: int, **kwargs: Any) -> None:
    """``train`` in a forked process that SIGKILLs itself right after step ``kill_at`` (no close, no flush
    beyond ``flush_at``); returns once the run directory's writer lock is free again."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            train(run_dir, compressor, kill_at=kill_at, **kwargs)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child ended with status {status}"
    wait_for_lock(run_dir)


def wait_for_lock(run_dir: Path, timeout_s: float = 60.0) -> None:
    # DataLoader workers forked by the killed trainer inherit its flock'ed lock file descriptor; they exit
    # within seconds of noticing their parent is gone (torch's worker watchdog), and the lock with them.
    deadline = time.monotonic() + timeout_s
    fd = os.open(run_dir / "writer.lock", os.O_RDWR)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed trainer's lock was never released"
                time.sleep(0.1)
    finally:
        os.close(fd)


def assert_same_run(ref: dict[str, Any], got: dict[str, Any]) -> None:
    start = got["start"]
    for step in range(start + 1, TOTAL_STEPS + 1):
        assert got["batches"][step] == ref["batches"][step], f"step {step}: another batch"
        assert got["losses"][step] == ref["losses"][step], f"step {step}: loss {got['losses'][step]} != " \
                                                           f"{ref['losses'][step]}"
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    assert ref["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]
    for i, st in ref["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["optimizer"]["state"][i][k]), (i, k)
    assert got["position"] == ref["position"]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The uninterrupted run (lowdiff wrapped with enabled: false: the same compute, nothing written)."""
    return {c: train(Path("unused"), c, enabled=False) for c in ("none", "topk", "powersgd")}


# --- kill mid-epoch, resume, finish ----------------------------------------------------------------------------


def test_sigkill_mid_epoch_then_resume_in_fresh_process_is_exact(tmp_path: Path, reference: dict) -> None:
    """Compressor none: killed after step 17 (epoch 1, batch 6 of 12) with the log durable to >= 14; the
    resumed run (a fresh process) continues from wherever the log ends."""
    run = tmp_path / "run"
    crash_child(run, "none", flush_at=14, kill_at=17)
    got = run_child(tmp_path, run, "none")
    assert 14 <= got["start"] <= 17
    assert_same_run(reference["none"], got)


def test_prefetching_workers_count_consumed_batches(tmp_path: Path, reference: dict) -> None:
    """num_workers=2 prefetches 4 batches ahead of the loop; the logged position counts consumed ones."""
    run = tmp_path / "run"
    crash_child(run, "none", num_workers=2, flush_at=16, kill_at=16)
    got = train(run, "none", num_workers=2)
    assert got["start"] == 16
    assert_same_run(reference["none"], got)


@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_compressed_resume_at_snapshot_step_is_exact(tmp_path: Path, reference: dict, compressor: str) -> None:
    """Killed right after snapshot step 15 (epoch 1, batch 3) was committed: residuals restore exactly too."""
    run = tmp_path / "run"
    crash_child(run, compressor, flush_at=15, kill_at=15)
    got = train(run, compressor)
    assert got["start"] == 15
    assert_same_run(reference[compressor], got)


def test_two_interruptions_resume_between_snapshots(tmp_path: Path, reference: dict) -> None:
    """A second interruption of the same run, at a step that is no snapshot and ends no segment (23)."""
    run = tmp_path / "run"
    crash_child(run, "none", flush_at=9, kill_at=9)
    crash_child(run, "none", flush_at=23, kill_at=23)
    rec = lowdiff.recover(run)
    assert rec.step == 23 and rec.data["data"] == {"epoch": 1, "seed": 7, "offset": 88}
    assert set(rec.rng) == {"torch", "numpy", "python"}
    got = train(run, "none")
    assert got["start"] == 23
    assert_same_run(reference["none"], got)


# --- the samplers and the loader -------------------------------------------------------------------------------


@pytest.mark.parametrize("n,replicas,shuffle,drop_last", [
    (10, 3, True, False), (10, 3, True, True), (9, 3, False, False), (2, 4, True, False), (17, 2, True, True),
])
def test_distributed_sampler_matches_torch(n: int, replicas: int, shuffle: bool, drop_last: bool) -> None:
    for epoch in (0, 3):
        for rank in range(replicas):
            theirs = DistributedSampler(range(n), replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            ours = DistributedResumableSampler(n, replicas, rank, seed=5, shuffle=shuffle, drop_last=drop_last)
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("replicas", [1, 3])
def test_sampler_resumes_mid_epoch(replicas: int) -> None:
    def make() -> DistributedResumableSampler | ResumableSampler:
        if replicas == 1:
            return ResumableSampler(23, seed=3)
        return DistributedResumableSampler(23, replicas, 1, seed=3)

    full = make()
    full.set_epoch(2)
    expected = list(full)
    assert full.state_dict() == {"epoch": 3, "seed": 3, "offset": 0}  # the epoch advanced at its end
    s = make()
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(5)]
    state = s.state_dict()
    assert state == {"epoch": 2, "seed": 3, "offset": 5 * replicas}
    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(state)))
    fresh.set_epoch(2)  # the current epoch: keeps its position
    assert head + list(fresh) == expected


def test_distributed_resume_at_another_world_size_sees_every_sample() -> None:
    n = 20
    old = [DistributedResumableSampler(n, 2, r, seed=1) for r in range(2)]
    seen = []
    for s in old:
        it = iter(s)
        seen += [next(it) for _ in range(3)]
    assert old[0].state_dict() == old[1].state_dict() == {"epoch": 0, "seed": 1, "offset": 6}
    new = [DistributedResumableSampler(n, 3, r, seed=1) for r in range(3)]
    rest = []
    for s in new:
        s.load_state_dict(old[0].state_dict())
        rest.append(list(s))
    assert len({len(r) for r in rest}) == 1  # equal lengths: no rank waits for another
    assert set(seen) | {i for r in rest for i in r} == set(range(n))


class CountingDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return i


def test_loader_counts_consumed_batches_not_prefetched_ones() -> None:
    loader = ResumableLoader(DataLoader(range(50), batch_size=4, sampler=ResumableSampler(50, seed=2),
                                        num_workers=2, prefetch_factor=3))
    it = iter(loader)
    first = [next(it).tolist() for _ in range(3)]
    assert loader.sampler.offset > 12  # the workers ran ahead ...
    assert loader.state_dict() == {"epoch": 0, "seed": 2, "offset": 12}  # ... the position did not
    del it
    ds = CountingDataset(50)
    resumed = ResumableLoader(DataLoader(ds, batch_size=4, sampler=ResumableSampler(50, seed=99)))
    resumed.load_state_dict(loader.state_dict())
    rest = [b.tolist() for b in resumed]
    assert ds.reads == 50 - 12  # skipped samples are never read
    whole = [b.tolist() for b in ResumableLoader(DataLoader(range(50), batch_size=4,
                                                            sampler=ResumableSampler(50, seed=2)))]
    assert first + rest == whole
    assert resumed.state_dict() == {"epoch": 1, "seed": 2, "offset": 0}
    assert len(rest) == math.ceil(38 / 4)


@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_consumed_to_its_last_batch_resumes_in_the_next_one(drop_last: bool) -> None:
    """The position taken at an epoch's last step (inside opt.step(), before the loop asks for another batch)
    resumes at the start of the next epoch, so a loop ``for epoch in range(loader.epoch, E)`` does not run the
    finished epoch's end (a per-epoch scheduler step) again. With ``drop_last`` the last batch ends the epoch two
    samples short of the sampler's length: it counted as unfinished."""
    def make() -> ResumableLoader:
        return ResumableLoader(DataLoader(range(50), batch_size=8, sampler=ResumableSampler(50, seed=5),
                                          drop_last=drop_last))

    loader, seen = make(), []
    for n, batch in enumerate(loader, 1):
        seen.append(batch.tolist())
        if n == len(loader):
            state = loader.state_dict()  # what opt.step() of the epoch's last iteration logs
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    whole = make()
    epochs = [[b.tolist() for b in whole] for _ in range(2)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == epochs[1]
    # A consumer that takes len(loader) batches and never asks past them (Lightning) gets every epoch whole.
    counts, loader = [], make()
    for _ in range(4):
        it = iter(loader)
        counts.append(sum(1 for _ in zip(range(len(loader)), it)))
    assert counts == [len(loader)] * 4


def test_a_bare_sampler_at_the_end_of_an_epoch_resumes_in_the_next_one() -> None:
    """A sampler's position at its epoch's last index (a DataLoader without workers has not asked past it yet):
    loaded, it is the next epoch's start, so ``sampler.epoch`` names the epoch to run."""
    sampler = ResumableSampler(48, seed=3)
    batches = list(DataLoader(range(48), batch_size=8, sampler=sampler))
    assert len(batches) == 6
    fresh = ResumableSampler(48, seed=3)
    fresh.load_state_dict({"epoch": 0, "seed": 3, "offset": 48})
    assert (fresh.epoch, fresh.offset) == (1, 0)
    nxt = ResumableSampler(48, seed=3)
    nxt.set_epoch(1)
    assert list(fresh) == list(nxt)


def test_loader_iteration_leaves_global_rng_alone() -> None:
    loader = ResumableLoader(DataLoader(range(10), batch_size=4, sampler=ResumableSampler(10)))
    before = torch.get_rng_state()
    for _ in loader:
        pass
    assert torch.equal(before, torch.get_rng_state())


# --- RNG capture and restore -----------------------------------------------------------------------------------


def draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.standard_normal(3).tolist(), [random.gauss(0, 1) for _ in range(3)]


@pytest.mark.parametrize("rank", [None, 1])
def test_rng_capture_restore_round_trip(rank: int | None) -> None:
    np.random.standard_normal()  # leave a cached gaussian in numpy's state and python's
    random.gauss(0, 1)
    state = lowdiff_rng.capture(rank)
    prefix = "" if rank is None else "rank00001/"
    assert {k: (v.dtype, v.numel()) for k, v in state.items()} == {
        prefix + "torch": (torch.uint8, 5056), prefix + "numpy": (torch.uint8, lowdiff_rng.NUMPY_NBYTES),
        prefix + "python": (torch.uint8, lowdiff_rng.PYTHON_NBYTES)}
    expected = draws()
    draws()
    other = lowdiff_rng.capture(0)  # another rank's entries are not this rank's
    assert lowdiff_rng.restore({**state, **other}, rank) == ["numpy", "python", "torch"]
    assert draws() == expected


# --- the child process -------------------------------------------------------------------------------------------

if __name__ == "__main__":
    out, run_dir, compressor, kwargs = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    result = train(run_dir, compressor, **kwargs)
    torch.save(result, out)
