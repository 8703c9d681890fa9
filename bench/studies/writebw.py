"""Segment write bandwidth and where the writer's time goes, for log segments of the real model's gradients.

For each segment kind (Top-k 1 % x 10 steps, ~8.7 MB; full gradient x 1 step, compressor none, ~43 MB), interleaved
repetitions of:

- ``lowdiff``: ``write_segment`` with codec none (HDF5 container, CRC-32, pwritev, fsync, rename, directory fsync);
- ``raw``: ``os.write`` + ``fsync`` of the committed file's bytes (as bench/overhead.py's bandwidth section);
- ``raw+commit``: the same plus the rename and directory fsync the format's atomic commit rule requires (the floor
  for any conforming writer).

Medians; ``lowdiff / raw`` is raw time over lowdiff time. A second pass, timestamped through lowdiff's write seam
(``lowdiff.testing.intercept_writes``), splits lowdiff's time into phases (CRC of the entries, timed apart over the
same bytes; the pwritev calls; the metadata CRC of the trailer; fsync of the file; rename + directory fsync; and the
rest: Python per-entry work, JSON index, HDF5 metadata) and reports the writer thread's CPU time.

    python bench/studies/writebw.py [--reps 9] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common.py
import torch  # noqa: E402
from _common import (  # noqa: E402
    FULL_MODEL,
    ROOT,
    SMOKE_MODEL,
    machine_info,
    mb,
    median,
    raw_write_fsync,
    write_json,
)

from lowdiff._compressors import make_compressor  # noqa: E402
from lowdiff._storage import atomic  # noqa: E402
from lowdiff._storage.segment import StepRecord, write_segment  # noqa: E402
from lowdiff._storage.trailer import crc32  # noqa: E402
from lowdiff.testing import intercept_writes, real_pwritev  # noqa: E402


def gradients(spec: Any) -> dict[str, torch.Tensor]:
    model = spec.build()
    x, y = spec.batches(1)[0]
    _, loss = model(x, y)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def records(grads: dict[str, torch.Tensor], compressor: str, steps: int) -> list[StepRecord]:
    comp = make_compressor(compressor, ratio=0.01, rank=4, error_feedback=False)
    out = []
    for s in range(1, steps + 1):
        payload = {n: {f: t.detach().clone() for f, t in comp.compress(n, g * (1 + s / 100)).items()}
                   for n, g in grads.items()}
        out.append(StepRecord(step=s, groups=[{"lr": 3e-4}], grads=payload))
    return out


def raw_write(path: Path, data: bytes, commit: bool) -> None:
    tmp = path.with_name(path.name + ".tmp") if commit else path
    raw_write_fsync(tmp, data)
    if commit:
        os.replace(tmp, path)
        atomic.fsync_dir(path.parent)


class Phases:
    """Splits one ``write_segment`` call into phases by the timestamps lowdiff's write seam gives
    (``lowdiff.testing.intercept_writes``: every gathered write and the start of every atomic commit), in the order
    ``write_container`` works: entries (CRC-32 with codec none), JSON index and HDF5 structure; ``pwritev`` of the
    data; the trailer (a CRC-32 of the HDF5 metadata); ``pwritev`` of the trailer; fsync of the file; the commit
    (rename, directory fsync). The CRC-32 of the entries runs before the first write, among Python work, so it is
    timed apart: the same CRC-32 function over the same bytes (:func:`entry_crc_s`)."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, float]] = []
        self.commit_at = 0.0
        self.t0 = self.t1 = 0.0
        self._seam = intercept_writes(pwritev=self._pwritev, before_commit=self._before_commit)

    def _pwritev(self, fd: int, buffers: list[Any], offset: int) -> int:
        t0 = time.perf_counter()
        n = real_pwritev(fd, buffers, offset)
        self.writes.append((t0, time.perf_counter()))
        return n

    def _before_commit(self, path: Path) -> None:
        self.commit_at = time.perf_counter()

    def __enter__(self) -> Phases:
        self._seam.__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.t1 = time.perf_counter()
        self._seam.__exit__(*exc)

    def split(self, crc_s: float) -> dict[str, float]:
        """Seconds per phase (``crc_s``: the entries' CRC-32, timed apart); "rest" is what none of them covers."""
        *data, trailer = self.writes  # the trailer is written last, after the data
        out = {"crc32": crc_s, "pwritev": sum(end - start for start, end in self.writes),
               "trailer metadata crc": trailer[0] - data[-1][1] if data else 0.0,
               "fsync (file)": self.commit_at - trailer[1], "rename + dir fsync": self.t1 - self.commit_at,
               "total": self.t1 - self.t0}
        out["rest (python, json, hdf5)"] = out["total"] - sum(v for k, v in out.items() if k != "total")
        return out


def entry_crc_s(recs: list[StepRecord]) -> float:
    """The CRC-32 ``write_segment`` computes over the payload of ``recs`` with codec none, timed apart: one call per
    column of concatenated pieces (as the container does with small pieces), with lowdiff's CRC-32 function."""
    columns: dict[tuple[str, str], list[torch.Tensor]] = {}
    for r in recs:
        for pname, payload in r.grads.items():
            for fname, t in payload.items():
                columns.setdefault((pname, fname), []).append(t.reshape(-1))
    views = [memoryview(torch.cat(ts).view(torch.uint8).numpy()) for ts in columns.values()]
    t0 = time.perf_counter()
    for v in views:
        crc32(v)
    return time.perf_counter() - t0


def measure(recs: list[StepRecord], work: Path, reps: int) -> dict[str, Any]:
    log_dir = work / "log"
    log_dir.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[float]] = {"lowdiff": [], "raw": [], "raw+commit": [], "lowdiff_cpu": []}
    size = 0

    def lowdiff_once() -> tuple[float, float, bytes]:
        t0, c0 = time.perf_counter(), time.thread_time()
        write_segment(work, recs, "none", "topk")
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        seg = next(log_dir.iterdir())
        data = seg.read_bytes()
        seg.unlink()
        return wall, cpu, data

    lowdiff_once()  # warm-up
    for _ in range(reps):
        wall, cpu, data = lowdiff_once()
        size = len(data)
        samples["lowdiff"].append(wall)
        samples["lowdiff_cpu"].append(cpu)
        for name, commit in (("raw", False), ("raw+commit", True)):
            target = work / "raw.bin"
            t0 = time.perf_counter()
            raw_write(target, data, commit)
            samples[name].append(time.perf_counter() - t0)
            target.unlink()
        del data
    phase_runs: list[dict[str, float]] = []
    for _ in range(max(3, reps // 2)):
        with Phases() as ph:
            lowdiff_once()
        phase_runs.append(ph.split(entry_crc_s(recs)))
    phases = {k: median([r[k] for r in phase_runs]) for k in phase_runs[0]}
    lo, raw, rawc = median(samples["lowdiff"]), median(samples["raw"]), median(samples["raw+commit"])
    return {"segment_bytes": size, "steps": len(recs), "lowdiff_s": lo, "raw_s": raw, "raw_commit_s": rawc,
            "lowdiff_MBps": mb(size) / lo, "raw_MBps": mb(size) / raw, "raw_commit_MBps": mb(size) / rawc,
            "ratio_vs_raw": raw / lo, "ratio_vs_raw_commit": rawc / lo, "writer_cpu_s": median(samples["lowdiff_cpu"]),
            "phases_s": phases, "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 repetitions")
    ap.add_argument("--out", default=None, help="JSON output path (default: bench/results/writebw.json)")
    ap.add_argument("--work", default=None, help="scratch directory on the disk to measure (default: the system "
                                                  "temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    reps = 2 if args.smoke else args.reps
    info = machine_info()
    info["crc32"] = f"{crc32.__module__}.{crc32.__name__}"  # the CRC-32 the writer uses (isal, zlib-ng or zlib)
    grads = gradients(spec)
    work = Path(tempfile.mkdtemp(prefix="writebw-", dir=args.work))
    out: dict[str, Any] = {"machine": info, "reps": reps, "cases": {}}
    cases: list[tuple[str, Callable[[], list[StepRecord]]]] = [
        ("topk 1% x 10 steps", lambda: records(grads, "topk", 10)),
        ("none x 1 step", lambda: records(grads, "none", 1)),
    ]
    try:
        for name, make in cases:
            res = measure(make(), work / name.replace(" ", "_").replace("%", ""), reps)
            out["cases"][name] = res
            ph = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res["phases_s"].items() if k != "total")
            print(f"{name}: {mb(res['segment_bytes']):.1f} MB; lowdiff {res['lowdiff_MBps']:.0f} MB/s, raw "
                  f"{res['raw_MBps']:.0f} MB/s, raw+commit {res['raw_commit_MBps']:.0f} MB/s; lowdiff/raw "
                  f"{res['ratio_vs_raw']:.2f}, lowdiff/(raw+commit) {res['ratio_vs_raw_commit']:.2f}; writer CPU "
                  f"{res['writer_cpu_s'] * 1e3:.1f} ms; phases (ms): {ph}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["machine"]["loadavg_end"] = os.getloadavg()
    print(f"crc32: {info['crc32']}; load average start {info['loadavg_start']}, end {out['machine']['loadavg_end']}")
    dest = Path(args.out) if args.out else ROOT / "bench" / "results" / "writebw.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_json(dest, out)


if __name__ == "__main__":
    main()
