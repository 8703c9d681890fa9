"""One writer per run directory."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from lowdiff.errors import RunLockedError
from lowdiff.storage.format import LOCK_FILE


class WriterLock:
    """``flock`` on RUN_DIR/writer.lock: the kernel drops it when the holder dies, so a stale lock from a
    crashed trainer is simply taken over; a live holder is named in the error."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise RunLockedError(f"{run_dir} is in use by another trainer ({holder}); stop it or use another "
                                 "run_dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
