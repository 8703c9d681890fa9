"""lowdiff._persist.mailbox.Inbox: the persistence process's reading of the trainer's messages from the socket and
the mailbox together. Messages come back in sequence order whichever way each went; a socket message that overtook
a mailbox entry not yet written waits for it; when the trainer is gone, every whole entry left in the mailbox is
still read before the end is said; a re-parented reader (the trainer's socket held open by a forked process) ends
too; a descriptor handed over after an ArenaFollows is received, or the wait for it ends with its trainer."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

import pytest

from lowdiff._persist.child import descriptor
from lowdiff._persist.mailbox import SEQ, Inbox, Mailbox


@contextmanager
def pair(parent_gone: bool = False) -> Iterator[tuple[Connection, Mailbox, Inbox]]:
    """The trainer's socket end and mailbox, and the persistence process's inbox over the other end and the same
    memory."""
    ours, theirs = socket.socketpair()
    trainer = Connection(ours.detach())
    box = Mailbox(4096)
    inbox = Inbox(Connection(theirs.detach()), lambda: parent_gone)
    inbox.open_mailbox(box.nbytes, os.dup(box.fd))  # the same memory file (one process: no descriptor to pass)
    try:
        yield trainer, box, inbox
    finally:
        trainer.close()
        inbox.conn.close()
        box.close()


def by_socket(conn: Connection, seq: int, body: bytes) -> None:
    conn.send_bytes(SEQ.pack(seq) + body)


def test_both_ways_come_back_in_sequence_order() -> None:
    rng = random.Random(7)
    with pair() as (trainer, box, inbox):
        sent = []
        for seq in range(400):
            body = rng.randbytes(rng.randrange(0, 300))
            if rng.random() < 0.3 or not box.put(seq, body):
                by_socket(trainer, seq, body)
            sent.append(body)
            if rng.random() < 0.5:  # the reader keeps up at times, falls behind at others
                while len(sent) > 0 and rng.random() < 0.8:
                    assert inbox.next() == sent.pop(0)
        while sent:
            assert inbox.next() == sent.pop(0)


def test_a_socket_message_waits_for_the_mailbox_entry_before_it() -> None:
    """Message 1 by the socket arrives first; message 0 appears in the mailbox only later (a core that does not see
    the entry whole yet): 0 comes back first, then 1."""
    with pair() as (trainer, box, inbox):
        by_socket(trainer, 1, b"second")
        late = threading.Timer(0.2, lambda: box.put(0, b"first"))
        late.start()
        t0 = time.monotonic()
        assert inbox.next() == b"first"
        assert time.monotonic() - t0 >= 0.15
        assert inbox.next() == b"second"
        late.join()


def test_entries_left_in_the_mailbox_are_read_after_the_trainer_is_gone() -> None:
    with pair() as (trainer, box, inbox):
        for seq in range(5):
            assert box.put(seq, bytes([seq]) * 10)
        by_socket(trainer, 5, b"by the socket")
        assert box.put(6, b"last")
        trainer.close()  # end of file: the trainer is gone
        got = []
        while (body := inbox.next()) is not None:
            got.append(body)
        assert got == [bytes([s]) * 10 for s in range(5)] + [b"by the socket", b"last"]
        assert inbox.next() is None


def test_nothing_sent_and_the_trainer_gone_ends_at_once() -> None:
    with pair() as (trainer, _, inbox):
        trainer.close()
        t0 = time.monotonic()
        assert inbox.next() is None
        assert time.monotonic() - t0 < 1.0


def test_a_reparented_reader_ends_though_the_socket_stays_open() -> None:
    """A DataLoader worker forked by the trainer still holds its end of the socket: no end of file comes; the
    parent check (asked after a second without messages) ends the session, after the entries left."""
    with pair(parent_gone=True) as (_trainer, box, inbox):
        assert box.put(0, b"kept")
        assert inbox.next() == b"kept"
        t0 = time.monotonic()
        assert inbox.next() is None
        assert 0.9 <= time.monotonic() - t0 < 5.0


def test_an_entry_written_just_before_the_trainer_died_is_read() -> None:
    """The trainer writes its last entry and dies while the reader waits on the socket: the end of file wakes the
    reader, which must still look into the mailbox once more before it says the end."""
    with pair() as (trainer, box, inbox):

        def last_step_then_death() -> None:
            assert box.put(0, b"last step")
            trainer.close()

        t = threading.Timer(0.05, last_step_then_death)
        t.start()
        assert inbox.next() == b"last step"
        assert inbox.next() is None
        t.join()


def test_a_descriptor_handed_over_is_received() -> None:
    ours, theirs = socket.socketpair()
    trainer, reader = Connection(ours.detach()), Connection(theirs.detach())
    r, w = os.pipe()
    try:
        send_handle(trainer, w, os.getpid())
        fd = descriptor(reader, lambda: False)
        os.write(fd, b"x")
        assert os.read(r, 1) == b"x"
        os.close(fd)
    finally:
        for f in (r, w):
            os.close(f)
        trainer.close()
        reader.close()


def test_a_trainer_gone_before_its_descriptor_ends_the_wait() -> None:
    """Killed between an ArenaFollows and its descriptor, with its socket held open by a process it forked: before,
    the persistence process waited in recv_handle for ever (holding its lock: a restart waited for it, then
    refused). Now the parent check ends it; end of file does at once."""
    ours, theirs = socket.socketpair()
    trainer, reader = Connection(ours.detach()), Connection(theirs.detach())
    try:
        t0 = time.monotonic()
        with pytest.raises(EOFError):
            descriptor(reader, lambda: True)
        assert time.monotonic() - t0 < 5.0
        trainer.close()
        with pytest.raises((EOFError, OSError)):
            descriptor(reader, lambda: False)
    finally:
        trainer.close()
        reader.close()
