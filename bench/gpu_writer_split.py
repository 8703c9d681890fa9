"""Diagnostic (GPU): how much of lowdiff's per-step overhead is the training thread's own work (staging the record)
and how much is the background writer? Three runs per compressor: ``enabled: false``; enabled with a null writer
(records and snapshots staged, then dropped); enabled. Per-step times until the training stream finishes the step.

    python bench/gpu_writer_split.py        # prints one line per run; 48M-param GPT, batch 16 x 256, 120 steps

Run on the H100 on 2026-11-22 (docs/measurements/gpu.md); not part of CI (needs CUDA).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import lowdiff  # noqa: E402
from bench._common import ModelSpec  # noqa: E402

SPEC = ModelSpec(n_layer=8, d_model=704, n_head=8, batch=16, block=256)


def run(comp: str, enabled: bool, batches: list, tmp: str, null_writer: bool = False, n: int = 120,
        every: int = 50) -> float:
    model = SPEC.build().cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    opt = lowdiff.wrap(inner, model, {"run_dir": f"{tmp}/{comp}{enabled}{null_writer}", "enabled": enabled,
                                      "compressor": {"name": comp}, "snapshot": {"every_steps": every},
                                      "log": {"batch_steps": 10}})
    if null_writer:
        w = opt._checkpointer._writer  # bench-only: drop what the writer is handed
        w.submit_record = lambda r: None
        w.submit_snapshot = lambda s: None
    ts = []
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
    body = ts[10:]
    snaps = [round(ts[i] * 1e3, 1) for i in range(10, n) if (i + 1) % every == 0]
    print(f"{comp} enabled={enabled} null_writer={null_writer}: median {statistics.median(body) * 1e3:.1f} ms, "
          f"max {max(body) * 1e3:.1f} ms, snapshot steps {snaps}", flush=True)
    return statistics.median(body)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = [(x.cuda(), y.cuda()) for x, y in SPEC.batches(4)]
    tmp = tempfile.mkdtemp()
    try:
        for comp in ("topk", "powersgd"):
            run(comp, False, batches, tmp)
            run(comp, True, batches, tmp, null_writer=True)
            run(comp, True, batches, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
