"""What the persistence process's per-step message costs the training thread once a step has left the caches cold,
and whether a shared-memory mailbox would cost it less than the socket.

Three ways, taken in turn (interleaved) after the same cache-clearing work (an in-place pass over ``--thrash-mb``
of memory, standing for a training step), each timed with ``time.thread_time()`` on the sending thread:

- ``socket``: the message lowdiff sends a step (a :class:`~lowdiff._persist.messages.Record` with a seal riding
  on it, RNG bytes of the size a CPU run carries) through ``lowdiff._persist.messages.send`` to a reader process
  that waits in ``poll`` as the persistence process does, so every write wakes it;
- ``mailbox``: the same encoded bytes written into a shared-memory ring with a header (sequence number, length,
  CRC-32) that a reader could validate without a system call on the sending side: the alternative considered;
- ``socket-small`` and ``mailbox-small``: the same without the RNG bytes (a message of about 200 bytes: the bytes
  put in shared memory beside the record's tensors instead);
- ``none``: nothing between the two clock reads (the clock's own cost with the caches cold).

    python bench/studies/handover.py --rounds 5      # ~1 min
    python bench/studies/handover.py --smoke
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import select
import socket
import statistics
import struct
import sys
import time
import zlib
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from lowdiff._persist import messages as m

KINDS = ("socket", "mailbox", "socket-small", "mailbox-small", "none")
MAILBOX_BYTES = 1 << 20
HEADER = struct.Struct("<QII")


def step_message(step: int, small: bool) -> m.Several:
    """A steady step's message: the record (RNG bytes of torch's, numpy's and Python's CPU generators, or with
    ``small`` none: the bytes elsewhere) with the previous step's seal riding on it."""
    rng = None if small else {"torch": os.urandom(5056), "numpy": os.urandom(2508), "python": os.urandom(2500)}
    seal = m.Seal(step - 1, {"sched": {"last_epoch": step - 1}}, m.AT_STEP, None)
    record = m.Record(step, 1, step % 8, (step % 8) * 4096, 4096, 3, None, rng, None,
                      {"sched": {"last_epoch": step}}, False, True, None)
    return m.Several([seal, record])


def reader(fd: int, nap_s: float) -> None:
    """The persistence process's side of the socket: wait in poll(2) (or, with ``nap_s``, sleep and look without
    waiting on the socket), read each message whole."""
    conn = Connection(fd)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        while True:
            if nap_s:
                while not poller.poll(0):
                    time.sleep(nap_s)
            else:
                poller.poll()
            conn.recv_bytes()
    except (EOFError, OSError):
        os._exit(0)


def run(steps: int, thrash_mb: int, pause_s: float, nap_s: float) -> dict[str, list[float]]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        reader(theirs.detach(), nap_s)
    theirs.close()
    conn = Connection(ours.detach())
    mfd = os.memfd_create("lowdiff-mailbox-study", os.MFD_CLOEXEC)
    os.ftruncate(mfd, MAILBOX_BYTES)
    box = memoryview(mmap.mmap(mfd, MAILBOX_BYTES))
    box[:] = b"\0" * MAILBOX_BYTES  # touched once: no first-touch page faults in the timed writes
    thrash = np.ones(thrash_mb * (1 << 20) // 8)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    at = 0
    for i in range(steps * len(KINDS)):
        kind = KINDS[i % len(KINDS)]
        msg = step_message(i + 1, kind.endswith("-small"))
        thrash *= 1.0000001
        t0 = time.thread_time()
        if kind.startswith("socket"):
            m.send(conn, msg)
        elif kind.startswith("mailbox"):
            data = m.encode(msg)
            frame = HEADER.pack(i, len(data), zlib.crc32(data)) + data
            if at + len(frame) > MAILBOX_BYTES:
                at = 0
            box[at:at + len(frame)] = frame
            at += (len(frame) + 7) & ~7
        times[kind].append(time.thread_time() - t0)
        time.sleep(pause_s)
    conn.close()
    os.waitpid(pid, 0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="sends of each kind a round")
    ap.add_argument("--warmup", type=int, default=10, help="sends of each kind left out at a round's start")
    ap.add_argument("--thrash-mb", type=int, default=64)
    ap.add_argument("--pause-ms", type=float, default=10.0)
    ap.add_argument("--reader-nap-ms", type=float, default=0.0,
                    help="the reader sleeps this long between looks instead of waiting in poll (no wake-ups)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.steps, a.warmup, a.thrash_mb, a.pause_ms = 1, 12, 2, 4, 0.0
    rounds = []
    for r in range(a.rounds):
        times = run(a.steps, a.thrash_mb, a.pause_ms / 1000, a.reader_nap_ms / 1000)
        med = {k: statistics.median(v[a.warmup:]) * 1e6 for k, v in times.items()}
        rounds.append(med)
        print(f"round {r + 1}: " + "  ".join(f"{k} {v:.1f} us" for k, v in med.items()), flush=True)
    summary = {k: statistics.median(r[k] for r in rounds) for k in KINDS}
    print("median of rounds: " + "  ".join(f"{k} {v:.1f} us" for k, v in summary.items()))
    print(f"socket - none {summary['socket'] - summary['none']:.1f} us, "
          f"mailbox - none {summary['mailbox'] - summary['none']:.1f} us")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"rounds": rounds, "median": summary, "args": vars(a) | {"out": str(a.out)},
                                     "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                                                 "cpus": os.cpu_count(), "load": os.getloadavg()}}, indent=1))


if __name__ == "__main__":
    main()
