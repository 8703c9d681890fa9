"""One trainer's persistence process and the socket to it: starting it, sending messages, and what its replies say
(the durable step, the writer's counters, a failure, whether it is alive). What to send and the shared memory the
messages point into are :class:`lowdiff._persist.process_writer.ProcessWriter`'s.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path
from typing import Any

from lowdiff._persist import messages as m
from lowdiff._persist.mailbox import SEQ, Mailbox
from lowdiff._persist.writer import WriterStats
from lowdiff._storage.lock import take_persistence_lock
from lowdiff._storage.run_dir import RunDir
from lowdiff.errors import CheckpointWriteError

log = logging.getLogger("lowdiff._persist.process_writer")

BY_SOCKET = (m.ArenaFollows, m.Flush, m.Close, m.Wake)
"""Messages the persistence process must see at once (the others go into the mailbox when they fit)."""


class Channel:
    """Started with the :class:`~lowdiff._persist.messages.Start` message's fields. ``on_freed`` receives the slots
    each :class:`~lowdiff._persist.messages.Freed` gives back; ``before_wait`` runs before every wait for a reply
    (the writer sends what it holds back then)."""

    def __init__(self, run_dir: RunDir, start: m.Start, *, on_freed: Callable[[list[tuple[str, int, int]]], None],
                 before_wait: Callable[[], None]) -> None:
        self.run_dir = run_dir
        self.stats = WriterStats()
        self.durable_step = start.writer["durable_step"]
        self.shadow_ok = start.shadow is not None
        self.ready = False
        """The persistence process has started (imported torch) and answers."""
        self.dead = False
        self.closed = False
        self.flushed = -1
        self._on_freed = on_freed
        self._before_wait = before_wait
        self._error: BaseException | None = None
        self._reported = False
        self._broken = False
        self._death_recorded = False
        self._outbox: Any = None  # a message that rides with the next one
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the child imports this very lowdiff
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        t0 = time.perf_counter()
        # The child inherits the lock on persist-RANK.lock and holds it until it exits: a trainer restarted on this
        # run directory waits for it (lowdiff._storage.lock.wait_for_persistence).
        lock_fd = take_persistence_lock(run_dir.path, run_dir.shard.index)
        try:
            # In a session of its own: a signal to the trainer's process group (torchrun's SIGTERM and SIGKILL to
            # the other ranks when one fails, a Ctrl-C, a terminal's SIGHUP) does not reach it, even while it is
            # still importing torch, before it ignores SIGTERM.
            self.proc = subprocess.Popen([sys.executable, "-m", "lowdiff._persist.child", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(), lock_fd), env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(lock_fd)
        theirs.close()
        self.conn = Connection(ours.detach())
        # Replies are looked for once per step: one poll(2) on a poller kept for it (Connection.poll builds a
        # selector per call).
        self._replies = select.poll()
        self._replies.register(self.conn.fileno(), select.POLLIN)
        m.send(self.conn, start)
        self._seq = 0  # of the messages after Start, by either way
        self._box: Mailbox | None = None
        box = Mailbox()
        self.send_arena("m", 0, box.fd, box.nbytes)
        self._box = box
        self.start_s = time.perf_counter() - t0
        log.info("lowdiff: persistence process pid %d started for %s", self.proc.pid, run_dir.path)

    # -- errors ----------------------------------------------------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        return self._error if self._broken else None

    def take_error(self) -> BaseException | None:
        self.drain()
        if self._error is None or self._reported:
            return None
        self._reported = True
        return self._error

    def died(self) -> None:
        """Record the persistence process's death, once: reported at the next step, flush or close, unless an error
        it sent is still to be reported (that one says why). An error reported before it died does not stand in for
        its death: steps after it were silently not logged when it did (an adversarial probe: ENOSPC raised once,
        then the process killed, and training went on with flush() and close() returning normally)."""
        self.dead = True
        if self.closed or self._death_recorded:
            return
        self._death_recorded = True
        if self._broken and self._error is not None and not self._reported:
            return
        code = self.proc.poll()
        self._error = CheckpointWriteError(f"the lowdiff persistence process (pid {self.proc.pid}) of "
                                           f"{self.run_dir.path} exited (status {code}); steps after "
                                           f"{self.durable_step} are not on disk. Resume from the run directory")
        self._reported, self._broken = False, True

    # -- messages --------------------------------------------------------------------------------------------

    def send(self, msg: Any, wake: bool = False) -> None:
        """Send ``msg`` (with the message held back, if any): into the mailbox (lowdiff._persist.mailbox), or by
        the socket when it must be seen at once (:data:`BY_SOCKET`, ``wake``: the ring is about to fill, and the
        persistence process frees its slots only once it has seen their records) or does not fit now. A dead
        persistence process is recorded (raised by the next ``take_error``), not raised. Replies are read once per
        step (``take_error``) and while waiting, not before every send (a poll per message cost more than the
        send)."""
        if self.dead:
            self.died()
            return
        by_socket = wake or type(msg) in BY_SOCKET or self._box is None
        if self._outbox is not None:
            msg = m.Several([self._outbox, msg])
        data = m.encode(msg)  # may raise (a Ctrl-C while a value's copy is awaited): the held message stays held
        self._outbox = None
        if not by_socket and m.sending(self._put, data):
            return
        try:
            m.send(self.conn, msg, data, sent=self._sent, head=self._head)
        except OSError:
            self.died()

    def _put(self, data: bytes) -> bool:
        """Into the mailbox, the sequence number counted with it (lowdiff's signal handlers deferred meanwhile: a
        handler raising between the two would send the next message with a number already used)."""
        assert self._box is not None
        if not self._box.put(self._seq, data):
            return False
        self._seq += 1
        return True

    def _head(self) -> bytes:
        return SEQ.pack(self._seq)  # taken inside the send's guard (messages.send), as _put takes it

    def _sent(self) -> None:
        self._seq += 1

    def hold(self, msg: Any) -> None:
        """Send ``msg`` with the next message (or before the next wait): one message per step instead of two."""
        self.push()  # one held at a time: an earlier one goes first
        self._outbox = msg

    def push(self) -> None:
        """Send the message held back, now."""
        if self._outbox is not None:
            msg, self._outbox = self._outbox, None
            try:
                self.send(msg)
            except BaseException:  # not sent (encoding it raised: a Ctrl-C while a value's copy is awaited)
                if self._outbox is None:
                    self._outbox = msg  # held still, as send() keeps a held message it could not encode
                raise

    def send_arena(self, kind: str, ring_id: int, fd: int, nbytes: int) -> None:
        """A new shared-memory arena: the message, then its descriptor. One masked stretch: a SIGINT between the
        two would leave the child reading the next message as the descriptor."""
        m.whole(self._send_arena, kind, ring_id, fd, nbytes)

    def wake(self) -> None:
        """Have the persistence process look into the mailbox now (it looks by itself every few milliseconds)."""
        if self._box is not None and self._box.unread():
            self.send(m.Wake())

    def _send_arena(self, kind: str, ring_id: int, fd: int, nbytes: int) -> None:
        self.send(m.ArenaFollows(kind, ring_id, nbytes))
        if self.dead:
            return
        try:
            send_handle(self.conn, fd, self.proc.pid)
        except OSError:  # the process died meanwhile: recorded, raised by the next take_error as any death
            self.died()

    def drain(self) -> None:
        """Read the replies already there, without waiting."""
        while not self.dead and not self.closed and self._replies.poll(0):
            self.recv(block=False)

    def wait(self, done: Callable[[], bool]) -> bool:
        """Handle replies until ``done()``; False when the persistence process died first (recorded)."""
        self._before_wait()
        self.push()
        while not done():
            if self.dead:
                self.died()
                return False
            self.recv(block=True)
        return True

    def recv(self, block: bool) -> None:
        try:
            if block:
                self.wake()  # the persistence process may not have looked into the mailbox yet
                self.conn.poll(None)  # waiting may be interrupted (Ctrl-C, SIGTERM); reading a message may not
            msg = m.recv(self.conn)
        except (EOFError, OSError):
            self.died()
            return
        match msg:
            case m.Freed(slots):
                self._on_freed(slots)
            case m.Status(durable, fields, broken, shadow_ok):
                self.durable_step = max(self.durable_step, durable)
                blocked = self.stats.blocked_s
                self.stats = WriterStats(*fields)
                self.stats.blocked_s = blocked
                self._broken = broken
                self.shadow_ok = shadow_ok
            case m.Failed(args):
                self._error, self._reported, self._broken = CheckpointWriteError(*args), False, True
            case m.Flushed(token):
                self.flushed = token
            case m.Ready():
                self.ready = True
            case m.Closed():
                self.dead = True

    def shut(self) -> None:
        """Close the socket and reap the process once it has been told to close, or is gone. One that was not (a
        ``close()`` cut short by a Ctrl-C, or by an error of its own that did not end it) commits what it was handed,
        as when its trainer dies, once it has the run directory's lock, which this process gives back after this:
        it is not waited for here (both would wait, the trainer for its exit and it for the lock, until it gave up
        after ``ORPHAN_LOCK_WAIT_S`` without committing). A later ``wrap()`` of the run waits for it."""
        self.closed = True
        self.conn.close()
        if self._box is not None:
            self._box.close()
        if not self.dead:
            log.warning("lowdiff: closing %s was cut short: its persistence process (pid %d) commits the steps it "
                        "was handed in the background (a resume waits for it)", self.run_dir.path, self.proc.pid)
            threading.Thread(target=self.proc.wait, name="lowdiff-reap", daemon=True).start()
            return
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.error("lowdiff: persistence process pid %d did not exit; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait()
