"""Opening files of a run directory as untrusted input (docs/reference/FORMAT.md section 8).

A reader opens only regular files that lie in the run directory: never through a symbolic link (the file's own
name or its ``snapshots/`` / ``log/`` directory), never a FIFO, socket, device or directory (opening a FIFO
blocks; reading a device never ends), and never more bytes than a bound fixed before the read. Every refusal is
an :class:`~lowdiff.errors.UnsafeFileError` naming the file; a file listed a moment ago and gone now is a
:class:`~lowdiff.errors.FileVanishedError` (retention deleted it: the caller lists again).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from lowdiff.errors import CorruptFileError, FileVanishedError, UnsafeFileError

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, *, confined: bool = True) -> int:
    """A read-only descriptor of the regular file ``path``; the caller closes it.

    ``confined``: ``path`` is a run-directory member (``RUN_DIR/snapshots/NAME``): its directory must not be a
    symbolic link either (the run directory itself may be, it is the caller's choice). The checks are made on the
    opened descriptor (``O_NOFOLLOW``, ``fstat``), so nothing can be swapped in between check and use, and
    ``O_NONBLOCK`` keeps a FIFO from blocking the open."""
    dir_fd = -1
    try:
        try:
            if confined:
                dir_fd = os.open(path.parent, _DIR_FLAGS)
                fd = os.open(path.name, _FLAGS, dir_fd=dir_fd)
            else:
                fd = os.open(path, _FLAGS)
        except OSError as e:
            raise _open_error(path, e, confined) from e
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path}: is {_kind(st.st_mode)}, not a regular file; lowdiff reads only regular "
                                  "files in a run directory (remove or rename it)", path=path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_error(path: Path, e: OSError, confined: bool) -> Exception:
    if e.errno == errno.ENOENT:
        return FileVanishedError(f"{path}: no longer exists (deleted while it was being read?)", path=path)
    if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
        where = "it or its directory" if confined else "it"
        return UnsafeFileError(f"{path}: {where} is a symbolic link; lowdiff does not follow links in a run "
                               "directory (copy the file in instead)", path=path)
    if e.errno == errno.ENXIO:
        return UnsafeFileError(f"{path}: is a socket or a device, not a regular file (remove or rename it)",
                               path=path)
    return UnsafeFileError(f"{path}: cannot be opened ({e.strerror or e}); check its permissions", path=path)


def read_bounded(path: Path, max_bytes: int, *, confined: bool = True) -> bytes:
    """The whole regular file ``path``, refused (before reading) if it is larger than ``max_bytes``."""
    fd = open_regular(path, confined=confined)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnsafeFileError(f"{path}: {size} bytes, more than the {max_bytes} a lowdiff file of this kind can "
                                  "hold; it is not one", path=path)
        chunks = []
        pos = 0
        while pos < size:
            b = os.pread(fd, min(size - pos, 1 << 24), pos)
            if not b:
                break
            chunks.append(b)
            pos += len(b)
        return b"".join(chunks)
    except OSError as e:
        raise UnsafeFileError(f"{path}: read failed ({e.strerror or e})", path=path) from e
    finally:
        os.close(fd)


def is_regular_file(path: Path) -> bool:
    """``path`` is a regular file, not followed through a symbolic link (never blocks, never raises)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def lstat_size(path: Path) -> int:
    """The size of ``path`` itself (0 when it is gone or not a regular file): for summaries, never for reading."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def parse_json(raw: bytes, where: str) -> Any:
    """JSON from an untrusted file: any parse failure, deep nesting included, is a CorruptFileError."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from e
