"""The segment write-bandwidth test of bench/overhead.py, after the rounds: the bandwidth lowdiff's writer reached in
training, from ``opt.stats`` (log bytes / write time over the timed windows that committed segments and no snapshot;
``write_s`` is the writer's time in ``write_segment``: encode, HDF5 container, pwrite, fsync, rename, directory
fsync), beside a raw ``os.write`` + ``fsync`` of the same bytes: the newest segment file the mode committed, read
back from its run directory's ``log/`` (docs/reference/FORMAT.md, section 1)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from _common import mb, median, raw_write_fsync
from overhead_lowdiff import LowDiffMode, payload_bytes_per_step
from overhead_modes import Mode

from lowdiff.config import resolve_codec


def newest_segment(run_dir: Path) -> Path | None:
    """The newest committed log segment of a single-process run: ``log/steps-FFFFFFFFFF-LLLLLLLLLL.h5`` (zero-padded
    steps, so the names sort by step); ``*.tmp`` files are not committed."""
    files = sorted((run_dir / "log").glob("steps-*-*.h5"))
    return files[-1] if files else None


def measure_bandwidth(modes: list[Mode], work: Path, reps: int) -> dict[str, Any]:
    """Per enabled lowdiff mode: its writer's bandwidth in the timed windows (``opt.stats``), and ``reps`` raw
    ``os.write`` + ``fsync`` of its newest committed segment file's bytes (median)."""
    out: dict[str, Any] = {}
    for m in modes:
        if not isinstance(m, LowDiffMode) or not m.enabled or not m.bandwidth_test:
            continue
        logs_only = [w for w in m.writes if w["segments"] and not w["snapshots"]]
        seg = newest_segment(m.run_dir)
        if not logs_only or seg is None:
            continue
        segments = sum(w["segments"] for w in logs_only)
        nbytes = sum(w["bytes"] for w in logs_only)
        write_s = sum(w["write_s"] for w in logs_only)
        steps = sum(w.get("steps", 0) for w in logs_only)
        data = seg.read_bytes()
        scratch = work / f"bw-{m.name}"
        scratch.mkdir(parents=True, exist_ok=True)
        raw_samples = []
        for _ in range(reps):
            raw = scratch / "raw.bin"
            t0 = time.perf_counter()
            raw_write_fsync(raw, data)
            raw_samples.append(time.perf_counter() - t0)
            raw.unlink()
        shutil.rmtree(scratch, ignore_errors=True)
        per_step = payload_bytes_per_step(m.model, m.comp)
        lo_s, raw_s = write_s / segments, median(raw_samples)
        lo_mbps, raw_mbps = mb(nbytes) / write_s, mb(len(data)) / raw_s
        codec = resolve_codec(m.codec, m.comp)
        out[m.name] = {
            "method": "in training", "segments": segments, "steps_per_segment": steps / segments,
            "payload_bytes": per_step * steps / segments,
            codec: {"segment_bytes": nbytes / segments, "lowdiff_write_s": lo_s, "raw_segment_file": seg.name,
                    "raw_bytes": len(data), "raw_write_fsync_s": raw_s, "lowdiff_MBps": lo_mbps,
                    "raw_MBps": raw_mbps, "bandwidth_ratio": lo_mbps / raw_mbps,
                    "payload_MBps_lowdiff": mb(per_step * steps) / write_s,
                    "samples": {"raw_s": raw_samples}}}
    return out
