"""Replay worker processes: forked children that each replay a disjoint share of the model.

The parent has loaded the snapshot and moved every parameter and per-element optimizer state tensor into one
anonymous shared mapping (``MAP_SHARED``, inherited by ``fork``; no /dev/shm file, so no tmpfs size limit).
Each child then reads its own tensors' columns from the log, decodes them and steps its own optimizer over its
chunks in place, through every step in order; the parent does the same for share 0. At the end a child sends,
through a pipe, only what is not in the shared mapping: its chunks' small optimizer state (e.g. Adam's ``step``),
the newest PowerSGD Q of its tensors, and its phase times. No tensor crosses a pipe during the replay.

Only ``fork`` gives this without re-importing torch in every worker (a spawned interpreter costs ~2 s, more than
a short replay), and a fork is safe only while no other thread of the process may hold a lock the child needs
(h5py's, the allocator's) and CUDA has not been initialized in the parent (a forked child cannot use it):
:func:`fork_unsafe_reason` says when that is not the case, and recovery replays sequentially instead.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lowdiff import errors


def fork_unsafe_reason() -> str | None:
    """None when worker processes can be forked here, else why not (shown in the recovery report)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"worker processes need fork() on Linux, this is {sys.platform}"
    # A child forked after CUDA was initialized here cannot use CUDA, and torch's optimizers query it even for CPU
    # tensors (the graph-capture check in Adam.step): "CUDA error: initialization error" in every worker. Seen
    # on an H100 machine, recovering on the CPU in a process that had trained on the GPU.
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and cuda.is_initialized():
        return ("CUDA is initialized in this process, and forked replay workers could not use it; call recover() "
                "from a process that has not used the GPU (lowdiff-recover) to use workers")
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        return (f"{len(others)} other thread(s) run in this process ({', '.join(others[:3])}), so forking "
                "replay workers could deadlock; call recover() from a process without threads to use workers")
    return None


MAX_DEFAULT_WORKERS = 8
PARALLEL_MIN_STEPS = 16
"""``recover(workers=None)`` replays fewer steps than this in one process: moving the state into shared memory and
forking the workers then costs more than splitting the steps saves. Measured on 2 cores, 10.8M-parameter GPT, Top-k
(docs/measurements/recovery-short.md): 2 workers against 1 took 0.43x / 0.50x / 0.91x / 1.30x at 2 / 4 / 10 / 40
steps, the second worker's start-up ~0.3 s."""


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``) before forking: pages freed but still mapped
    would otherwise stay resident in the parent and be counted once more by every child that touches them."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_workers() -> int:
    """``recover(workers=None)``: one worker per CPU this process may run on, at most MAX_DEFAULT_WORKERS."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_DEFAULT_WORKERS))


@dataclass
class Worker:
    index: int
    pid: int
    fd: int
    """Read end of the pipe the child writes its pickled result into."""


def start(index: int, body: Callable[[], Any]) -> Worker:
    """Fork a child that runs ``body()`` and sends back ``("ok", result)`` or the error it raised."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        # What it inherited is left out of its garbage collections, which would otherwise write to (and so copy)
        # every page of the inherited Python heap. Frozen here, not in the parent: freezing moves the collector's
        # lists whole (no object is written), and the parent's own frozen objects (a program's gc.freeze()) stay
        # as they were.
        gc.freeze()
        code = 0
        try:
            os.close(rfd)
            try:
                payload: Any = ("ok", body())
            except BaseException as e:
                payload = ("error", type(e).__name__, str(e), getattr(e, "path", None), traceback.format_exc())
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(wfd, view):]
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    return Worker(index, pid, rfd)


def collect(worker: Worker) -> Any:
    """The child's result (waits for it to exit); re-raises its error in this process."""
    chunks = []
    try:
        while True:
            b = os.read(worker.fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(worker.fd)
        worker.fd = -1
    _, status = os.waitpid(worker.pid, 0)
    data = b"".join(chunks)
    if not data:
        how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        raise errors.ReplayWorkerError(f"replay worker process {worker.index} (pid {worker.pid}) died ({how}) before "
                                       "sending its result; out of memory? recover with workers=1 to replay in one "
                                       "process")
    payload = pickle.loads(data)  # written by our own child just now
    if payload[0] == "ok":
        return payload[1]
    _, name, message, path, tb = payload
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.CorruptFileError):
        err: BaseException = cls(message)
        err.path = path  # type: ignore[attr-defined]
        raise err
    if isinstance(cls, type) and issubclass(cls, errors.LowDiffError):
        raise cls(message)
    raise RuntimeError(f"replay worker process {worker.index} failed: {name}: {message}\n{tb}")


def stop(workers: list[Worker]) -> None:
    """Kill and reap children whose result is no longer wanted (the parent failed)."""
    for w in workers:
        if w.fd < 0:
            continue
        try:
            os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(w.fd)
        w.fd = -1
        os.waitpid(w.pid, 0)
