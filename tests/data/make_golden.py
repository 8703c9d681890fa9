"""Writes tests/data/golden-2.0: a run directory in format 2.0 (before the run id), and the states it must recover.

Run once, with the lowdiff of the format version being frozen (here: the commit before format 2.1):
    PYTHONPATH=<checkout of that commit>:tests python tests/data/make_golden.py
The test (tests/hostile/test_golden.py) reads it with the current lowdiff. SGD with momentum: its update is a
multiply and an add per element, so the replay is bit-identical on any x86-64 or ARM CPU, not only the one that
wrote it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from lowdiff_harness import Scenario, train_run

OUT = Path(__file__).resolve().parent / "golden-2.0"
SCENARIO = Scenario(model="mlp_bn", optimizer="sgd", groups=2, compressor="topk", ratio=0.25, batch_steps=3,
                    every_steps=4, codec="zstd", scheduler=True)
STEPS = 6


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    trainer = train_run(SCENARIO, OUT / "run", STEPS)
    (OUT / "run" / "writer.lock").unlink()
    torch.save({k: trainer.refs[k] for k in (4, 5, 6)}, OUT / "expected.pt")


if __name__ == "__main__":
    main()
