"""Layer-wise gradient capture (log.capture) and device staging: the log holds exactly the stepped gradient.

The hooks copy each gradient as backward finishes it; anything that changes it afterwards (clipping, another
micro-batch) must make step() copy it again. Recovery at every step must equal the live run bit for bit, on
the CPU and, where one is present, on a GPU (recovered on the same device type).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lowdiff_harness import Scenario, assert_state_equal, start, to_cpu, train_run

import lowdiff

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _recover_every_step(run_dir: Path, refs: dict, steps: int, device: str) -> None:
    for k in range(steps + 1):
        rec = lowdiff.recover(run_dir, step=k, device=device)
        assert rec.step == k
        rec.model = {n: v.cpu() for n, v in rec.model.items()}
        rec.optimizer = to_cpu(rec.optimizer)
        assert_state_equal(*refs[k], rec)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capture", ["layerwise", "step"])
def test_capture_plain_backward_is_exact(tmp_path: Path, device: str, capture: str) -> None:
    s = Scenario(model="mlp_bn", optimizer="adamw", compressor="none", capture=capture, device=device,
                 batch_steps=2, every_steps=4)
    t = train_run(s, tmp_path / "run", 9, close=False)
    lw = t.opt.stats.layerwise
    if capture == "layerwise":
        assert lw is not None
        n_grads = sum(1 for p in t.model.parameters() if p.requires_grad)
        assert lw.misses == 0 and lw.hits == 9 * n_grads  # every gradient came from its hook
    else:
        assert lw is None
    t.opt.close()
    _recover_every_step(tmp_path / "run", t.refs, 9, device)


def test_partial_bucket_is_left_to_step(tmp_path: Path) -> None:
    s = Scenario(model="mlp_bn", optimizer="adamw", compressor="none", capture="layerwise", batch_steps=2,
                 every_steps=4, capture_bucket_bytes=1 << 20)  # mlp_bn's gradients never fill a bucket
    t = train_run(s, tmp_path / "run", 6, close=False)
    lw = t.opt.stats.layerwise
    assert lw is not None and lw.active and lw.hits == 0 and lw.misses == 0
    t.opt.close()
    _recover_every_step(tmp_path / "run", t.refs, 6, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_capture_with_clipping_recopies_changed_gradients(tmp_path: Path, device: str) -> None:
    s = Scenario(model="mlp_bn", optimizer="adam", compressor="none", capture="layerwise", clip=True,
                 device=device, batch_steps=3, every_steps=5)
    t = train_run(s, tmp_path / "run", 8, close=False)
    lw = t.opt.stats.layerwise
    assert lw is not None and lw.misses > 0  # clipping rescaled gradients after their hooks ran
    assert not lw.active  # ... every step, so the hooks were removed as useless
    t.opt.close()
    _recover_every_step(tmp_path / "run", t.refs, 8, device)


@pytest.mark.parametrize("device", DEVICES)
def test_capture_with_gradient_accumulation_logs_the_stepped_gradient(tmp_path: Path, device: str) -> None:
    s = Scenario(model="tied", optimizer="sgd", compressor="none", capture="layerwise", accumulate=3,
                 device=device, batch_steps=2, every_steps=3)
    t = train_run(s, tmp_path / "run", 7, close=False)
    lw = t.opt.stats.layerwise
    assert lw is not None and lw.hits > 0  # the last micro-batch's hook saw the final gradient
    t.opt.close()
    _recover_every_step(tmp_path / "run", t.refs, 7, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compressor", ["topk", "powersgd", "none"])
def test_gpu_training_recovers_exactly_on_the_gpu(tmp_path: Path, compressor: str) -> None:
    s = Scenario(model="mlp_bn", optimizer="adamw", compressor=compressor, device="cuda", clip=True,
                 batch_steps=2, every_steps=4)
    t = train_run(s, tmp_path / "run", 9)
    _recover_every_step(tmp_path / "run", t.refs, 9, "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_resume_continues_exactly(tmp_path: Path, device: str) -> None:
    # No scheduler: it is the user's state, and a resumed run would restart it.
    s = Scenario(model="branch", optimizer="adam", compressor="topk", device=device, batch_steps=2, every_steps=5,
                 scheduler=False)
    full = train_run(s, tmp_path / "full", 8)
    train_run(s, tmp_path / "part", 5)
    t = start(s, tmp_path / "part")
    assert t.opt.step_count == 5
    t.train(6, 8)
    t.opt.close()
    for k in (6, 7, 8):
        assert_state_equal(*full.refs[k], _Rec(*t.refs[k]))


class _Rec:
    def __init__(self, model: dict, optimizer: dict) -> None:
        self.model, self.optimizer = model, optimizer
