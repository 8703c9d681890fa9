"""The segment write-bandwidth test of bench/overhead.py, after the rounds: the newest records each lowdiff mode
committed, read back from its run directory, re-written with lowdiff's ``write_segment`` and compared with a raw
``os.write`` + ``fsync`` of the same bytes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from _common import mb, median, raw_write_fsync
from overhead_lowdiff import LowDiffMode
from overhead_modes import Mode

from lowdiff._storage.format import list_segments
from lowdiff._storage.manifest import read_manifest
from lowdiff._storage.segment import SegmentReader, StepRecord, write_segment


def last_records(run_dir: Path, steps: int, max_bytes: int) -> list[StepRecord]:
    """The newest records committed in ``run_dir``, read back from its log: ``steps`` of them, fewer if they
    would exceed ``max_bytes`` of payload (at least one)."""
    manifest = read_manifest(run_dir)
    out: list[StepRecord] = []
    need = steps
    for first, last, files in reversed(list_segments(run_dir)):
        with SegmentReader(files, manifest, first, last) as seg:
            data = seg.read_steps(None, with_buffers=True)
        out[:0] = [StepRecord(step=d.step, groups=d.groups, grads=d.grads, buffers=d.buffers, rng=d.rng,
                              data=d.data) for d in data]
        need = max(1, min(steps, max_bytes // max(1, out[-1].payload_nbytes)))
        if len(out) >= need:
            break
    return out[-need:]


def lz4_available() -> bool:
    try:
        import lz4.frame  # noqa: F401
    except ImportError:
        return False
    return True


def measure_bandwidth(modes: list[Mode], work: Path, reps: int, steps: int, max_bytes: int) -> dict[str, Any]:
    """Re-write the newest committed records of each lowdiff mode (up to ``steps`` of them, read back from its run
    directory) with lowdiff's write_segment, interleaved with a raw os.write + fsync of the same number of bytes
    (the committed file's content), medians of ``reps``."""
    out: dict[str, Any] = {}
    codecs = ("lz4", "none") if lz4_available() else ("none",)
    for m in modes:
        if not isinstance(m, LowDiffMode) or not m.enabled or not m.bandwidth_test:
            continue
        recs = last_records(m.run_dir, steps, max_bytes)
        if not recs:
            continue
        n = len(recs)
        scratch = work / f"bw-{m.name}"
        (scratch / "log").mkdir(parents=True, exist_ok=True)
        res: dict[str, Any] = {"steps_per_segment": n, "payload_bytes": sum(r.payload_nbytes for r in recs)}
        samples: dict[str, list[float]] = {}
        sizes: dict[str, int] = {}
        for _ in range(reps):
            for codec in codecs:
                t0 = time.perf_counter()
                nbytes = write_segment(scratch, recs, codec, m.comp)
                samples.setdefault(f"lowdiff_{codec}_s", []).append(time.perf_counter() - t0)
                sizes[codec] = nbytes
                seg = next((scratch / "log").iterdir())
                data = seg.read_bytes()
                seg.unlink()
                raw = scratch / "raw.bin"
                t0 = time.perf_counter()
                raw_write_fsync(raw, data)
                samples.setdefault(f"raw_{codec}_s", []).append(time.perf_counter() - t0)
                raw.unlink()
                del data
        for codec in codecs:
            lo, raw_s = median(samples[f"lowdiff_{codec}_s"]), median(samples[f"raw_{codec}_s"])
            res[codec] = {"segment_bytes": sizes[codec], "lowdiff_write_s": lo, "raw_write_fsync_s": raw_s,
                          "lowdiff_MBps": mb(sizes[codec]) / lo, "raw_MBps": mb(sizes[codec]) / raw_s,
                          "bandwidth_ratio": raw_s / lo,
                          "payload_MBps_lowdiff": mb(res["payload_bytes"]) / lo,
                          "samples": samples}
        out[m.name] = res
        shutil.rmtree(scratch, ignore_errors=True)
    return out
