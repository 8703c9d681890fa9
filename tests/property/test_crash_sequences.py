"""Hypothesis: random sequences of steps, flushes, crashes and damage.

A "crash" copies the run directory while training goes on (what a kill -9 at that instant would leave on
disk, in-flight ``*.tmp`` files included). Recovering the copy must give exactly the uninterrupted state of
the step it reports, and at least the step that was durable before the copy began; with a damaged byte in
a random file, recovery is either exact for the step it reports or raises CorruptFileError, never wrong.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowdiff

OPS = st.lists(st.sampled_from(["step", "step", "step", "flush", "crash", "crash_damaged"]), min_size=4,
               max_size=24)


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy what is on disk now; files renamed or removed while copying are skipped (as a crash would)."""
    for root, _dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                shutil.copy2(Path(root) / name, dst / rel / name)
            except FileNotFoundError:
                pass


def _flip_random_byte(run: Path, seed: int) -> Path | None:
    files = sorted(p for p in run.rglob("*.h5")) + [run / "manifest.json"]
    target = files[seed % len(files)]
    data = bytearray(target.read_bytes())
    if not data:
        return None
    data[(seed * 7919) % len(data)] ^= 1 << (seed % 8)
    target.write_bytes(bytes(data))
    return target


@settings(max_examples=100 if os.environ.get("LOWDIFF_SLOW") == "1" else 12, deadline=None)
@given(ops=OPS, batch=st.integers(1, 4), every=st.integers(2, 7), compressor=st.sampled_from(["topk", "none"]),
       seed=st.integers(0, 10_000))
def test_random_steps_flushes_crashes_and_damage(ops: list[str], batch: int, every: int, compressor: str,
                                                 seed: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.Linear(12, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        opt = lowdiff.wrap(inner, model, {"run_dir": str(run), "compressor": {"name": compressor, "ratio": 0.3},
                                          "snapshot": {"every_steps": every}, "log": {"batch_steps": batch}})
        refs = {0: (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()))}
        crashes: list[tuple[Path, int, bool]] = []
        step = 0
        for i, op in enumerate(ops):
            if op == "step":
                step += 1
                g = torch.Generator().manual_seed(step)
                loss = model(torch.randn(8, 6, generator=g)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                refs[step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()))
            elif op == "flush":
                assert opt.flush() == step
            else:
                durable = opt.durable_step
                dst = Path(tmp) / f"crash-{i}"
                _copy_tree(run, dst)
                crashes.append((dst, durable, op == "crash_damaged"))
        opt.close()
        for k, (dst, durable, damaged) in enumerate(crashes):
            if damaged:
                _flip_random_byte(dst, seed + k)
            try:
                rec = lowdiff.recover(dst)
            except lowdiff.CorruptFileError:
                assert damaged, "an undamaged crash copy must recover"
                continue
            if not damaged:
                assert rec.step >= durable
            model_sd, optim_sd = refs[rec.step]
            for key, v in model_sd.items():
                assert torch.equal(v, rec.model[key]), (rec.step, key)
            for idx, s in optim_sd["state"].items():
                for key, v in s.items():
                    assert torch.equal(v, rec.optimizer["state"][idx][key]), (rec.step, idx, key)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
