"""Guards of the steady-state ``opt.step()`` on the training thread (issue 35), on the CPU in CI and on a GPU where
one is lent (``bench/gpu.sh`` runs them with ``LOWDIFF_GUARD_DEVICE=cuda``):

* no operation that synchronizes a device (``_local_scalar_dense``, ``equal``, ``nonzero``, ``masked_select``,
  ``unique``, ``is_nonzero``, copies to the host that are not non-blocking into pinned memory) made by lowdiff's own
  code, seen by a ``TorchDispatchMode`` that records the training thread alone. The inner optimizer's own step is
  not lowdiff's and is left out. On the CPU nothing synchronizes, so the guard judges each op by what it would be on
  a GPU: a ``.to("cpu")`` of a tensor is a device-to-host copy there;
* no wait for a copy in flight (an event's ``synchronize()``, ``torch.cuda.synchronize()``) outside snapshot steps,
  with copies that complete only later (``lowdiff.testing.copies_in_flight``);
* lowdiff's Python calls per step do not grow with the number of parameter tensors (8 and 64 layers: equal),
  compression itself aside (one ``compress_decode`` per parameter, the compressor's own work).

Models are small enough that the compressors take their device branch (Top-k's sampled CPU selection starts at
65536 elements, lowdiff._compressors.topk)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from lowdiff_harness import wait_for_persistence_exit
from sync_watch import LOWDIFF_DIR, SyncWatch

import lowdiff
import lowdiff.testing

DEVICE = os.environ.get("LOWDIFF_GUARD_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("LOWDIFF_GUARD_DEVICE=cuda without a GPU", allow_module_level=True)

WARMUP = 6
STEPS = 6


def make(layers: int, width: int = 32) -> torch.nn.Module:
    """``layers`` blocks of Linear + BatchNorm (persistent buffers that change every step) + ReLU."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks).to(DEVICE)


def wrapped(tmp_path: Path, compressor: str, persistence: str, layers: int = 8, *,
            tensor_lr: bool = False) -> tuple[Any, torch.nn.Module, Any]:
    model = make(layers)
    lr: Any = torch.tensor(1e-3, device=DEVICE) if tensor_lr else 1e-3
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    opt = lowdiff.wrap(inner, model, {
        "run_dir": str(tmp_path / f"run-{compressor}-{persistence}-{layers}"),
        "compressor": {"name": compressor, "ratio": 0.05, "rank": 2},
        "snapshot": {"every_steps": 1000},  # none in the measured steps
        "log": {"batch_steps": 4, "persistence": persistence}})
    # Tracked at the end of an iteration, as in most loops: a step's iteration ends at the next opt.step().
    sched = None if tensor_lr else opt.track(torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0), "sched")
    opt.resume()
    return opt, model, sched


def one_step(opt: Any, model: torch.nn.Module, sched: Any, it: int, inside: Any = None) -> None:
    g = torch.Generator().manual_seed(it)
    x = torch.randn(16, model[0].in_features, generator=g).to(DEVICE)
    model(x).square().mean().backward()
    if inside is None:
        opt.step()
    else:
        with inside():
            opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


@contextmanager
def strict(watch: SyncWatch, opt: Any) -> Iterator[None]:
    """``watch`` open; on a GPU also ``torch.cuda.set_sync_debug_mode("error")`` for lowdiff's own calls (the inner
    optimizer's step runs with it off: not lowdiff's)."""
    with ExitStack() as stack:
        stack.enter_context(watch)
        if DEVICE == "cuda":
            inner, step = opt.inner, opt.inner.step

            def unguarded(*a: Any, **k: Any) -> Any:
                torch.cuda.set_sync_debug_mode(0)
                try:
                    return step(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("error")

            inner.step = unguarded
            stack.callback(lambda: delattr(inner, "step"))
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, 0)
        yield


@pytest.mark.parametrize("persistence", ["thread", "process"])
@pytest.mark.parametrize("compressor", ["topk", "powersgd", "none"])
def test_steady_steps_make_no_device_sync(tmp_path: Path, compressor: str, persistence: str) -> None:
    opt, model, sched = wrapped(tmp_path, compressor, persistence)
    watch = SyncWatch(DEVICE)
    with opt:
        for it in range(1, WARMUP + 1):
            one_step(opt, model, sched, it)
        for it in range(WARMUP + 1, WARMUP + STEPS + 1):
            one_step(opt, model, sched, it, inside=lambda: strict(watch, opt))
    assert not watch.found, dict(watch.found)


@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_a_tensor_learning_rate_is_not_read_back_every_step(tmp_path: Path, persistence: str) -> None:
    """A learning rate held in a tensor (on the GPU for capturable optimizers): read once, not twice a step."""
    opt, model, sched = wrapped(tmp_path, "topk", persistence, tensor_lr=True)
    watch = SyncWatch(DEVICE)
    with opt:
        for it in range(1, WARMUP + 1):
            one_step(opt, model, sched, it)
        for it in range(WARMUP + 1, WARMUP + STEPS + 1):
            one_step(opt, model, sched, it, inside=lambda: strict(watch, opt))
    assert not watch.found, dict(watch.found)


class Count:
    """Tracked at the end of an iteration, with no end call lowdiff sees: the end state is known only at the seal."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def wrapped_scaled(tmp_path: Path, persistence: str, count: Count | None = None
                   ) -> tuple[Any, torch.nn.Module, Any, Any]:
    """A learning rate in a tensor on the model's device that a scheduler changes every step (``fill_``), and a
    tracked GradScaler around backward and step: both logged at the end of every iteration (``count``: tracked
    too)."""
    model = make(8)
    inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=DEVICE))
    opt = lowdiff.wrap(inner, model, {
        "run_dir": str(tmp_path / f"run-scaled-{persistence}"),
        "compressor": {"name": "topk", "ratio": 0.05},
        "snapshot": {"every_steps": 1000},
        "log": {"batch_steps": 4, "persistence": persistence}})
    sched = opt.track(torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.99 ** s), "sched")
    scaler = opt.track(torch.amp.GradScaler(DEVICE, init_scale=2.0**8, growth_interval=3), "scaler")
    if count is not None:
        opt.track(count, "count")
    opt.resume()
    return opt, model, sched, scaler


def one_scaled_step(opt: Any, model: torch.nn.Module, sched: Any, scaler: Any, it: int,
                    watch: SyncWatch | None = None) -> None:
    """An AMP loop's iteration; with ``watch``, from the scaler's step to the scheduler's (lowdiff's work at the
    end of an iteration runs in ``scaler.update()`` and ``sched.step()``). On a GPU the end-of-iteration calls
    also run with ``torch.cuda.set_sync_debug_mode("error")``; ``scaler.step()`` does not (it reads ``found_inf``
    with ``.item()`` itself: torch's own wait, which the watch leaves out)."""
    g = torch.Generator().manual_seed(it)
    x = torch.randn(16, model[0].in_features, generator=g).to(DEVICE)
    scaler.scale(model(x).square().mean()).backward()
    with ExitStack() as stack:
        if watch is not None:
            stack.enter_context(watch)
        scaler.step(opt)
        opt.zero_grad()
        if watch is not None and DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, 0)
        scaler.update()
        sched.step()


def announce_end(opt: Any, count: Count, watch: SyncWatch | None = None) -> None:
    """The loop's own counter changed, then ``opt.end_iteration()`` (as LowDiffTrainer calls it every step); with
    ``watch``, the call is watched (on a GPU with ``set_sync_debug_mode("error")`` too)."""
    count.n += 1
    with ExitStack() as stack:
        if watch is not None:
            stack.enter_context(watch)
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("error")
                stack.callback(torch.cuda.set_sync_debug_mode, 0)
        opt.end_iteration()


@pytest.mark.parametrize("announced", [False, True], ids=["end-calls", "and-end_iteration"])
@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_a_device_learning_rate_changed_every_step_and_a_grad_scaler_are_not_read_back(
        tmp_path: Path, persistence: str, announced: bool) -> None:
    """Their values are copied to host memory without waiting and read by the writer (lowdiff._transfer.scalars):
    ``.item()`` here (a ``state_dict()`` of the scaler, the encoding of the ``lr``) would make the host wait for the
    device at the end of every iteration. ``announced``: a counter of the loop's own tracked too, its end said by
    ``opt.end_iteration()``, which reads the same values."""
    count = Count() if announced else None
    opt, model, sched, scaler = wrapped_scaled(tmp_path, persistence, count)
    watch = SyncWatch(DEVICE)
    with opt:
        for it in range(1, WARMUP + STEPS + 1):
            on = watch if it > WARMUP else None
            one_scaled_step(opt, model, sched, scaler, it, on)
            if count is not None:
                announce_end(opt, count, on)
    assert not watch.found, dict(watch.found)


class InFlight:
    """A copy that completes only once the next step has begun (a GPU far behind the host): ``synchronize()`` on
    the training thread is counted as a wait."""

    clock = 0
    waits: Counter[str] = Counter()
    thread = 0

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.born = InFlight.clock

    def query(self) -> bool:
        return InFlight.clock > self.born

    def synchronize(self) -> None:
        if threading.get_ident() == InFlight.thread:
            InFlight.waits[self.kind] += 1


@pytest.mark.parametrize("persistence", ["thread", "process"])
@pytest.mark.parametrize("compressor", ["topk", "powersgd", "none"])
def test_steady_steps_do_not_wait_for_copies(tmp_path: Path, compressor: str, persistence: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    InFlight.clock, InFlight.waits, InFlight.thread = 0, Counter(), threading.get_ident()
    device_waits: Counter[str] = Counter()
    if torch.cuda.is_available():
        def counted(what: str, real: Any) -> Any:
            def wait(*a: Any, **k: Any) -> Any:
                if threading.get_ident() == InFlight.thread:
                    device_waits[what] += 1
                return real(*a, **k)
            return wait
        monkeypatch.setattr(torch.cuda, "synchronize", counted("cuda", torch.cuda.synchronize))
        monkeypatch.setattr(torch.cuda.Event, "synchronize", counted("event", torch.cuda.Event.synchronize))
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", counted("stream", torch.cuda.Stream.synchronize))
    opt, model, sched = wrapped(tmp_path, compressor, persistence)
    with opt, lowdiff.testing.copies_in_flight(InFlight):
        for it in range(1, WARMUP + 1):
            InFlight.clock = it
            one_step(opt, model, sched, it)
        InFlight.waits.clear()
        device_waits.clear()
        for it in range(WARMUP + 1, WARMUP + STEPS + 1):
            InFlight.clock = it
            one_step(opt, model, sched, it)
        waits = dict(InFlight.waits) | dict(device_waits)
    assert waits == {}, waits
    if DEVICE != "cpu":
        return  # on a GPU the fake events stand in for copies really in flight: the bytes are not checked
    # Records handed over late, in order: the log holds every step, and replaying it gives the live state.
    last = WARMUP + STEPS
    rec = lowdiff.recover(Path(opt.config.run_dir), workers=1)
    assert rec.step == last
    live = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    got = rec.model if isinstance(rec.model, dict) else rec.model.state_dict()
    for k, v in live.items():
        assert torch.equal(v, got[k].detach().cpu()), k


@pytest.mark.parametrize("counted", [None, "unseen", "announced"],
                         ids=["end-calls-seen", "an-end-object-unseen", "an-end-object-announced"])
@pytest.mark.parametrize("persistence", ["thread", "process"])
def test_end_state_still_being_copied_is_not_waited_for(tmp_path: Path, persistence: str, counted: str | None
                                                        ) -> None:
    """The copies of a scheduler's device ``lr`` and of a GradScaler's scale complete only once the next step has
    begun: the end of an iteration goes to the persistence process then (not waited for at ``sched.step()``), and
    the log holds the values they had. With an object tracked at the end whose end call lowdiff does not see, the
    end state is known only when the next ``opt.step()`` seals the iteration, or when the loop says so with
    ``opt.end_iteration()``: its copies, made then, are not waited for either."""
    InFlight.clock, InFlight.waits, InFlight.thread = 0, Counter(), threading.get_ident()
    count = Count() if counted else None
    opt, model, sched, scaler = wrapped_scaled(tmp_path, persistence, count)
    with opt, lowdiff.testing.copies_in_flight(InFlight):
        for it in range(1, WARMUP + STEPS + 1):
            if it == WARMUP + 1:
                InFlight.waits.clear()
            InFlight.clock = it
            one_scaled_step(opt, model, sched, scaler, it)
            if count is not None and counted == "announced":
                announce_end(opt, count)
            elif count is not None:
                count.n += 1
        waits = dict(InFlight.waits)
    assert waits == {}, waits
    if DEVICE != "cpu":
        return
    count2 = Count() if counted else None
    opt2, model2, sched2, scaler2 = wrapped_scaled(tmp_path, persistence, count2)  # resumes
    with opt2:
        assert opt2.iteration == WARMUP + STEPS
        for k, v in model.state_dict().items():
            assert torch.equal(v, model2.state_dict()[k]), k
        assert torch.equal(opt.inner.param_groups[0]["lr"], opt2.inner.param_groups[0]["lr"])
        assert scaler2.state_dict() == scaler.state_dict()
        assert sched2.last_epoch == sched.last_epoch
        assert count2 is None or count is None or count2.n == count.n == WARMUP + STEPS


class Clock:
    """Half-iterations: a copy made at ``opt.step()`` completes at the scheduler's step, one made there only at the
    next ``opt.step()``."""

    t = 0

    def __init__(self, kind: str) -> None:
        self.born = Clock.t

    def query(self) -> bool:
        return Clock.t > self.born

    def synchronize(self) -> None:
        pass


def test_rng_taken_again_while_the_end_state_waits_for_its_copies_is_what_a_crash_commits(tmp_path: Path) -> None:
    """Process persistence, a tensor ``lr`` whose copy made at ``sched.step()`` is still running, then an evaluation's
    draws and ``opt.capture_rng()``: the end state goes to the persistence process later, and the RNG state taken
    again must go with it, or a trainer killed after the next ``opt.step()`` is recovered with the RNG state from
    before the evaluation (found in review: the end state had gone without it)."""
    if DEVICE != "cpu":
        pytest.skip("a forked CPU trainer with pretended copies: not forked from a process that has used CUDA")
    run_dir, kill_at = tmp_path / "run", 5
    pid = os.fork()
    if pid == 0:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
            inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
            opt = lowdiff.wrap(inner, model, {"run_dir": str(run_dir), "snapshot": {"every_steps": 100},
                                              "log": {"batch_steps": 1, "persistence": "process"}})
            sched = opt.track(torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.9 ** s), "sched")
            opt.resume()
            with lowdiff.testing.copies_in_flight(Clock):
                for it in range(1, 20):
                    Clock.t = 2 * it
                    model(torch.randn(2, 4)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    if it == kill_at + 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                    Clock.t = 2 * it + 1
                    sched.step()
                    torch.rand(3)  # an evaluation's draws
                    opt.capture_rng()
                    if it == kill_at:
                        torch.save(torch.get_rng_state(), tmp_path / "expected.pt")
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), status
    wait_for_persistence_exit(run_dir)
    rec = lowdiff.recover(run_dir, workers=1)
    assert rec.step == kill_at
    assert torch.equal(rec.rng["torch"], torch.load(tmp_path / "expected.pt"))


SUBTREES_ASIDE = ("_payloads", "recv")
"""Functions whose calls (and all under them) are not counted: the wrapper's compression loop, and the reading of
the persistence process's messages (commits, freed slots), which come when the disk has written them."""


def _lowdiff_calls(opt: Any, model: torch.nn.Module, sched: Any, it: int) -> Counter[str]:
    """lowdiff's Python calls in one opt.step(), by function, but for SUBTREES_ASIDE: the wrapper's ``_payloads``
    compresses each gradient and decodes it into ``.grad`` (a compressor's work per parameter, as a DDP
    communication hook's is per bucket)."""
    calls: Counter[str] = Counter()
    depth = [0]

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if not code.co_filename.startswith(LOWDIFF_DIR):
            return
        if code.co_name in SUBTREES_ASIDE:
            depth[0] += 1 if event == "call" else -1
            return
        if depth[0] or event == "return":
            return
        calls[f"{code.co_filename[len(LOWDIFF_DIR):]}:{code.co_name}"] += 1

    def inside() -> Any:
        class Profiled:
            def __enter__(self) -> None:
                sys.setprofile(prof)

            def __exit__(self, *exc: object) -> None:
                sys.setprofile(None)
        return Profiled()

    one_step(opt, model, sched, it, inside=inside)
    return calls


@pytest.mark.parametrize("persistence", ["thread", "process"])
@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_lowdiff_python_work_per_step_does_not_grow_with_the_model(tmp_path: Path, compressor: str,
                                                                    persistence: str) -> None:
    counts = {}
    for layers in (8, 64):
        opt, model, sched = wrapped(tmp_path, compressor, persistence, layers)
        with opt:
            for it in range(1, WARMUP + 1):
                one_step(opt, model, sched, it)
            counts[layers] = _lowdiff_calls(opt, model, sched, WARMUP + 1)
    grown = {k: (counts[8].get(k, 0), n) for k, n in counts[64].items() if n != counts[8].get(k, 0)}
    grown |= {k: (n, 0) for k, n in counts[8].items() if k not in counts[64]}
    assert not grown, grown
