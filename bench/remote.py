"""The remote tier (issue 33): training with the mirror on against the same training with it off, the upload
throughput to a local S3 server, the steady-state lag, and recovering 200 logged steps from the bucket against from
the local disk.

Two twins train the same-initialized 10.8M GPT (``bench/_common.py``), Top-k 1 %, the persistence process (the
default), one torch thread: ``off`` (no ``remote``) and ``mirror`` (``remote.url`` on moto's S3 server, started here
on 127.0.0.1 as a subprocess). Rounds interleave a window of each twin; each window's median step time (wall clock,
training thread) is divided by the ``off`` window's of the same round, and the median over rounds is reported. A
window ends with ``opt.flush()`` (untimed). Snapshots only at step 0 (``every_steps`` 1000): between snapshots the
mirror uploads segments, and the mirror twin's run then holds 200 logged steps after its snapshot, which both
recoveries replay (``lowdiff.recover(RUN_DIR)`` against ``lowdiff.recover(URL)``, interleaved, ``--recover-reps``
times). The upload throughput is s3fs's (the client lowdiff uses) ``put_file`` of the snapshot, timed.

    python bench/remote.py                       # ~10 min on 2 shared cores; bench/results/remote.json, docs page
    python bench/remote.py --smoke --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from _common import FULL_MODEL, SMOKE_MODEL, machine_info, output_paths, pyplot, train_step, write_json

import lowdiff


def start_s3() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"moto's S3 server did not start on {endpoint} (pip install 'moto[server]')") from None
            time.sleep(0.2)


class Twin:
    def __init__(self, name: str, spec: Any, run_dir: Path, remote: str | None, batches: list[Any]) -> None:
        self.name = name
        self.model = spec.build(seed=0)
        inner = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        cfg: dict[str, Any] = {"run_dir": str(run_dir), "compressor": {"name": "topk", "ratio": 0.01},
                               "snapshot": {"every_steps": 1000}, "log": {"batch_steps": 16}}
        if remote:
            cfg["remote"] = {"url": remote, "close_timeout_s": 300}
        self.opt = lowdiff.wrap(inner, self.model, cfg)
        self.batches = batches
        self.step = 0
        self.lag_steps: list[int] = []
        self.lag_s: list[float] = []

    def window(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            self.step += 1
            t0 = time.perf_counter()
            train_step(self.model, self.opt, self.batches[self.step % len(self.batches)])
            times.append(time.perf_counter() - t0)
            st = self.opt.stats
            if st.remote_durable_step is not None:
                self.lag_steps.append(st.remote_lag_steps)
                self.lag_s.append(st.remote_lag_s)
        self.opt.flush()
        return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--window", type=int, default=20, help="steps per twin per round")
    ap.add_argument("--recover-reps", type=int, default=3)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.window, args.recover_reps = 2, 3, 1
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    torch.set_num_threads(1)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    machine = machine_info()
    server, endpoint = start_s3()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    work = Path(tempfile.mkdtemp(prefix="lowdiff-remote-bench-", dir=args.work_dir))
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("bench")
        url = "s3://bench/run"
        batches = spec.batches(8)
        off = Twin("off", spec, work / "off", None, batches)
        mirror = Twin("mirror", spec, work / "mirror", url, batches)
        ratios, per_round = [], []
        for r in range(args.rounds):
            order = (off, mirror) if r % 2 == 0 else (mirror, off)
            got = {t.name: statistics.median(t.window(args.window)) for t in order}
            ratios.append(got["mirror"] / got["off"])
            per_round.append(got)
            print(f"round {r}: off {got['off'] * 1e3:.1f} ms, mirror {got['mirror'] * 1e3:.1f} ms, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        t0 = time.perf_counter()
        while True:
            st = mirror.opt.stats
            if st.remote_durable_step == st.durable_step or time.perf_counter() - t0 > 300:
                break
            time.sleep(0.05)
        catch_up_s = time.perf_counter() - t0
        mstats = mirror.opt.stats
        off.opt.close()
        mirror.opt.close()
        steps = mirror.step
        snap = next((work / "mirror" / "snapshots").iterdir())
        t0 = time.perf_counter()
        fs.put_file(str(snap), "bench/throughput/snapshot.h5")
        put_s = time.perf_counter() - t0
        local_s, remote_s = [], []
        for _ in range(args.recover_reps):
            t0 = time.perf_counter()
            a = lowdiff.recover(work / "mirror", workers=1)
            local_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = lowdiff.recover(url, workers=1)
            remote_s.append(time.perf_counter() - t0)
            assert a.step == b.step == steps and all(torch.equal(a.model[k], b.model[k]) for k in a.model)
        out = {
            "machine": machine, "machine_taken": "start", "model": spec.as_dict(), "compressor": "topk 0.01",
            "persistence": "process",
            "rounds": args.rounds, "window": args.window, "torch_threads": 1,
            "step_ratio_mirror_over_off": statistics.median(ratios), "round_ratios": ratios, "per_round_s": per_round,
            "log_bytes": mstats.log_bytes, "snapshot_bytes": mstats.snapshot_bytes,
            "lag_steps_median": statistics.median(mirror.lag_steps) if mirror.lag_steps else None,
            "lag_steps_max": max(mirror.lag_steps, default=None),
            "lag_s_median": statistics.median(mirror.lag_s) if mirror.lag_s else None,
            "lag_s_max": max(mirror.lag_s, default=None), "catch_up_after_last_window_s": catch_up_s,
            "upload_snapshot_bytes": snap.stat().st_size, "upload_MBps": snap.stat().st_size / put_s / 1e6,
            "recovered_steps": steps, "recover_local_s": local_s, "recover_remote_s": remote_s,
        }
    finally:
        server.kill()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    json_path, md_path, png_path = output_paths(args.out_dir, "remote")
    write_json(json_path, out)
    md_path.write_text(page(out, png_path.name))
    plt = pyplot(png_path)
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot(range(len(ratios)), ratios, "o-")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("round")
        ax.set_ylabel("step time, mirror / off")
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
    print(md_path.read_text())


def page(o: dict[str, Any], png: str) -> str:
    m, med = o["machine"], statistics.median
    rows = [
        (f"step time, mirror on / off (median of {o['rounds']} interleaved rounds of {o['window']} steps)",
         f"{o['step_ratio_mirror_over_off']:.3f}"),
        ("round ratios", ", ".join(f"{r:.3f}" for r in o["round_ratios"])),
        ("steady-state lag, steps (median / max over the mirror's steps)",
         f"{o['lag_steps_median']} / {o['lag_steps_max']}"),
        ("steady-state lag, seconds (median / max)", f"{o['lag_s_median']:.2f} / {o['lag_s_max']:.2f}"),
        (f"upload throughput to the local server (s3fs put_file of the {o['upload_snapshot_bytes'] / 1e6:.1f} MB "
         "snapshot)", f"{o['upload_MBps']:.0f} MB/s"),
        (f"recover {o['recovered_steps']} logged steps from the local disk (median of {len(o['recover_local_s'])})",
         f"{med(o['recover_local_s']):.2f} s"),
        ("recover the same from the bucket (fetch + the same replay)", f"{med(o['recover_remote_s']):.2f} s"),
    ]
    table = "\n".join(["| what | figure |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])
    return f"""# The remote tier: mirror on against off, and recovery from the bucket

Written by `python bench/remote.py` ({'smoke' if o['rounds'] <= 2 else 'full'} run) at commit
{m.get('git_commit', '?')[:10]} on {m.get('date', '?')}. Machine: {m.get('platform', '?')}, {m.get('cpu_count', '?')}
CPUs shared with other engineers' tests and benchmarks during the run (load average at the {o.get('machine_taken',
'start')} {', '.join(f'{x:.1f}' for x in m.get('loadavg_start', ()))}; differences under about 10 % are within the
noise);
torch {m.get('torch', '?')}, one torch thread. Model: GPT
{o['model']['n_layer']} layers x {o['model']['d_model']}, {o['model']['tokens_per_step']} tokens per step;
compressor {o['compressor']}, persistence process, snapshots only at step 0 (the mirror uploads segments). The S3
server is moto's, on 127.0.0.1 (a local server: no network in the figures).

{table}

The lag is `opt.stats.remote_lag_steps` / `remote_lag_s`, sampled after every step of the mirror twin: it counts
from a file's local commit (up to `log.batch_steps` = 16 steps are committed together, and the steps not yet
committed are not in it), so 0 means every committed file was in the bucket when the step returned.
![ratios]({png})
"""


if __name__ == "__main__":
    main()
