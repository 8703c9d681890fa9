"""One writer per run directory."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lowdiff._storage.format import LOCK_FILE, PERSIST_LOCK_GLOB
from lowdiff.errors import CheckpointWriteError, RunLockedError

# POSIX record locks belong to a process, so a second lock from the same process would succeed silently:
# this registry refuses it.
_held: set[str] = set()
_held_guard = threading.Lock()


def _open_here(run_dir: Path) -> bool:
    """Whether this process holds ``run_dir``'s writer lock (a wrapper of its own has the run open)."""
    with _held_guard:
        return os.path.realpath(run_dir / LOCK_FILE) in _held


class WriterLock:
    """A POSIX record lock (``lockf``) on RUN_DIR/writer.lock. The kernel drops it when the holder dies, so a
    crashed trainer's lock is simply taken over, and, unlike ``flock``, forked children (DataLoader workers
    that outlive a killed trainer for a few seconds) do not inherit it. A live holder is named in the error."""

    def __init__(self, run_dir: Path, holder: str = "") -> None:
        """``holder``: what the lock file says besides the pid and host ("persistence process " for a dead
        trainer's persistence process committing under it, which :func:`live_trainer` tells from a trainer)."""
        self.path = run_dir / LOCK_FILE
        self._key = os.path.realpath(self.path)
        with _held_guard:
            if self._key in _held:
                raise RunLockedError(f"{run_dir} is already open for writing in this process (pid {os.getpid()}); "
                                     "close() the other wrapper first or use another run_dir")
            _held.add(self._key)
        try:
            self._fd = self._open()
        except BaseException:
            self._forget()
            raise
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = -1
            self._forget()
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise _error(self.path, e, "lock") from e
            raise RunLockedError(f"{run_dir} is in use by another trainer ({holder}); stop it or use another "
                                 "run_dir") from None
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{holder}pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as e:
            self.release()
            raise _error(self.path, e, "write") from e

    def _open(self) -> int:
        try:
            return _open_lock_file(self.path)
        except OSError as e:
            raise _error(self.path, e, "create") from e

    def _forget(self) -> None:
        with _held_guard:
            _held.discard(self._key)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
            self._forget()


def _open_lock_file(path: Path) -> int:
    # Never through a symbolic link (a planted writer.lock -> ~/.bashrc would be truncated), never a FIFO.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointWriteError(errno.EINVAL, f"{path} is not a regular file; remove it", str(path))
    os.set_blocking(fd, True)
    return fd


def _error(path: Path, e: OSError, what: str) -> CheckpointWriteError:
    hint = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free disk space (quota exceeded)",
            errno.EACCES: "check the directory's permissions", errno.EROFS: "use a writable run_dir",
            errno.ELOOP: "it is a symbolic link: remove it"}.get(e.errno or 0, "check the run directory")
    return CheckpointWriteError(e.errno, f"cannot {what} the lock {path}: {e.strerror or e}; {hint}", str(path))


def take_persistence_lock(run_dir: Path, index: int) -> int:
    """An ``flock`` on RUN_DIR/persist-IIIII.lock for rank ``index``'s persistence process (``log.persistence:
    process``); returns its descriptor. The trainer takes it, hands the descriptor to the process it starts and
    closes its own: the lock then lasts exactly as long as that process, however it exits (an ``flock`` belongs to
    the open file, which the started process holds from its first instruction). :func:`wait_for_persistence` sees
    it."""
    path = run_dir / PERSIST_LOCK_GLOB.replace("*", f"{index:05d}")
    try:
        fd = _open_lock_file(path)
    except OSError as e:
        raise _error(path, e, "create") from e
    # A reader testing the lock (wait_for_persistence: flock has no way to ask without taking it) holds it shared
    # for microseconds: a lock still held after a tenth of a second is a persistence process's.
    for _ in range(50):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
                os.close(fd)
                raise _error(path, e, "lock") from e
        time.sleep(0.002)
    os.close(fd)
    raise RunLockedError(f"{path} is held by a persistence process still running; wait for it to exit")


def live_trainer(run_dir: Path) -> str | None:
    """The trainer holding RUN_DIR's writer lock in another process (its pid and host as it wrote them), or None.
    None too when the holder is a dead trainer's persistence process committing under it, or has not written who
    it is yet. A lock of this process's own is not looked at (closing a second descriptor of the file would drop
    it: POSIX record locks belong to the process)."""
    path = run_dir / LOCK_FILE
    if _open_here(run_dir):
        return None
    if not path.is_file():
        return None
    try:
        fd = _open_lock_file(path)
    except OSError:
        return None  # taking the lock itself will say what is wrong
    try:
        if not _record_locked(fd):
            return None
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        return holder if holder.startswith("pid ") else None
    finally:
        os.close(fd)


# Linux's struct flock on a 64-bit machine: l_type, l_whence, l_start, l_len, l_pid (32 bytes with its padding).
_FLOCK = struct.Struct("hhqqi")
_ASKS = sys.platform.startswith("linux") and struct.calcsize("P") == 8


def _record_locked(fd: int) -> bool:
    """Whether another process holds a POSIX record lock on ``fd``'s file. Asked without taking it (``F_GETLK``)
    where the layout of the question is known: taking it, even for a moment, would make a trainer starting in that
    moment fail with RunLockedError. Elsewhere tested by taking the lock and letting it go at once."""
    if _ASKS:
        try:
            got = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0).ljust(32, b"\0"))
            return _FLOCK.unpack_from(got)[0] != fcntl.F_UNLCK
        except OSError:
            return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EACCES, errno.EAGAIN)
    fcntl.lockf(fd, fcntl.LOCK_UN)
    return False


def wait_for_persistence(run_dir: Path, timeout_s: float, on_wait: Callable[[], None],
                         refuse_live_trainer: bool = True) -> None:
    """Return once no persistence process holds a RUN_DIR/persist-*.lock (a trainer calls this before it reads
    or writes the run directory, and before it starts persistence processes of its own). ``on_wait`` is called
    once if it has to wait; after ``timeout_s`` it raises :class:`RunLockedError`. With ``refuse_live_trainer``,
    a persistence process whose trainer is alive (it holds the writer lock: a job started twice on one run
    directory) is refused at once instead of waited for; a job's ranks other than the one that takes the lock pass
    False (the lock may be their own job's by then). A run directory this process holds open for writing (any
    persistence process there is this process's own: ``lowdiff.compact()`` beside the script's open wrapper) is
    refused at once, as :class:`WriterLock` refuses it."""
    if _open_here(run_dir):
        raise RunLockedError(f"{run_dir} is already open for writing in this process (pid {os.getpid()}); "
                             "close() the other wrapper first or use another run_dir")
    deadline = None
    for path in sorted(run_dir.glob(PERSIST_LOCK_GLOB)):
        try:
            fd = _open_lock_file(path)
        except OSError as e:
            raise _error(path, e, "open") from e
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    break
                except OSError as e:
                    if e.errno not in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
                        raise _error(path, e, "test") from e
                if deadline is None:
                    holder = live_trainer(run_dir) if refuse_live_trainer else None
                    if holder is not None:
                        raise RunLockedError(f"{run_dir} is in use by another trainer ({holder}); stop it or use "
                                             "another run_dir")
                    deadline = time.monotonic() + timeout_s
                    on_wait()
                elif time.monotonic() > deadline:
                    raise RunLockedError(f"{run_dir}: a persistence process of an earlier trainer is still "
                                         f"committing after {timeout_s:.0f} s ({path.name} is locked); wait for it "
                                         "(python -m lowdiff._persist.child) to exit, or stop it")
                time.sleep(0.02)
        finally:
            os.close(fd)


def wait_for_orphans(run_dir: Path, timeout_s: float, on_wait: Callable[[], None]) -> bool:
    """For a reader of RUN_DIR (recovery): return once no persistence process of a dead trainer is still committing
    what it was handed, so the reader sees every step it will commit; a live trainer's is not waited for (a live
    run is read as it stands). False when one was still committing after ``timeout_s`` (the run is then read as it
    is now); True at once when the locks cannot be looked at (a copy this user may not write)."""
    if _open_here(run_dir):
        return True  # this process is the trainer (opt.resume()): its persistence processes are live
    if not any(run_dir.glob(PERSIST_LOCK_GLOB)) or live_trainer(run_dir) is not None:
        return True
    try:
        wait_for_persistence(run_dir, timeout_s, on_wait, refuse_live_trainer=False)
    except RunLockedError:
        return False
    except (CheckpointWriteError, OSError):
        pass  # not ours to lock (read-only): nothing to say
    return True
