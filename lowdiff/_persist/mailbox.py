"""The trainer's messages to its persistence process, through shared memory instead of the socket (issue 35).

A message written to the socket cost the training thread about 75 us more a step than the same bytes written to
shared memory, with the caches cold after a step (bench/studies/handover.py, docs/measurements/handover.md): the
system call's own path, not the bytes. So the per-step messages go into a :class:`Mailbox`, a byte ring in a
``memfd`` both processes map, and the persistence process looks for them without being woken: it waits on the
socket with a timeout (:class:`Inbox`), so a message that must be seen at once (a flush, the close, a
wait for a reply, a new arena's descriptor) still goes by the socket. Every message of either way carries a
sequence number; the persistence process handles them in that order.

The ring's layout (offsets in bytes): ``[0, 16)`` how far the reader has read (``<QI``: a running byte count and
its CRC-32, written by the reader only), ``[64, size)`` the entries. An entry is a header ``<QII`` (sequence
number, length, CRC-32 of the two and the body) and the body, at an 8-byte boundary, never across the ring's end:
where one would not fit before the end, a header with length :data:`WRAP` and the same sequence number (and its
own check) says "at the start".

Nothing orders the two processes' memory but the checks: the reader takes an entry only when its sequence number
is the one it expects and its body's CRC matches (a half-written entry, or one whose bytes the reader's core does
not see yet, is looked at again later), and the writer believes a read count only with its CRC, never moving
back. A trainer killed in the middle of writing an entry leaves one that never matches: that message was not sent,
as a message cut short on the socket is not.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection

HEADER = struct.Struct("<QII")
_SEQ_LEN = struct.Struct("<QI")
READ = struct.Struct("<QI")
START = 64
WRAP = 0xFFFFFFFF
MAILBOX_BYTES = 1 << 20
"""Room for about a hundred steady-state steps' messages; a message that does not fit goes by the socket."""


def _aligned(n: int) -> int:
    return (n + 7) & ~7


def _crc(seq: int, n: int, body: bytes = b"") -> int:
    """An entry's check: its sequence number and length with its body, so that a header half-written over an
    older whole entry (its number stored, its length and check not yet) never passes for a new one."""
    return zlib.crc32(body, zlib.crc32(_SEQ_LEN.pack(seq, n)))


class Mailbox:
    """One side of the ring (the writer's or the reader's: each keeps its own position): ``nbytes`` of a new memory
    file, or of the one ``fd`` names (the other side's, received over the socket)."""

    def __init__(self, nbytes: int = MAILBOX_BYTES, fd: int | None = None) -> None:
        if nbytes < START + 2 * HEADER.size or nbytes % 8:
            raise ValueError(f"a mailbox of {nbytes} bytes")
        if fd is None:
            fd = os.memfd_create("lowdiff-mailbox", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        self.fd = fd
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, nbytes)
        self._mem = memoryview(self._map)
        self._size = nbytes - START
        self._pos = 0
        """Bytes written (the writer) or read (the reader) since the start, wraps included."""
        self._read = 0
        """The writer: the reader's count as last believed."""

    def close(self) -> None:
        self._mem.release()
        self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- the trainer's side ----------------------------------------------------------------------------------

    def put(self, seq: int, body: bytes) -> bool:
        """Write message ``seq``; False (nothing written) when the ring has no room for it now."""
        need = HEADER.size + _aligned(len(body))
        at = self._pos % self._size
        skip = self._size - at if self._size - at < need else 0
        if skip + need > self._size - (self._pos - self._reader_count()):
            return False
        mem = self._mem
        if skip:
            if skip >= HEADER.size:
                HEADER.pack_into(mem, START + at, seq, WRAP, _crc(seq, WRAP))
            at = 0
        # One slice assignment, header and body: the reader checks both.
        n = len(body)
        mem[START + at:START + at + HEADER.size + n] = HEADER.pack(seq, n, _crc(seq, n, body)) + body
        self._pos += skip + need
        return True

    def unread(self) -> bool:
        """Whether the reader may not have taken every message written."""
        return self._reader_count() != self._pos

    def _reader_count(self) -> int:
        count, crc = READ.unpack_from(self._mem, 0)
        if crc == zlib.crc32(count.to_bytes(8, "little")) and self._read <= count <= self._pos:
            self._read = count
        return self._read

    # -- the persistence process's side ----------------------------------------------------------------------

    def take(self, seq: int) -> bytes | None:
        """The body of message ``seq`` if it is the next entry and whole, else None (not written yet, or not yet
        seen whole: look again later)."""
        mem = self._mem
        at = self._pos % self._size
        skipped = 0
        if self._size - at < HEADER.size:  # no room for a header before the end: the entry is at the start
            skipped, at = self._size - at, 0
        s, n, crc = HEADER.unpack_from(mem, START + at)
        if s != seq:
            return None
        if n == WRAP:
            if crc != _crc(seq, WRAP):
                return None
            skipped, at = skipped + self._size - at, 0
            s, n, crc = HEADER.unpack_from(mem, START)
            if s != seq:
                return None
        if n > self._size - at - HEADER.size:
            return None
        body = bytes(mem[START + at + HEADER.size:START + at + HEADER.size + n])
        if _crc(seq, n, body) != crc:
            return None
        self._pos += skipped + HEADER.size + _aligned(n)
        READ.pack_into(mem, 0, self._pos, zlib.crc32(self._pos.to_bytes(8, "little")))
        return body


SEQ = struct.Struct("<Q")
"""A message by the socket: its sequence number, then its bytes (lowdiff._persist.messages.encode)."""
NAP_S = (0.001, 0.02)
"""The reader's wait on the socket between looks into the mailbox: the shortest (after a message), doubled each
empty look up to the longest. A message in the mailbox is found that much later; nothing waits on it (what must be
seen at once goes by the socket)."""
PARENT_CHECK_S = 1.0
LATE_S = 10.0


class Inbox:
    """The persistence process's reading of the trainer's messages, in their order, from the socket ``conn`` (which
    also carries the mailbox's descriptor: :meth:`open_mailbox`) and the mailbox. ``parent_gone()`` is asked about
    once a second while nothing comes: a trainer whose socket stays open in a process it forked (a DataLoader
    worker) is gone all the same."""

    def __init__(self, conn: Connection, parent_gone: Callable[[], bool]) -> None:
        self.conn = conn
        self.box: Mailbox | None = None
        self._parent_gone = parent_gone
        self._seq = 0
        self._ahead: tuple[int, bytes] | None = None  # a message read from the socket before its turn
        self._gone = False
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def open_mailbox(self, nbytes: int, fd: int) -> None:
        if self.box is not None:
            self.box.close()
        self.box = Mailbox(nbytes, fd)

    def next(self) -> bytes | None:
        """The next message's bytes; None once the trainer is gone and every message it sent has been read."""
        nap = NAP_S[0]
        checked = time.monotonic()
        while True:
            ahead = self._ahead
            if ahead is not None and ahead[0] == self._seq:
                self._ahead = None
                self._seq += 1
                return ahead[1]
            body = self.box.take(self._seq) if self.box is not None else None
            if body is not None:
                self._seq += 1
                return body
            if self._gone:
                # Whatever a dead trainer wrote whole is seen whole now; a message after it (ahead) would mean one
                # that is not, which a single-threaded writer cannot leave.
                return None
            if ahead is not None:  # the next is in the mailbox but not yet seen whole by this core
                if time.monotonic() - checked > LATE_S:
                    raise RuntimeError(f"lowdiff persistence: message {self._seq} did not arrive whole in the "
                                       f"mailbox within {LATE_S:.0f} s though message {ahead[0]} came after it")
                time.sleep(0.0001)
                continue
            if self._poller.poll(nap * 1000):
                try:
                    data = self.conn.recv_bytes()
                except (EOFError, OSError):
                    self._gone = True
                    continue
                self._ahead = (SEQ.unpack_from(data)[0], data[SEQ.size:])
                continue
            nap = min(2 * nap, NAP_S[1])
            if time.monotonic() - checked >= PARENT_CHECK_S:
                checked = time.monotonic()
                self._gone = self._parent_gone()
