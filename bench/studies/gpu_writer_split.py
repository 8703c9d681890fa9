"""Diagnostic (GPU): how much of lowdiff's per-step overhead is the training thread's own work (staging the record)
and how much is the background writer? Three runs per compressor: ``enabled: false``; enabled with a null writer
(records and snapshots staged, then released unwritten); enabled. Per-step times until the training stream finishes
the step.

    python bench/studies/gpu_writer_split.py        # prints one line per run; 48M-param GPT, batch 16 x 256, 120 steps

The null writer is lowdiff's own writer on a disk that takes no bytes: through ``lowdiff.testing.intercept_writes``
every write it commits fails (ENOSPC), and with ``on_write_error: warn`` training goes on while the writer releases
every record it is handed without writing it (lowdiff's documented behaviour after a failed write, until a snapshot
commits; none can here). The writer still waits for each record's copy to complete, as it does when writing, and it
still encodes the first segment (steps 1-10, outside the timed steps) and each snapshot before the write fails, so
the two snapshot steps' neighbours see that work; the medians over 110 steps do not. (An earlier version swapped the
writer's private submit methods, which dropped records before the writer saw them.)

Run on the H100 on 2026-11-22 (docs/measurements/gpu.md); not part of CI (needs CUDA).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench._common

import torch  # noqa: E402

import lowdiff  # noqa: E402
from bench._common import ModelSpec  # noqa: E402
from lowdiff.testing import intercept_writes  # noqa: E402

SPEC = ModelSpec(n_layer=8, d_model=704, n_head=8, batch=16, block=256)


def _no_space(fd: int, buffers: list[Any], offset: int) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextlib.contextmanager
def null_writer() -> Iterator[None]:
    """Every write lowdiff commits fails; lowdiff's error and warning about it are expected, so kept quiet."""
    logger = logging.getLogger("lowdiff")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with intercept_writes(pwritev=_no_space):
            yield
    finally:
        logger.setLevel(level)


def run(comp: str, enabled: bool, batches: list, tmp: str, null: bool = False, n: int = 120,
        every: int = 50) -> float:
    model = SPEC.build().cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    opt = lowdiff.wrap(inner, model, {"run_dir": f"{tmp}/{comp}{enabled}{null}", "enabled": enabled,
                                      "compressor": {"name": comp}, "snapshot": {"every_steps": every},
                                      "log": {"batch_steps": 10}, "on_write_error": "warn" if null else "raise"})
    ts = []
    # Entered after wrap(): the run's step-0 snapshot and manifest are committed for real.
    with null_writer() if null else contextlib.nullcontext():
        for i in range(n):
            x, y = batches[i % len(batches)]
            torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.current_stream().synchronize()
            ts.append(time.perf_counter() - t0)
        opt.close()
    st = opt.stats
    body = ts[10:]
    snaps = [round(ts[i] * 1e3, 1) for i in range(10, n) if (i + 1) % every == 0]
    written = "" if st is None else f", {st.segments} segments and {st.snapshots} snapshots written"
    print(f"{comp} enabled={enabled} null_writer={null}: median {statistics.median(body) * 1e3:.1f} ms, "
          f"max {max(body) * 1e3:.1f} ms, snapshot steps {snaps}{written}", flush=True)
    return statistics.median(body)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = [(x.cuda(), y.cuda()) for x, y in SPEC.batches(4)]
    tmp = tempfile.mkdtemp()
    try:
        for comp in ("topk", "powersgd"):
            run(comp, False, batches, tmp)
            run(comp, True, batches, tmp, null=True)
            run(comp, True, batches, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
