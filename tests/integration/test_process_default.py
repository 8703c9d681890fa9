"""Durable by default (issue 34): the configuration a user starts with (no ``log.persistence`` key) runs the
persistence process, a SIGKILL of the trainer at random moments loses no step whose iteration had ended (an LR
scheduler tracked, as in the quickstart), also under a container's 64 MB ``/dev/shm``; a cell run again closes the
earlier optimizer instead of hanging; nothing is left behind.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lowdiff_harness import SLOW

import lowdiff

HERE = Path(__file__).parent
CHILD = HERE / "quickstart_child.py"
STEPS = 60
KILLS = 20 if SLOW else 6
"""Kills at random moments, each in a run of its own (LOWDIFF_SLOW=1: more)."""
DATA_WAIT_S = 0.02
"""Each iteration waits this long for its batch: a kill lands before or after the next opt.step() alike."""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(HERE.parents[1])}


def _descendants(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
                out += _descendants(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_at_random(run_dir: Path, rng: random.Random, prefix: list[str] | None = None) -> int:
    """Start the quickstart trainer, SIGKILL it at a random moment (after a random step, a random delay into the
    next), wait for its persistence process to finish; the last step it reported ended."""
    proc = subprocess.Popen([*(prefix or []), sys.executable, str(CHILD), str(run_dir), str(STEPS), str(DATA_WAIT_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("START"), line + (proc.stderr.read() if proc.stderr else "")[-3000:]
        start, last = int(line.split()[1]), None
        target = rng.randint(start + 1, min(start + 24, STEPS - 1))
        last = start
        while last < target:
            parts = proc.stdout.readline().split()
            assert parts and parts[0] == "STEP", (proc.stderr.read() if proc.stderr else "")[-3000:]
            last = int(parts[1])
        helpers = _descendants(proc.pid)
        time.sleep(rng.uniform(0, 2 * DATA_WAIT_S))  # somewhere in the next iteration, before or after its step
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in helpers):  # its persistence process commits what it was handed, then exits
            assert time.monotonic() < deadline, "the persistence process did not finish"
            time.sleep(0.02)
        return last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict, dict]]:
    sys.path.insert(0, str(HERE))
    try:
        import quickstart_child as q
    finally:
        sys.path.remove(str(HERE))
    torch.set_num_threads(1)
    model, inner, sched, opt = q.make(str(tmp_path_factory.mktemp("ref") / "run"))
    refs = {}
    for step in range(1, STEPS + 1):
        model(q.batch(step)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        refs[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                      {i: {k: v.clone() for k, v in st.items()} for i, st in inner.state_dict()["state"].items()})
    opt.close()
    return refs


def _check(run_dir: Path, reported: int, refs: dict[int, tuple[dict, dict]]) -> int:
    rec = lowdiff.recover(run_dir, workers=1)
    assert rec.step >= reported, f"step {reported} had ended, recovered only {rec.step}"
    model, state = refs[rec.step]
    for k, v in model.items():
        assert torch.equal(v, rec.model[k]), (rec.step, k)
    for i, st in state.items():
        for k, v in st.items():
            assert torch.equal(v, rec.optimizer["state"][i][k]), (rec.step, i, k)
    return rec.step


def test_the_default_is_the_persistence_process(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    with lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, {"run_dir": str(tmp_path / "run")}) as opt:
        children = [p for p in _descendants(os.getpid())
                    if "lowdiff._persist.child" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(children) == 1 and opt.config.log.persistence == "process"


def test_sigkill_of_the_quickstart_loop_loses_no_ended_step(tmp_path: Path, reference) -> None:
    """KILLS random moments, each in a run of its own: every recovery reaches the last iteration the trainer
    reported as ended, and equals the uninterrupted run there (a resume after a crash between snapshots would
    restart Top-k's residuals, so each kill starts from an empty run directory)."""
    rng = random.Random(20261128)
    for i in range(KILLS):
        run_dir = tmp_path / f"run{i}"
        reported = _kill_at_random(run_dir, rng)
        _check(run_dir, reported, reference)


def _small_shm_prefix() -> list[str]:
    """``unshare`` into a mount namespace with a 64 MB tmpfs on /dev/shm (a container's default), or a skip."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small /dev/shm here ({probe.stderr.strip()[:120]}): run as root on Linux")
    return ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]


def test_under_a_64_mb_dev_shm(tmp_path: Path, reference) -> None:
    """Docker's default /dev/shm is 64 MB. The ring between trainer and persistence process is an anonymous memory
    file (memfd), not a /dev/shm file, so neither a kill nor a recovery with worker processes meets that limit."""
    prefix = _small_shm_prefix()
    rng = random.Random(64)
    for i in range(3):
        run_dir = tmp_path / f"run{i}"
        reported = _kill_at_random(run_dir, rng, prefix)
        _check(run_dir, reported, reference)
    out = subprocess.run([*prefix, sys.executable, "-c", "import lowdiff, sys; "
                          "print(lowdiff.recover(sys.argv[1], workers=2).report.mode)", str(run_dir)],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_cell_run_again_closes_the_earlier_optimizer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A notebook runs the cell that wraps and trains twice, the first optimizer still referenced: the second
    wrap() closes it (its steps logged) and resumes after them; one persistence process is left, the new one's."""
    def cell() -> lowdiff.LowDiffOptimizer:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = lowdiff.wrap(torch.optim.AdamW(model.parameters()), model, {"run_dir": str(tmp_path / "run")})
        opt.resume()
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        return opt

    first = cell()
    with caplog.at_level("WARNING", logger="lowdiff"):
        second = cell()
    assert "closing that one first" in caplog.text
    assert second.iteration == 6 and first.durable_step == 3
    with pytest.raises(lowdiff.LowDiffError, match="after close"):
        first.step()
    children = [p for p in _descendants(os.getpid())
                if "lowdiff._persist.child" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(children) == 1
    second.close()


def test_a_script_without_close_leaves_nothing_behind(tmp_path: Path) -> None:
    """A script that never calls close(): at its exit the log is flushed, the persistence process exits and the
    interpreter does not hang."""
    script = ("import lowdiff, torch, sys\nm = torch.nn.Linear(4, 2)\n"
              "opt = lowdiff.wrap(torch.optim.SGD(m.parameters(), lr=0.1), m, {'run_dir': sys.argv[1]})\n"
              "for _ in range(5):\n    m(torch.ones(1, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
              "print('pid', __import__('os').getpid(), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lowdiff.inspect(tmp_path / "run").latest_step == 5
    leftovers = [d.name for d in Path("/proc").iterdir() if d.name.isdigit() and _cmdline_has(d, str(tmp_path))]
    assert not leftovers


def _cmdline_has(d: Path, text: str) -> bool:
    try:
        return text in (d / "cmdline").read_text() and "lowdiff._persist.child" in (d / "cmdline").read_text()
    except OSError:
        return False


def test_without_memfd_the_thread_writes_and_says_so(tmp_path: Path) -> None:
    """Where a persistence process cannot run (memfd_create missing: macOS, a sandbox), the default falls back to
    the thread with a warning that names the fix."""
    script = ("import os, sys\ndel os.memfd_create\nimport lowdiff, torch\nm = torch.nn.Linear(4, 2)\n"
              "with lowdiff.wrap(torch.optim.SGD(m.parameters(), lr=0.1), m, {'run_dir': sys.argv[1]}) as opt:\n"
              "    m(torch.ones(1, 4)).sum().backward(); opt.step()\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "log.persistence: process cannot run here" in proc.stderr and "log.persistence: thread" in proc.stderr
    assert lowdiff.inspect(tmp_path / "run").latest_step == 1
