"""Signals that land while lowdiff talks to its persistence process outside a training step: during ``close()``
(a Ctrl-C, a preemption's SIGTERM) and inside a send (a program's own SIGTERM handler that flushes lowdiff).

Every message to the persistence process carries a sequence number, counted as it goes (lowdiff._persist.mailbox).
A number used twice or skipped makes the persistence process wait for a message that never comes: it stops after
``LATE_S`` and the steps it holds are not committed. A ``close()`` cut short must leave the persistence process
committing what it holds, not waiting with it, each for the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowdiff

PREAMBLE = """
import os, signal, sys, time, torch, lowdiff
torch.manual_seed(0)
model = torch.nn.Linear(8, 3)
opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, {
    "run_dir": sys.argv[1], "compressor": {"name": "none"}, "snapshot": {"every_steps": 100},
    "log": {"batch_steps": 4, "persistence": "process"}})
x = torch.ones(2, 8)
def train(steps):
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
"""

SIGNAL_DURING_CLOSE = PREAMBLE + """
if sys.argv[2] == "sigterm":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # a program's own handler, as preemption scripts have
train(6)  # steps 5 and 6 wait in the persistence process for close()'s flush
real_write, armed = os.write, [True]
def write(fd, data):
    n = real_write(fd, data)
    if armed[0]:  # the signal comes as close()'s first message to the persistence process goes through
        armed[0] = False
        signal.raise_signal(signal.SIGINT if sys.argv[2] == "sigint" else signal.SIGTERM)
    return n
os.write = write
try:
    opt.close()
    time.sleep(2)
    print("not interrupted", flush=True)
except (KeyboardInterrupt, SystemExit) as e:
    print("interrupted", type(e).__name__, flush=True)
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    # The persistence process inherits stderr: this returns once it has exited too.
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)


def _check(proc: subprocess.CompletedProcess[str], run: Path, said: str, absent: tuple[str, ...], steps: int) -> None:
    """The script ended normally having printed ``said``, stderr holds none of ``absent``, and the run recovers
    to ``steps`` with the parameters of the same loop run without lowdiff."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert said in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert not [a for a in absent if a in proc.stderr], proc.stderr[-3000:]
    rec = lowdiff.recover(run, workers=1)
    assert rec.step == steps
    assert all(torch.equal(v, rec.model[n]) for n, v in _plain_run(steps).items())


def _plain_run(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):  # compressor none: the same steps as the plain loop
        model(torch.ones(2, 8)).sum().backward()
        sgd.step()
        sgd.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("sig", ["sigint", "sigterm"])
def test_a_signal_during_close_leaves_the_persistence_process_committing(tmp_path: Path, sig: str) -> None:
    """Before: a Ctrl-C (lowdiff's handler, with no wrapper open any more: it was not deferred) raised between
    close()'s first message and its count, and the flush of close()'s cleanup went with the same number; and
    close(), cut short, then waited for its persistence process, which waited for the run directory's lock the
    trainer held, until it gave up 10 s later ("another process holds its lock; steps ... are not committed")."""
    run = tmp_path / "run"
    _check(_run(SIGNAL_DURING_CLOSE, str(run), sig), run, "interrupted", ("holds its lock", "did not arrive"), 6)


REENTRANT_FLUSH = PREAMBLE + """
signal.signal(signal.SIGTERM, lambda *a: opt.flush())  # the program's own: make everything durable, carry on
real_mask, armed = signal.pthread_sigmask, [False]
def mask(how, sigs):
    if armed[0] and how == signal.SIG_BLOCK:  # SIGTERM comes just before a message's send holds it back
        armed[0] = False
        signal.raise_signal(signal.SIGTERM)
    return real_mask(how, sigs)
signal.pthread_sigmask = mask
train(4)
armed[0] = True
opt.flush()  # its Flush goes by the socket; the handler's flush goes in between
train(4)
opt.close()
print("closed", opt.iteration, flush=True)
"""


def test_a_flush_from_a_programs_signal_handler_inside_a_send_keeps_the_numbers_in_order(tmp_path: Path) -> None:
    """Before: a socket message's sequence number was taken before the send held SIGTERM back; a handler that
    flushed lowdiff in between sent its Flush with that number, then the interrupted message went with the same one
    (and the next number was never used): the persistence process waited for it and failed."""
    run = tmp_path / "run"
    _check(_run(REENTRANT_FLUSH, str(run)), run, "closed 8", ("did not arrive", "exited"), 8)
