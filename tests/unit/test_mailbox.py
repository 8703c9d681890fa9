"""lowdiff._persist.mailbox: the shared-memory ring through which a trainer sends its persistence process the
per-step messages. What the reader takes is what the writer put, in order, nothing lost; a half-written entry, a
stale one from an earlier lap or one not written yet is not taken; the writer refuses a message (and writes
nothing) only when the ring cannot hold it, never overwrites an entry not yet read whatever stands in the read
count, and a message larger than the ring leaves it usable; a writer and a reader in two processes agree."""

from __future__ import annotations

import mmap
import os
import random
import signal
import struct
import sys
import time
import traceback
import zlib
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lowdiff._persist.mailbox import HEADER, MAILBOX_BYTES, START, WRAP, Mailbox

COUNT = struct.Struct("<QI")
"""The reader's count at offset 0, as the module's docstring lays it out: bytes read, then their CRC-32."""


def aligned(n: int) -> int:
    return (n + 7) // 8 * 8


def body_for(seq: int, n: int) -> bytes:
    return random.Random(seq).randbytes(n)


def count_bytes(count: int, crc: int | None = None) -> bytes:
    return COUNT.pack(count, zlib.crc32(count.to_bytes(8, "little")) if crc is None else crc)


@contextmanager
def ring(nbytes: int) -> Iterator[tuple[Mailbox, Mailbox, mmap.mmap]]:
    """A writer, a reader over the same memory, and a third view of it (to look at and to damage)."""
    w = Mailbox(nbytes)
    r = Mailbox(nbytes, fd=os.dup(w.fd))
    raw = mmap.mmap(w.fd, nbytes)
    try:
        yield w, r, raw
    finally:
        raw.close()
        r.close()
        w.close()


def entry_at(raw: mmap.mmap, off: int) -> tuple[int, int, int]:
    return HEADER.unpack_from(raw, START + off)


# -- against a model ---------------------------------------------------------------------------------------------


@settings(max_examples=80, stateful_step_count=60, deadline=None)
class RingModel(RuleBasedStateMachine):
    """Random puts (some landing exactly at the ring's end, or 8, 16 or 24 bytes before it) and takes, against a
    FIFO of what was put. Sequence numbers start at 1 (the trainer's first message, ArenaFollows, goes by the
    socket) and a refused message uses its number up, as the trainer's goes by the socket instead."""

    @initialize(nbytes=st.integers(12, 64).map(lambda k: 8 * k))  # 96..512 bytes
    def open(self, nbytes: int) -> None:
        self.w = Mailbox(nbytes)
        self.r = Mailbox(nbytes, fd=os.dup(self.w.fd))
        self.raw = mmap.mmap(self.w.fd, nbytes)
        self.size = nbytes - START
        self.written = 0  # bytes the writer has used, skipped ends included
        self.read = 0  # the end of the last entry taken
        self.queue: deque[tuple[int, bytes, int, int, bytes]] = deque()  # (seq, body, offset, end, header)
        self.seq = 1

    def teardown(self) -> None:
        if hasattr(self, "w"):
            self.raw.close()
            self.r.close()
            self.w.close()

    def _put(self, n: int) -> None:
        seq, self.seq = self.seq, self.seq + 1
        body = body_for(seq, n)
        need = HEADER.size + aligned(n)
        at = self.written % self.size
        skip = self.size - at if self.size - at < need else 0
        # The ring holds it when, from the reader's position to the new entry's end (what is skipped before the
        # ring's end included), there are no more bytes than the ring has.
        fits = self.written + skip + need - self.read <= self.size
        before = bytes(self.raw)
        ok = self.w.put(seq, body)
        assert ok == fits, (f"put of {n} bytes at offset {at} of {self.size} with {self.written - self.read} unread: "
                            f"{ok}, expected {fits}")
        if not ok:
            assert bytes(self.raw) == before, "a refused put wrote into the ring"
            event("refused, some unread" if self.queue else "refused, all read")
            return
        if skip >= HEADER.size:
            assert entry_at(self.raw, at)[:2] == (seq, WRAP)
        event("a wrap header" if skip >= HEADER.size else "fewer than 16 bytes skipped" if skip else
              "up to the end exactly" if at + need == self.size else "before the end")
        off = (self.written + skip) % self.size
        header = self.raw[START + off:START + off + HEADER.size]
        assert HEADER.unpack(header)[:2] == (seq, n)
        self.queue.append((seq, body, off, self.written + skip + need, header))
        self.written += skip + need

    @rule(n=st.integers(0, 40) | st.integers(0, 300))
    def put(self, n: int) -> None:
        self._put(n)

    @rule(before_end=st.sampled_from([0, 8, 16, 24]), slack=st.integers(0, 7))
    def put_up_to_the_end(self, before_end: int, slack: int) -> None:
        """A body whose entry ends ``before_end`` bytes before the ring's end (0: exactly at it; 8: no room for a
        header after it; 16: just room for a wrap header), ``slack`` bytes short of its 8-byte boundary."""
        room = self.size - self.written % self.size - HEADER.size - before_end
        self._put(max(room - slack, 0))

    @rule()
    def take(self) -> None:
        want = self.queue[0][0] if self.queue else self.seq
        count_before = bytes(self.raw[:COUNT.size])
        got = self.r.take(want)
        if not self.queue:
            assert got is None, f"message {want} taken, never put"
            assert bytes(self.raw[:COUNT.size]) == count_before
            return
        seq, body, _, end, _ = self.queue.popleft()
        assert got == body, f"message {seq}: {len(body)} bytes put, {None if got is None else len(got)} taken"
        self.read = end
        assert bytes(self.raw[:COUNT.size]) == count_bytes(end)

    @rule(ahead=st.integers(1, 3))
    def take_a_later_one(self, ahead: int) -> None:
        """Asking for a message after the next one (the next one went by the socket, say) takes nothing."""
        want = (self.queue[0][0] if self.queue else self.seq) + ahead
        assert self.r.take(want) is None

    @invariant()
    def unread_entries_are_intact(self) -> None:
        if not hasattr(self, "w"):
            return
        for seq, body, off, _, header in self.queue:
            assert self.raw[START + off:START + off + HEADER.size] == header, f"message {seq} overwritten"
            assert self.raw[START + off + HEADER.size:START + off + HEADER.size + len(body)] == body
        assert self.w.unread() == bool(self.queue)


TestRingModel = RingModel.TestCase


@pytest.mark.parametrize("nbytes", [96, 136, 200])
def test_every_offset_and_length(nbytes: int) -> None:
    """From every offset an empty ring's writer can stand at, every length: accepted when it fits before the end,
    or at the start after a wrap (the wrap header, or the few bytes left, before the end); taken whole; the writer
    and the reader in step afterwards."""
    size = nbytes - START
    for at in [0, *range(2 * 8, size, 8)]:  # an entry is 16 bytes at least: nothing ends at 8
        for need in range(HEADER.size, size + 16, 8):
            for slack in (0, 3):
                n = need - HEADER.size - slack
                if n < 0:
                    continue
                with ring(nbytes) as (w, r, raw):
                    if at:
                        assert w.put(1, body_for(1, at - HEADER.size)) and r.take(1) is not None
                    body = body_for(2, n)
                    before = bytes(raw)
                    ok = w.put(2, body)
                    where = f"{n} bytes at offset {at} of {size}"
                    assert ok == (need <= size - at or need <= at), where
                    if not ok:
                        assert bytes(raw) == before and r.take(2) is None, where
                        assert not w.unread()
                        continue
                    off = at if need <= size - at else 0
                    assert entry_at(raw, off)[:2] == (2, n), where
                    if off != at and size - at >= HEADER.size:
                        assert entry_at(raw, at)[:2] == (2, WRAP), where
                    assert w.unread() and r.take(2) == body and not w.unread(), where
                    assert w.put(3, b"") and r.take(3) == b"", where


# -- what must not be taken --------------------------------------------------------------------------------------


def test_a_damaged_body_is_not_taken_until_whole() -> None:
    with ring(256) as (w, r, raw):
        assert r.take(1) is None  # nothing written yet
        body = body_for(1, 40)
        assert w.put(1, body)
        for i in (0, 17, 39):
            raw[START + HEADER.size + i] ^= 0x5A
            assert r.take(1) is None
            assert r.take(1) is None  # looked at again: still not
            raw[START + HEADER.size + i] ^= 0x5A
        assert raw[:COUNT.size] == bytes(COUNT.size)  # nothing taken: no count published
        assert w.unread()
        assert r.take(1) == body
        assert not w.unread()


def test_a_damaged_header_is_not_taken() -> None:
    with ring(256) as (w, r, raw):
        body = body_for(1, 40)
        assert w.put(1, body)
        good = bytes(raw[START:START + HEADER.size])
        right = entry_at(raw, 0)[2]
        for n, crc in [(41, right), (39, right), (40, right ^ 1), (40, right ^ 0x80000000), (1 << 20, right),
                       (WRAP - 1, 0)]:
            HEADER.pack_into(raw, START, 1, n, crc)
            assert r.take(1) is None, (n, crc)
        for n in (256 - START - HEADER.size + 1, 1 << 20):  # past the ring's end, with the CRC of what is there
            HEADER.pack_into(raw, START, 1, n, zlib.crc32(raw[START + HEADER.size:]))
            assert r.take(1) is None, n
        raw[START:START + HEADER.size] = good
        assert r.take(1) == body


def test_a_body_half_written_over_an_old_one_is_not_taken() -> None:
    """The writer's copy part done: the new header and the start of the new body, the rest still the bytes of the
    entry of the earlier lap that stood there."""
    with ring(192) as (w, r, raw):
        old = body_for(1, 96)
        assert w.put(1, old) and r.take(1) == old
        assert w.put(2, b"") and r.take(2) == b""  # 112..128: the next entry goes at the start, over message 1
        before = bytes(raw)
        new = body_for(3, 96)
        assert w.put(3, new)
        after = bytes(raw)
        for done in (HEADER.size, HEADER.size + 8, HEADER.size + 48, HEADER.size + 95):
            raw[:] = before[:START] + after[START:START + done] + before[START + done:]
            assert r.take(3) is None, done
        raw[:] = after
        assert r.take(3) == new


def test_a_stale_entry_of_an_earlier_lap_is_not_taken() -> None:
    with ring(192) as (w, r, raw):  # 128 bytes: four entries of 32
        for seq in range(1, 5):
            assert w.put(seq, body_for(seq, 16))
        for seq in range(1, 5):
            assert r.take(seq) == body_for(seq, 16)
        assert entry_at(raw, 0)[:2] == (1, 16)  # whole, and where the reader looks now
        assert raw[START + HEADER.size:START + 2 * HEADER.size] == body_for(1, 16)
        assert r.take(5) is None
        assert r.take(6) is None
        assert w.put(5, body_for(5, 40)) and r.take(5) == body_for(5, 40)


def test_a_stale_wrap_header_is_not_taken() -> None:
    with ring(192) as (w, r, raw):  # 128 bytes
        assert w.put(1, body_for(1, 80)) and r.take(1) is not None  # 0..96
        assert w.put(2, body_for(2, 32)) and r.take(2) == body_for(2, 32)  # wrap header at 96, the entry 0..48
        assert entry_at(raw, 96)[:2] == (2, WRAP)
        assert w.put(3, body_for(3, 32)) and r.take(3) == body_for(3, 32)  # 48..96
        assert r.take(4) is None  # the reader at 96: the wrap header of message 2, and message 2 at the start
        assert w.put(4, body_for(4, 8)) and r.take(4) == body_for(4, 8)


def test_a_wrap_header_seen_before_its_entry_is_not_taken() -> None:
    with ring(192) as (w, r, raw):
        assert w.put(1, body_for(1, 80)) and r.take(1) is not None  # 0..96
        before = bytes(raw)
        assert w.put(2, body_for(2, 32))  # wrap header at 96, the entry 0..48
        after = bytes(raw)
        raw[:] = before[:START + 96] + after[START + 96:]  # the wrap header seen, the entry not yet
        assert r.take(2) is None
        raw[:] = after
        assert r.take(2) == body_for(2, 32)


def test_zeros_are_not_message_0() -> None:
    """Memory never written (zeros: crc32(b"") == 0) is not an empty message 0."""
    with ring(256) as (_, r, _raw):
        assert r.take(0) is None


@pytest.mark.parametrize(("lap", "n", "at"), [
    ([72, 8, 0, 72], 48, 88),  # message 5's wrap header at 88, over message 2
    ([8, 8, 64, 8], 40, 24),  # message 5 at 24, over message 2
])
def test_a_new_sequence_number_over_an_old_entry_is_not_taken(lap: list[int], n: int, at: int) -> None:
    """The writer's header part written, its sequence number first (``HEADER.pack_into`` stores the fields one by
    one; a weakly ordered core may show the reader any of a copy's stores first): the rest of the header and the
    body still those of a whole entry of the earlier lap."""
    with ring(192) as (w, r, raw):  # 128 bytes
        for seq, m in enumerate(lap, 1):
            assert w.put(seq, body_for(seq, m)) and r.take(seq) == body_for(seq, m)
        assert entry_at(raw, at)[:2] == (2, 8)  # message 2 whole
        assert raw[START + at + HEADER.size:START + at + HEADER.size + 8] == body_for(2, 8)
        before = bytes(raw)
        assert w.put(5, body_for(5, n))
        assert entry_at(raw, at)[0] == 5
        seq_bytes = raw[START + at:START + at + 8]
        raw[:] = before
        raw[START + at:START + at + 8] = seq_bytes
        assert r.take(5) is None


# -- the read count ----------------------------------------------------------------------------------------------


def full_ring(w: Mailbox) -> list[bytes]:
    """Three unread entries of 40 bytes in 128, the writer at 120: no room for another."""
    bodies = [body_for(seq, 24) for seq in (1, 2, 3)]
    for seq, body in enumerate(bodies, 1):
        assert w.put(seq, body)
    assert not w.put(4, body_for(4, 24)) and not w.put(4, b"")
    return bodies


@pytest.mark.parametrize("garbage", [
    count_bytes(120, crc=zlib.crc32((120).to_bytes(8, "little")) ^ 1),  # everything read, but its CRC is wrong
    count_bytes(120, crc=0),
    count_bytes(40)[:8] + count_bytes(120)[8:],  # half of one count, half of another
    count_bytes(160),  # past what was written, its CRC right
    count_bytes(1 << 40),
    count_bytes((1 << 64) - 1),
    b"\xff" * COUNT.size,
])
def test_a_garbage_read_count_frees_nothing(garbage: bytes) -> None:
    with ring(192) as (w, r, raw):
        bodies = full_ring(w)
        before = bytes(raw)
        raw[:COUNT.size] = garbage
        for n in (0, 24, 100):
            assert not w.put(4, body_for(4, n))
        assert w.unread()
        assert raw[COUNT.size:] == before[COUNT.size:]
        raw[:COUNT.size] = before[:COUNT.size]
        for seq, body in enumerate(bodies, 1):
            assert r.take(seq) == body
        assert w.put(4, body_for(4, 24)) and r.take(4) == body_for(4, 24)


def test_a_read_count_is_believed_when_its_crc_matches() -> None:
    with ring(192) as (w, r, raw):
        full_ring(w)
        assert r.take(1) is not None
        assert raw[:COUNT.size] == count_bytes(40)
        assert w.put(4, body_for(4, 24))  # the reader's 40 bytes freed: 8 skipped at the end, 40 at the start
        assert not w.put(5, b"")


def test_a_read_count_never_moves_back() -> None:
    with ring(192) as (w, r, raw):
        bodies = full_ring(w)
        for seq, body in enumerate(bodies, 1):
            assert r.take(seq) == body
        assert not w.unread()  # the writer has seen the count (120)
        raw[:COUNT.size] = count_bytes(0)  # a count it had already passed, its CRC right
        assert not w.unread()
        assert w.put(4, body_for(4, 24)) and r.take(4) == body_for(4, 24)


# -- sizes -------------------------------------------------------------------------------------------------------


def test_a_message_larger_than_the_ring_is_refused_and_the_ring_stays_usable() -> None:
    with ring(192) as (w, r, raw):  # 128 bytes: a body of 112 at most
        before = bytes(raw)
        assert not w.put(1, bytes(113)) and not w.put(1, bytes(1000))
        assert bytes(raw) == before and not w.unread() and r.take(1) is None
        assert w.put(2, body_for(2, 112)) and r.take(2) == body_for(2, 112)  # fills it exactly
        assert w.put(3, body_for(3, 40)) and r.take(3) == body_for(3, 40)  # 0..56
        assert not w.put(4, body_for(4, 113))
        assert not w.put(4, body_for(4, 64))  # 80 bytes: not before the end (72), not before the writer (56)
        assert w.put(5, body_for(5, 33)) and r.take(5) == body_for(5, 33)
    w = Mailbox()
    try:
        assert w.nbytes == MAILBOX_BYTES
        assert not w.put(1, bytes(MAILBOX_BYTES))
        assert w.put(2, b"x") and w.unread()
    finally:
        w.close()


def test_a_too_small_or_unaligned_mailbox_is_refused() -> None:
    for nbytes in (START + 2 * HEADER.size - 8, START + 2 * HEADER.size + 4, 0):
        with pytest.raises(ValueError):
            Mailbox(nbytes)


# -- two processes -----------------------------------------------------------------------------------------------

MESSAGES = 2000
TIMEOUT_S = 30.0


def message(seq: int) -> bytes:
    rng = random.Random(seq)
    return rng.randbytes(rng.choice([0, 1, 7, 8, 9, 24, rng.randrange(400)]))


def _read_all(r: Mailbox, deadline: float) -> int:
    for seq in range(1, MESSAGES + 1):
        looks = 0
        while (got := r.take(seq)) is None:
            looks += 1
            if looks % 64 == 0:
                if time.monotonic() > deadline:
                    print(f"reader: message {seq} never came", file=sys.stderr)
                    return 3
                time.sleep(0.0001)
        if got != message(seq):
            print(f"reader: message {seq} is not what was put", file=sys.stderr)
            return 2
    return 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_writer_and_a_reader_in_two_processes() -> None:
    """The reader starts once the ring is full: from then on the writer waits on the reader's count."""
    w = Mailbox(1024)
    go_r, go_w = os.pipe()
    deadline = time.monotonic() + TIMEOUT_S
    pid = os.fork()
    if pid == 0:  # the reader
        code = 1
        try:
            os.close(go_w)
            os.read(go_r, 1)
            r = Mailbox(1024, fd=os.dup(w.fd))
            code = _read_all(r, deadline)
            r.close()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(go_r)
    status: int | None = None

    def reaped() -> bool:
        nonlocal status
        done, st_ = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st_
        return bool(done)

    refused = 0
    try:
        for seq in range(1, MESSAGES + 1):
            while not w.put(seq, message(seq)):
                if refused == 0:
                    os.write(go_w, b"g")
                refused += 1
                if refused % 64 == 0:
                    if time.monotonic() > deadline or reaped():
                        pytest.fail(f"message {seq} never found room: the reader is stuck or gone")
                    time.sleep(0.0001)
        assert refused > 0, "the ring never filled"
        while not reaped():
            if time.monotonic() > deadline:
                pytest.fail(f"the reader did not finish within {TIMEOUT_S:.0f} s")
            time.sleep(0.005)
    finally:
        os.close(go_w)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        w.close()
    assert os.waitstatus_to_exitcode(status) == 0
