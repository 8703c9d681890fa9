"""Helpers shared by the benchmarks: the model, machine facts, memory probes, output paths.

Benchmarks print; the library never does. Everything here is measurement plumbing, not lowdiff code.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/x.py` puts bench/ on the path, not the repo root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from examples.tinygpt import GPT  # noqa: E402


@dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    d_model: int
    n_head: int
    batch: int
    block: int
    vocab: int = 256

    def build(self, seed: int = 0) -> GPT:
        torch.manual_seed(seed)
        return GPT(vocab_size=self.vocab, n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model,
                   block_size=self.block, dropout=0.0)

    def batches(self, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed batches of real text (the stdlib sources), cycled by the benchmarks."""
        from examples.tinygpt import StdlibText

        data = StdlibText(max_bytes=1_000_000)
        gen = torch.Generator().manual_seed(seed)
        return [data.get_batch(self.batch, self.block, gen) for _ in range(n)]

    def as_dict(self) -> dict[str, Any]:
        return {"n_layer": self.n_layer, "d_model": self.d_model, "n_head": self.n_head, "batch": self.batch,
                "block": self.block, "vocab": self.vocab, "tokens_per_step": self.batch * self.block}


# The real runs: ~10.8M parameters, 512 tokens per step. A ~50M GPT takes ~3 s per step on this shared 2-core
# machine with one torch thread (19M: 0.6 s quiet, 1.6 s under the load other jobs put on it), which does not fit
# the overhead benchmark's ~1000 interleaved steps in ~15 minutes.
FULL_MODEL = ModelSpec(n_layer=6, d_model=384, n_head=6, batch=4, block=128)
SMOKE_MODEL = ModelSpec(n_layer=2, d_model=64, n_head=4, batch=2, block=32)
# The ~50M-parameter GPT issue #3 asks for (49.6M with the tied 256-token head); 2048 tokens per step. Too slow
# for the interleaved protocol on the 2-core CPU box (~3 s per step); meant for GPU runs (--device cuda).
GPT50M_MODEL = ModelSpec(n_layer=10, d_model=640, n_head=10, batch=8, block=256)
MODEL_SIZES = {"small": FULL_MODEL, "50m": GPT50M_MODEL}


def to_device(batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.to(device), y.to(device)) for x, y in batches]


def device_info(device: torch.device | str) -> dict[str, Any]:
    dev = torch.device(device)
    if dev.type != "cuda":
        return {"type": dev.type}
    props = torch.cuda.get_device_properties(dev)
    return {"type": "cuda", "name": props.name, "total_memory_bytes": props.total_memory,
            "cuda": torch.version.cuda, "count": torch.cuda.device_count()}


def train_step(model: torch.nn.Module, opt: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = batch
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def machine_info() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "lowdiff"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", False
    return {
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
        "git_commit": commit, "lowdiff_dirty": dirty, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def maxrss_bytes(who: int = resource.RUSAGE_SELF) -> int:
    """ru_maxrss in bytes. Beware: Linux carries it over fork + exec, so a child of a big process reports at least
    its parent's RSS; :func:`peak_rss_bytes` does not have that problem."""
    return resource.getrusage(who).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process's address space (VmHWM): starts afresh at exec, unlike ru_maxrss."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return maxrss_bytes()


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's), from /proc."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def proc_kib_bytes(pid: int, file: str, key: str) -> int:
    """``key:`` of /proc/PID/``file`` (a kB figure: ``status`` VmHWM, ``smaps_rollup`` Pss) in bytes; 0 if gone."""
    try:
        with open(f"/proc/{pid}/{file}") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pss_bytes(pid: int) -> int:
    return proc_kib_bytes(pid, "smaps_rollup", "Pss")


def pss_tree_bytes(pid: int) -> int:
    """PSS of process ``pid`` plus all its descendants, read once (no thread)."""
    todo, seen, total = [pid], set(), 0
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _pss_bytes(p)
        todo += children(p)
    return total


class PssSampler:
    """Samples the proportional set size (PSS) of a process (default: this one) plus all its descendants every
    ``period_s``, from a thread of this process.

    PSS splits pages shared between a parent and forked workers, so the sum over processes is the real
    footprint (summing RSS would count torch's shared libraries and copy-on-write pages once per process).
    Sample another process (``pid``) when the measured one must stay free of threads (lowdiff forks replay
    workers only from a process without other threads).
    """

    def __init__(self, period_s: float = 0.02, pid: int | None = None) -> None:
        self.period_s = period_s
        self.pid = os.getpid() if pid is None else pid
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _total(self) -> int:
        return pss_tree_bytes(self.pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._total())
            self._stop.wait(self.period_s)

    def __enter__(self) -> PssSampler:
        self.peak_bytes = self._total()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._total())


def run_probe(script: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run ``script --probe ...`` in a fresh interpreter; it prints one JSON line last."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout_s,
                       env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"probe {args} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def raw_write_fsync(path: Path, data: bytes) -> None:
    """The raw baseline of write bandwidth: os.write the bytes into a new file and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def k_for(numel: int, ratio: float) -> int:
    """Top-k's k for a tensor of ``numel`` elements at ``compressor.ratio``: ceil(ratio * numel)
    (docs/reference/design.md, section 13), at least 1, at most numel. The benchmarks' own arithmetic."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def payload_bytes(shape: torch.Size | tuple[int, ...], element_size: int, comp: str, ratio: float, rank: int) -> int:
    """Expected bytes one gradient of ``shape`` adds to a step's payload: Top-k values + int32 indices; PowerSGD
    factors P (n x r) and Q (m x r) of a matrix (n = shape[0], m = the product of the rest, r = min(rank, n, m)),
    the full gradient where the factors would not be smaller or the tensor is not a matrix (design.md, section 13);
    none the full gradient."""
    numel = math.prod(shape)
    if comp == "topk":
        return k_for(numel, ratio) * (element_size + 4)
    if comp == "powersgd" and len(shape) >= 2:
        n, m = int(shape[0]), numel // int(shape[0])
        r = min(rank, n, m)
        if (n + m) * r < n * m:
            return (n + m) * r * element_size
    return numel * element_size


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def output_paths(out_dir: str | None, name: str) -> tuple[Path, Path, Path]:
    """(json, markdown, png). Default: bench/results/NAME.json, docs/measurements/NAME.md and .png."""
    if out_dir:
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{name}.json", d / f"{name}.md", d / f"{name}.png"
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    pages = ROOT / "docs" / "measurements"
    pages.mkdir(parents=True, exist_ok=True)
    return ROOT / "bench" / "results" / f"{name}.json", pages / f"{name}.md", pages / f"{name}.png"


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def mb(nbytes: float) -> float:
    return nbytes / 1e6


def pyplot(path: Path) -> Any:
    """matplotlib's pyplot on the Agg backend, or None (with a message saying how to get it) when matplotlib is
    not installed: the benchmark's JSON and Markdown results do not need it, only the plot at ``path``."""
    try:
        import matplotlib
    except ImportError:
        print(f"bench: matplotlib is not installed, so {path} is not drawn (pip install -e '.[bench]')",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def quartiles(xs: list[float]) -> tuple[float, float]:
    """First and third quartiles of ``xs`` (the spread of rounds)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def median_quartiles(xs: list[float], draws: int = 2000) -> tuple[float, float]:
    """Bootstrap quartiles of the median of ``xs`` (rounds resampled with replacement, a fixed seed so that a page
    re-renders the same): how far the median itself may be off; it narrows as rounds are added, the spread of rounds
    (:func:`quartiles`) does not."""
    rnd = random.Random(0)
    meds = sorted(statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[draws // 4], meds[3 * draws // 4]
