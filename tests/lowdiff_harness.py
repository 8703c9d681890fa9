"""Deterministic training scenarios shared by the tests and by the kill -9 child process.

Everything a step consumes is derived from (seed, step): the batch and the dropout mask come from
``torch.manual_seed`` called at the start of each step, so a run that is interrupted, resumed, or re-run in
another process feeds the optimizer exactly the same data as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lowdiff

SLOW = os.environ.get("LOWDIFF_SLOW") == "1"
"""LOWDIFF_SLOW=1: more hypothesis examples and more kill points (CI keeps the defaults, ~6 min in all)."""
EXAMPLES_SCALE = 8 if SLOW else 1

MODEL_KINDS = ("mlp_bn", "tied", "frozen", "frozen_out", "branch")
OPTIMIZER_KINDS = ("sgd", "sgd_nesterov", "adam", "adamw")


# --- models --------------------------------------------------------------------------------------------------


class MLPBN(nn.Module):
    """Linear + BatchNorm1d + Dropout, plus a 0-d parameter (a learnable output scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(12, 3)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))) * self.scale


class Tied(nn.Module):
    """Embedding and output projection share one weight (state_dict has two keys for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 11)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.emb(tokens))))


class Frozen(nn.Module):
    """fc1.weight has requires_grad=False (it never gets a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 3)
        self.fc1.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Branch(nn.Module):
    """head_b is used only on even steps: on odd steps its parameters get no gradient (grad is None)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 12)
        self.head_a = nn.Linear(12, 3)
        self.head_b = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        out = self.head_a(h)
        if step % 2 == 0:
            out = out + self.head_b(h)
        return out


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp_bn":
        return MLPBN()
    if kind == "tied":
        return Tied()
    if kind in ("frozen", "frozen_out"):
        return Frozen()
    if kind == "branch":
        return Branch()
    raise ValueError(kind)


def loss_for(kind: str, model: nn.Module, step: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Seed the RNG from (seed, step) — batch AND dropout mask — then compute the loss."""
    torch.manual_seed(seed * 100_003 + step)
    if kind == "tied":
        tokens = torch.randint(0, 11, (16,)).to(device)
        target = torch.randint(0, 11, (16,)).to(device)
        return F.cross_entropy(model(tokens, step), target)
    x = torch.randn(16, 6).to(device)
    y = torch.randn(16, 3).to(device)
    return ((model(x, step) - y) ** 2).mean()


def to_cpu(obj: Any) -> Any:
    """Tensors (also inside dicts and lists) moved to the CPU, for comparisons with recovered state."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return type(obj)((k, to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    return obj


# --- optimizers and schedulers -------------------------------------------------------------------------------


def make_optimizer(kind: str, model: nn.Module, model_kind: str, groups: int) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if model_kind == "frozen_out":
        params = [p for p in params if p.requires_grad]
    if groups == 1:
        spec: list[dict[str, Any]] = [{"params": params}]
    else:
        spec = [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "lr": 0.02, "weight_decay": 0.0},
        ]
    if kind == "sgd":
        return torch.optim.SGD(spec, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if kind == "sgd_nesterov":
        return torch.optim.SGD(spec, lr=0.05, momentum=0.9, nesterov=True)
    if kind == "adam":
        return torch.optim.Adam(spec, lr=1e-2, weight_decay=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(spec, lr=1e-2, weight_decay=0.05)
    raise ValueError(kind)


def make_scheduler(inner: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    lambdas = [lambda e: 0.9**e, lambda e: 1.0 / (1.0 + 0.5 * e)][: len(inner.param_groups)]
    return torch.optim.lr_scheduler.LambdaLR(inner, lambdas)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Train with one intra-op thread: the same reduction order in every process (the kill -9 child and the
    reference), and on a busy 2-core machine tiny ops run ~10x faster than with a contended OpenMP pool."""
    old = torch.get_num_threads()
    if old != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if old != 1:
            torch.set_num_threads(old)


# --- a whole run ---------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    model: str = "mlp_bn"
    optimizer: str = "adamw"
    groups: int = 1
    scheduler: bool = True
    clip: bool = False
    compressor: str = "none"
    ratio: float = 0.25
    rank: int = 2
    batch_steps: int = 3
    every_steps: int = 5
    codec: str = "none"
    seed: int = 0
    device: str = "cpu"
    capture: str = "auto"
    capture_bucket_bytes: int = 0  # the test models are a few KB: every gradient a bucket of its own
    accumulate: int = 1
    """Micro-batches per step (gradient accumulation)."""
    persistence: str = "thread"
    shadow: bool = False
    when_behind: str = "wait"
    queue_depth: int = 4
    background_copy: bool = False
    remote_url: str | None = None
    """``remote.url``: the run mirrored to this URL (tests/remote)."""
    remote_close_timeout_s: float = 60.0
    remote_storage_options: dict[str, Any] | None = None
    """``remote.storage_options`` (tests/remote: another endpoint, other timeouts)."""

    def config(self, run_dir: str | Path) -> dict[str, Any]:
        remote = {"remote": {"url": self.remote_url, "close_timeout_s": self.remote_close_timeout_s,
                             "storage_options": self.remote_storage_options or {},
                             "lag_warn_s": 3.0}} if self.remote_url else {}
        return {**remote,
            "run_dir": str(run_dir),
            "compressor": {"name": self.compressor, "ratio": self.ratio, "rank": self.rank},
            "snapshot": {"every_steps": self.every_steps, "shadow": self.shadow,
                         "background_copy": self.background_copy},
            "log": {"batch_steps": self.batch_steps, "codec": self.codec, "capture": self.capture,
                    "capture_bucket_bytes": self.capture_bucket_bytes, "persistence": self.persistence,
                    "when_behind": self.when_behind, "queue_depth": self.queue_depth},
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


State = tuple[dict[str, torch.Tensor], dict[str, Any]]


@dataclass
class Trainer:
    """A model + inner optimizer (+ scheduler) wrapped by lowdiff; ``refs[k]`` is the state after step k."""

    scenario: Scenario
    model: nn.Module
    inner: torch.optim.Optimizer
    opt: lowdiff.LowDiffOptimizer
    scheduler: Any
    refs: dict[int, State] = field(default_factory=dict)
    ends: dict[int, State] = field(default_factory=dict)
    """The state at the end of iteration k (after the scheduler's step): what ``opt.resume()`` restores."""

    def record(self, step: int) -> None:
        self.refs[step] = self._state()

    def _state(self) -> State:
        return (to_cpu(copy.deepcopy(self.model.state_dict())), to_cpu(copy.deepcopy(self.inner.state_dict())))

    def step(self, step: int) -> None:
        s = self.scenario
        with single_threaded():
            if s.accumulate == 1:
                loss_for(s.model, self.model, step, s.seed, s.device).backward()
            for micro in range(s.accumulate if s.accumulate > 1 else 0):
                (loss_for(s.model, self.model, step * 16 + micro, s.seed, s.device) / s.accumulate).backward()
            if s.clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.05)
            self.opt.step()
            # Recorded before the scheduler moves lr on: the hyperparameters in effect AT this step (what a
            # snapshot captures and what the log stores for the step).
            self.record(step)
            self.opt.zero_grad()
            if self.scheduler is not None:
                self.scheduler.step()
            self.ends[step] = self._state()

    def train(self, first: int, last: int, on_step: Callable[[int], None] | None = None) -> None:
        for k in range(first, last + 1):
            self.step(k)
            if on_step is not None:
                on_step(k)


def start(scenario: Scenario, run_dir: str | Path, *, resume: bool = True) -> Trainer:
    """Build model/optimizer/scheduler from the scenario and wrap them; resume() unless told not to."""
    model = make_model(scenario.model, scenario.seed).to(scenario.device)
    inner = make_optimizer(scenario.optimizer, model, scenario.model, scenario.groups)
    sched = make_scheduler(inner) if scenario.scheduler else None
    opt = lowdiff.wrap(inner, model, scenario.config(run_dir))
    if sched is not None:
        opt.track(sched, "lr_scheduler")  # back at the end of the resumed iteration, so resumed runs continue exactly
    t = Trainer(scenario, model, inner, opt, sched)
    if resume:
        k = opt.resume()
        t.record(k)
        t.ends[k] = t.refs[k]
    return t


def train_run(scenario: Scenario, run_dir: str | Path, steps: int, *, close: bool = True) -> Trainer:
    """A fresh run of ``steps`` steps; refs[0..steps] hold the uninterrupted states."""
    t = start(scenario, run_dir)
    t.train(1, steps)
    if close:
        t.opt.close()
    return t


# --- comparison ----------------------------------------------------------------------------------------------


def _same_value(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"
        return
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _same_value(a[k], b[k], f"{where}.{k}")
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same_value(x, y, f"{where}[{i}]")
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def assert_state_equal(ref_model_sd: dict[str, torch.Tensor], ref_opt_sd: dict[str, Any], rec: Any) -> None:
    """Bit-for-bit: torch.equal on every tensor (never a tolerance), == on every non-tensor value.

    ``rec`` is a ``lowdiff.Recovered`` (or anything with ``.model`` and ``.optimizer`` state dicts).
    """
    assert list(rec.model) == list(ref_model_sd), f"model keys {list(rec.model)} vs {list(ref_model_sd)}"
    for k, v in ref_model_sd.items():
        _same_value(v, rec.model[k], f"model[{k}]")
    ref_state, got_state = ref_opt_sd["state"], rec.optimizer["state"]
    assert set(got_state) == set(ref_state), f"optimizer state indices {sorted(got_state)} vs {sorted(ref_state)}"
    for i, st in ref_state.items():
        _same_value(st, got_state[i], f"optimizer.state[{i}]")
    _same_value(list(ref_opt_sd["param_groups"]), list(rec.optimizer["param_groups"]), "optimizer.param_groups")


def wait_for_persistence_exit(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Return once no persistence process holds RUN_DIR/persist-*.lock: a killed trainer's has committed what it
    held and exited."""
    deadline = time.monotonic() + timeout_s
    for path in run_dir.glob("persist-*.lock"):
        with open(path, "rb") as f:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, f"{path} still held after {timeout_s:.0f} s"
                    time.sleep(0.05)
