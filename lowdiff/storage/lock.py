"""One writer per run directory."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import threading
from pathlib import Path

from lowdiff.errors import CheckpointWriteError, RunLockedError
from lowdiff.storage.format import LOCK_FILE

# POSIX record locks belong to a process, so a second lock from the same process would succeed silently:
# this registry refuses it.
_held: set[str] = set()
_held_guard = threading.Lock()


class WriterLock:
    """A POSIX record lock (``lockf``) on RUN_DIR/writer.lock. The kernel drops it when the holder dies, so a
    crashed trainer's lock is simply taken over, and, unlike ``flock``, forked children (DataLoader workers
    that outlive a killed trainer for a few seconds) do not inherit it. A live holder is named in the error."""

    def __init__(self, run_dir: Path) -> None:
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
                raise self._error(e, "lock") from e
            raise RunLockedError(f"{run_dir} is in use by another trainer ({holder}); stop it or use another "
                                 "run_dir") from None
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as e:
            self.release()
            raise self._error(e, "write") from e

    def _open(self) -> int:
        # Never through a symbolic link (a planted writer.lock -> ~/.bashrc would be truncated), never a FIFO.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise self._error(e, "create") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointWriteError(errno.EINVAL, f"{self.path} is not a regular file; remove it", str(self.path))
        os.set_blocking(fd, True)
        return fd

    def _error(self, e: OSError, what: str) -> CheckpointWriteError:
        hint = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free disk space (quota exceeded)",
                errno.EACCES: "check the directory's permissions", errno.EROFS: "use a writable run_dir",
                errno.ELOOP: "it is a symbolic link: remove it"}.get(e.errno or 0, "check the run directory")
        return CheckpointWriteError(e.errno, f"cannot {what} the writer lock {self.path}: {e.strerror or e}; {hint}",
                                    str(self.path))

    def _forget(self) -> None:
        with _held_guard:
            _held.discard(self._key)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
            self._forget()
