"""Does a background writer thread slow the training thread through the GIL? Thread versus process persistence.

Part A, training: one shared GPT (bench/_common.py's FULL_MODEL, 10.8 M parameters, 1 torch thread), AdamW, clip.
Windows of ``--window`` steps of each mode, round-robin with the order rotated every round, ``--rounds`` rounds;
each window is drained (background work finished) before the next starts, untimed. Modes:

- ``plain``: training only;
- ``capture``: + an owned copy of every gradient (what lowdiff's optimizer does for compressor none), dropped;
- ``lowdiff-thread``: + lowdiff's BackgroundWriter (the real writer thread; compressor none, codec none, one step per
  segment, queue depth 2) persisting those copies;
- ``ring-thread``: + the gradients copied into one of 2 preallocated slots and persisted by a plain writer thread
  (write_segment on the slot);
- ``ring-process``: the same slots in shared memory, persisted by a separate process (spawn; slot numbers over a
  pipe); only the copy stays on the training thread.

``ring-thread`` and ``ring-process`` do identical work except where write_segment runs, so their difference is
what the GIL (and thread scheduling) costs; ``lowdiff-thread`` vs ``ring-thread`` is what fresh allocations cost.
Per mode: median over rounds of the window's mean step time and of its ratio to the ``plain`` window of the same
round; CPU per step counts every thread of this process plus the writer process.

Part B, a pure-Python loop instead of training (the worst case for the GIL: it never releases it by itself), while a
writer persists one 43 MB segment every ``--period`` seconds (the training step time) in a thread, in a thread with
``sys.setswitchinterval(0.5 ms)``, or in a process; interleaved windows. Reported: the loop's throughput relative to
no writer, and the time it lost per segment. Thread loss minus process loss is the GIL cost: the time the loop
waited for the GIL the writer held, plus the forced switches.

    python bench/studies/gil.py [--rounds 8] [--window 5] [--probe-rounds 6] [--smoke]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common.py
import torch  # noqa: E402
from _common import FULL_MODEL, ROOT, SMOKE_MODEL, machine_info, median, train_step, write_json  # noqa: E402

from lowdiff._persist.thread_writer import BackgroundWriter  # noqa: E402
from lowdiff._storage.run_dir import RetentionPolicy, RunDir  # noqa: E402
from lowdiff._storage.segment import StepRecord, write_segment  # noqa: E402
from lowdiff._storage.trailer import crc32  # noqa: E402
from lowdiff._transfer.host_copies import Staged  # noqa: E402

GROUPS = [{"lr": 3e-4}]
SLOTS = 2


# -- shared-memory slots and the writers ------------------------------------------------------------------------------


Layout = list[tuple[str, int, str, tuple[int, ...]]]  # (param name, byte offset, dtype name, shape)


def layout_of(grads: dict[str, torch.Tensor]) -> tuple[Layout, int]:
    out, off = [], 0
    for n, g in grads.items():
        out.append((n, off, str(g.dtype).removeprefix("torch."), tuple(g.shape)))
        off += (g.numel() * g.element_size() + 63) // 64 * 64
    return out, off


def slot_views(buf: Any, layout: Layout, slot_bytes: int) -> list[dict[str, torch.Tensor]]:
    base = torch.frombuffer(buf, dtype=torch.uint8)
    out = []
    for s in range(SLOTS):
        views = {}
        for n, off, dt, shape in layout:
            dtype = getattr(torch, dt)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            start = s * slot_bytes + off
            views[n] = base[start : start + nbytes].view(dtype).view(shape)
        out.append(views)
    return out


def write_slot(run_dir: Path, views: dict[str, torch.Tensor], step: int) -> None:
    write_segment(run_dir, [StepRecord(step=step, groups=GROUPS, grads={n: {"full": t} for n, t in views.items()})],
                  "none", "none")


def process_main(conn: Connection, shm_name: str, layout: Layout, slot_bytes: int, run_dir: str,
                 period: float) -> None:
    """The writer process: ``(slot, step)`` -> write_segment of that slot, then ``("ack", slot, s)``. With
    ``period`` > 0 it instead writes slot 0 every ``period`` seconds by itself until told to stop (part B)."""
    torch.set_num_threads(1)
    shm = SharedMemory(name=shm_name)
    try:
        views = slot_views(shm.buf, layout, slot_bytes)
        rd = Path(run_dir)
        conn.send(("ready",))
        if period > 0:
            self_paced(rd, views[0], period, lambda: conn.poll(), lambda n: conn.send(("done", n)))
            conn.recv()
            return
        while True:
            msg = conn.recv()
            if msg is None:
                return
            slot, step = msg
            t0 = time.perf_counter()
            try:
                write_slot(rd, views[slot], step)
            except BaseException as e:
                conn.send(("error", repr(e)))
                return
            conn.send(("ack", slot, time.perf_counter() - t0))
    finally:
        del views
        shm.close()


def self_paced(run_dir: Path, views: dict[str, torch.Tensor], period: float, stop: Any, done: Any) -> None:
    n, t_next = 0, time.perf_counter()
    while not stop():
        now = time.perf_counter()
        if now < t_next:
            time.sleep(min(t_next - now, 0.01))
            continue
        n += 1
        write_slot(run_dir, views, n)
        for f in (run_dir / "log").iterdir():
            f.unlink()
        t_next += period
    done(n)


class RingWriter:
    """Slots in shared memory, persisted by a writer thread or a writer process; at most SLOTS in flight."""

    def __init__(self, kind: str, grads: dict[str, torch.Tensor], run_dir: Path) -> None:
        self.kind = kind
        self.run_dir = run_dir
        (run_dir / "log").mkdir(parents=True, exist_ok=True)
        self.layout, self.slot_bytes = layout_of(grads)
        self.shm = SharedMemory(create=True, size=SLOTS * self.slot_bytes)
        self.views = slot_views(self.shm.buf, self.layout, self.slot_bytes)
        for v in self.views:  # fault the pages in once, as a long-lived ring would be
            for t in v.values():
                t.zero_()
        self.free = list(range(SLOTS))
        self.write_s: list[float] = []
        self.blocked_s = 0.0
        self.proc: Any = None
        if kind == "process":
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=process_main, args=(child, self.shm.name, self.layout, self.slot_bytes,
                                                               str(run_dir), 0.0), daemon=True)
            self.proc.start()
            child.close()
            assert self.conn.recv() == ("ready",)
        else:
            self.q: queue.Queue[Any] = queue.Queue()
            self.acks: queue.Queue[Any] = queue.Queue()
            self.thread = threading.Thread(target=self._thread_main, daemon=True)
            self.thread.start()

    def _thread_main(self) -> None:
        while True:
            msg = self.q.get()
            if msg is None:
                return
            slot, step = msg
            t0 = time.perf_counter()
            write_slot(self.run_dir, self.views[slot], step)
            self.acks.put(("ack", slot, time.perf_counter() - t0))

    def _ack(self, block: bool) -> bool:
        if self.kind == "process":
            if not block and not self.conn.poll():
                return False
            msg = self.conn.recv()
        else:
            try:
                msg = self.acks.get(block=block)
            except queue.Empty:
                return False
        if msg[0] != "ack":
            raise RuntimeError(f"writer failed: {msg}")
        self.free.append(msg[1])
        self.write_s.append(msg[2])
        return True

    def submit(self, grads: dict[str, torch.Tensor], step: int) -> None:
        while self._ack(block=False):
            pass
        if not self.free:
            t0 = time.perf_counter()
            while not self.free:
                self._ack(block=True)  # back-pressure, as lowdiff's bounded queue
            self.blocked_s += time.perf_counter() - t0
        slot = self.free.pop(0)
        views = self.views[slot]
        with torch.no_grad():
            for n, g in grads.items():
                views[n].copy_(g)
        if self.kind == "process":
            self.conn.send((slot, step))
        else:
            self.q.put((slot, step))

    def drain(self) -> None:
        while len(self.free) < SLOTS:
            self._ack(block=True)

    def child_cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid) if self.proc is not None else 0.0

    def writer_cpu_s(self) -> float:
        """CPU time of the writer: the process, or the thread."""
        return self.child_cpu_s() if self.proc is not None else proc_cpu_s(os.getpid(), self.thread.native_id)

    def close(self) -> None:
        self.drain()
        if self.kind == "process":
            self.conn.send(None)
            self.proc.join(30)
        else:
            self.q.put(None)
            self.thread.join()
        del self.views
        self.shm.close()
        self.shm.unlink()


def sched() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable but waiting for one) from /proc/thread-self/schedstat.

    Wall time minus both is time the thread slept: for a training thread that does no I/O, that is waiting for the
    GIL (plus back-pressure waits, timed separately). Waiting for a CPU that other processes hold is the run-queue
    part, so the split separates GIL contention from CPU contention on a loaded machine."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, runq = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(runq) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid``, or of its thread ``tid``."""
    with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def clear_log(run_dir: Path) -> None:
    for f in (run_dir / "log").iterdir():
        f.unlink()


# -- part A: training -------------------------------------------------------------------------------------------------


def part_a(spec: Any, rounds: int, window: int, work: Path) -> dict[str, Any]:
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = spec.batches(8)
    for i in range(3):
        train_step(model, opt, batches[i % len(batches)])
    x, y = batches[0]
    _, loss = model(x, y)
    loss.backward()
    grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.zero_grad(set_to_none=True)
    dirs = {m: work / m for m in ("lowdiff-thread", "ring-thread", "ring-process")}
    for d in dirs.values():
        (d / "log").mkdir(parents=True, exist_ok=True)
    bw = BackgroundWriter(RunDir(dirs["lowdiff-thread"]), batch_steps=1, codec="none", compressor="none",
                          queue_depth=2, retention=RetentionPolicy(), durable_step=0)
    rings = {"ring-thread": RingWriter("thread", grads0, dirs["ring-thread"]),
             "ring-process": RingWriter("process", grads0, dirs["ring-process"])}
    modes = ["plain", "capture", "lowdiff-thread", "ring-thread", "ring-process"]
    step_no = [0]

    def one_step(mode: str, b: Any) -> None:
        x, y = b
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_no[0] += 1
        if mode in ("capture", "lowdiff-thread"):
            with torch.no_grad():
                rec = {n: {"full": p.grad.detach().clone()} for n, p in model.named_parameters() if p.grad is not None}
            if mode == "lowdiff-thread":
                bw.submit_record(Staged(StepRecord(step=step_no[0], groups=GROUPS, grads=rec)))
        elif mode in rings:
            rings[mode].submit({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, step_no[0])
        opt.zero_grad(set_to_none=True)

    def writer_cpu(mode: str) -> float:
        if mode == "lowdiff-thread":
            return proc_cpu_s(os.getpid(), bw._thread.native_id)
        return rings[mode].writer_cpu_s() if mode in rings else 0.0

    def drain(mode: str) -> None:
        if mode == "lowdiff-thread":
            bw.flush()
            err = bw.take_error()
            if err is not None:
                raise err
        elif mode in rings:
            rings[mode].drain()
        if mode in dirs:
            clear_log(dirs[mode])

    per_round: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            res: dict[str, Any] = {"order": order}
            for mode in order:
                child0 = rings[mode].child_cpu_s() if mode in rings else 0.0
                w0 = writer_cpu(mode)
                blocked0 = bw.stats.blocked_s + sum(ring.blocked_s for ring in rings.values())
                (on0, rq0), c0, t0 = sched(), time.process_time(), time.perf_counter()
                for i in range(window):
                    one_step(mode, batches[(r * window + i) % len(batches)])
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                on1, rq1 = sched()
                blocked = bw.stats.blocked_s + sum(ring.blocked_s for ring in rings.values()) - blocked0
                drain(mode)  # background work of this window, untimed (wall); its CPU is counted below
                wcpu = writer_cpu(mode) - w0
                cpu_all = time.process_time() - c0 + (rings[mode].child_cpu_s() - child0 if mode in rings else 0.0)
                res[mode] = {"step_s": wall / window, "cpu_step_s": cpu / window, "cpu_all_step_s": cpu_all / window,
                             "train_on_cpu_s": (on1 - on0) / window, "train_runq_s": (rq1 - rq0) / window,
                             "blocked_s": blocked / window, "writer_cpu_s": wcpu / window,
                             "gil_wait_s": max(0.0, wall - (on1 - on0) - (rq1 - rq0) - blocked) / window}
            per_round.append(res)
            print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{m} {res[m]['step_s'] * 1e3:.0f} ms" for m in modes)
                  + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        bw.close()
        for ring in rings.values():
            ring.close()
    summary: dict[str, Any] = {}
    for m in modes:
        summary[m] = {
            "step_s": median([pr[m]["step_s"] for pr in per_round]),
            "ratio_vs_plain": median([pr[m]["step_s"] / pr["plain"]["step_s"] for pr in per_round]),
            "ratio_iqr": iqr([pr[m]["step_s"] / pr["plain"]["step_s"] for pr in per_round]),
            "cpu_step_s": median([pr[m]["cpu_all_step_s"] for pr in per_round]),
            "cpu_ratio_vs_plain": median([pr[m]["cpu_all_step_s"] / pr["plain"]["cpu_all_step_s"] for pr in per_round]),
            **{k: median([pr[m][k] for pr in per_round]) for k in ("train_on_cpu_s", "train_runq_s", "blocked_s",
                                                                   "gil_wait_s", "writer_cpu_s")},
        }
    summary["ring-process"]["ring_write_s"] = median(rings["ring-process"].write_s)
    summary["ring-thread"]["ring_write_s"] = median(rings["ring-thread"].write_s)
    return {"summary": summary, "rounds": per_round, "payload_bytes": sum(g.numel() * g.element_size()
                                                                          for g in grads0.values())}


def iqr(xs: list[float]) -> list[float]:
    s = sorted(xs)
    return [s[len(s) // 4], s[(3 * len(s)) // 4]] if s else []


# -- part B: a pure-Python loop ---------------------------------------------------------------------------------------


def spin(seconds: float) -> tuple[float, float]:
    """Pure-Python work for ``seconds``: (iterations per second, seconds lost in gaps > 0.2 ms)."""
    n, gaps = 0, 0.0
    t0 = t_prev = time.perf_counter()
    end = t0 + seconds
    while t_prev < end:
        for _ in range(100):
            n += 1
        t = time.perf_counter()
        if t - t_prev > 2e-4:
            gaps += t - t_prev
        t_prev = t
    return n / (t_prev - t0), gaps


def part_b(grads: dict[str, torch.Tensor], rounds: int, seconds: float, period: float, work: Path) -> dict[str, Any]:
    run_dir = work / "probe"
    (run_dir / "log").mkdir(parents=True, exist_ok=True)
    layout, slot_bytes = layout_of(grads)
    shm = SharedMemory(create=True, size=SLOTS * slot_bytes)
    views = slot_views(shm.buf, layout, slot_bytes)
    with torch.no_grad():
        for n, g in grads.items():
            views[0][n].copy_(g)
    ctx = mp.get_context("spawn")
    modes = ["none", "thread", "thread-si0.5ms", "process"]
    per_round: list[dict[str, Any]] = []
    default_si = sys.getswitchinterval()
    try:
        for r in range(rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            res: dict[str, Any] = {}
            for mode in order:
                count: list[int] = []
                if mode == "process":
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(target=process_main, args=(child, shm.name, layout, slot_bytes, str(run_dir),
                                                                  period), daemon=True)
                    proc.start()
                    child.close()
                    assert parent.recv() == ("ready",)
                elif mode.startswith("thread"):
                    stop = threading.Event()
                    th = threading.Thread(target=self_paced, args=(run_dir, views[0], period, stop.is_set,
                                                                   count.append), daemon=True)
                    if mode == "thread-si0.5ms":
                        sys.setswitchinterval(5e-4)
                    th.start()
                (on0, rq0), t0 = sched(), time.perf_counter()
                rate, gaps = spin(seconds)
                on1, rq1 = sched()
                wall = time.perf_counter() - t0
                if mode == "process":
                    parent.send("stop")
                    count.append(parent.recv()[1])
                    parent.send(None)
                    proc.join(30)
                elif mode.startswith("thread"):
                    stop.set()
                    th.join()
                    sys.setswitchinterval(default_si)
                clear_log(run_dir)
                res[mode] = {"rate": rate, "gaps_s": gaps, "segments": count[-1] if count else 0,
                             "on_cpu_s": on1 - on0, "runq_s": rq1 - rq0,
                             "gil_wait_s": max(0.0, wall - (on1 - on0) - (rq1 - rq0))}
            for mode in modes:
                res[mode]["rel_rate"] = res[mode]["rate"] / res["none"]["rate"]
                n = res[mode]["segments"]
                res[mode]["lost_s_per_segment"] = seconds * (1 - res[mode]["rel_rate"]) / n if n else 0.0
                res[mode]["gil_wait_s_per_segment"] = res[mode]["gil_wait_s"] / n if n else 0.0
            per_round.append(res)
            print(f"  probe round {r + 1}/{rounds}: " + ", ".join(
                f"{m} {res[m]['rel_rate']:.3f} ({res[m]['segments']} seg, GIL wait {res[m]['gil_wait_s'] * 1e3:.0f} ms)"
                for m in modes)
                + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        sys.setswitchinterval(default_si)
        del views
        shm.close()
        shm.unlink()
    summary = {m: {"rel_rate": median([pr[m]["rel_rate"] for pr in per_round]),
                   "rel_rate_iqr": iqr([pr[m]["rel_rate"] for pr in per_round]),
                   "lost_ms_per_segment": 1e3 * median([pr[m]["lost_s_per_segment"] for pr in per_round]),
                   "gaps_ms_per_s": 1e3 * median([pr[m]["gaps_s"] for pr in per_round]) / seconds,
                   "gil_wait_ms_per_s": 1e3 * median([pr[m]["gil_wait_s"] for pr in per_round]) / seconds,
                   "runq_ms_per_s": 1e3 * median([pr[m]["runq_s"] for pr in per_round]) / seconds,
                   "gil_wait_ms_per_segment": 1e3 * median([pr[m]["gil_wait_s_per_segment"] for pr in per_round]),
                   "segments_per_window": median([pr[m]["segments"] for pr in per_round])} for m in modes}
    return {"summary": summary, "rounds": per_round, "seconds": seconds, "period_s": period}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--probe-rounds", type=int, default=6)
    ap.add_argument("--probe-seconds", type=float, default=2.0)
    ap.add_argument("--period", type=float, default=None, help="part B: seconds between segments (default: the "
                                                                "median plain step time of part A)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds each (seconds)")
    ap.add_argument("--out", default=None, help="JSON output (default: bench/results/gil.json)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    if args.smoke:
        args.rounds, args.window, args.probe_rounds, args.probe_seconds = 2, 2, 2, 0.3
    info = machine_info()
    info["crc32"] = f"{crc32.__module__}.{crc32.__name__}"  # the CRC-32 the writer uses (isal, zlib-ng or zlib)
    info["switchinterval_s"] = sys.getswitchinterval()
    print(f"gil.py: {spec}; crc32 {info['crc32']}; load {info['loadavg_start']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-gil-"))
    t_start = time.perf_counter()
    try:
        a = part_a(spec, args.rounds, args.window, work)
        model = spec.build()
        x, y = spec.batches(1)[0]
        _, loss = model(x, y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        period = args.period or a["summary"]["plain"]["step_s"]
        b = part_b(grads, args.probe_rounds, args.probe_seconds, period, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    info["runtime_s"] = time.perf_counter() - t_start
    print(f"\nPart A: training ({spec.n_layer} layers, d_model {spec.d_model}; payload "
          f"{a['payload_bytes'] / 1e6:.1f} MB/step; {args.rounds} rounds x {args.window} steps)\n")
    print("| mode | step time | vs plain (median of rounds) | IQR | CPU/step (all threads + writer process) "
          "| CPU vs plain | writer CPU/step | training thread per step: on CPU | waiting for a CPU "
          "| waiting for the GIL | back-pressure |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, s in a["summary"].items():
        print(f"| {m} | {s['step_s'] * 1e3:.0f} ms | {100 * (s['ratio_vs_plain'] - 1):+.1f} % | "
              f"{100 * (s['ratio_iqr'][0] - 1):+.0f} .. {100 * (s['ratio_iqr'][1] - 1):+.0f} % | "
              f"{s['cpu_step_s'] * 1e3:.0f} ms | {100 * (s['cpu_ratio_vs_plain'] - 1):+.1f} % | "
              f"{s['writer_cpu_s'] * 1e3:.0f} ms | {s['train_on_cpu_s'] * 1e3:.0f} ms | "
              f"{s['train_runq_s'] * 1e3:.0f} ms | "
              f"{s['gil_wait_s'] * 1e3:.1f} ms | {s['blocked_s'] * 1e3:.1f} ms |")
    print(f"\nPart B: pure-Python loop, one segment every {period * 1e3:.0f} ms "
          f"({args.probe_rounds} rounds x {args.probe_seconds:.1f} s)\n")
    print("| writer | segments per window | loop throughput vs none | IQR | loop waiting for the GIL, per s "
          "| per segment | loop waiting for a CPU, per s |")
    print("|---|---|---|---|---|---|---|")
    for m, s in b["summary"].items():
        print(f"| {m} | {s['segments_per_window']:.0f} | {s['rel_rate']:.3f} | {s['rel_rate_iqr'][0]:.3f} .. "
              f"{s['rel_rate_iqr'][1]:.3f} | {s['gil_wait_ms_per_s']:.1f} ms | {s['gil_wait_ms_per_segment']:.1f} ms | "
              f"{s['runq_ms_per_s']:.0f} ms |")
    print(f"\ncrc32 {info['crc32']}; load average start {info['loadavg_start']}, end {info['loadavg_end']}; "
          f"runtime {info['runtime_s']:.0f} s")
    dest = Path(args.out) if args.out else ROOT / "bench" / "results" / "gil.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_json(dest, {"machine": info, "args": vars(args), "training": a, "probe": b})


if __name__ == "__main__":
    main()
