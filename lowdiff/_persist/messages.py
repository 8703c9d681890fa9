"""The messages between a trainer and its persistence process (``log.persistence: process``), and their framing.

Both sides import this module: the trainer's :class:`lowdiff._persist.process_writer.ProcessWriter` and the
persistence process (lowdiff/_persist/child.py). A message is a named tuple, encoded whole (:func:`encode`), and
goes into the shared-memory mailbox (lowdiff._persist.mailbox) or by the socket, framed as
``multiprocessing.connection``'s ``recv_bytes`` reads it (:func:`send`). The bytes of a step's tensors never travel
in a message: they are in the shared ring already (lowdiff._transfer.ring), and a message says where.

Call order, trainer to persistence process: :class:`Start` once, then per step :class:`Record` (when ``opt.step()``
returns) and :class:`Seal` (when its iteration ends) or :class:`Drop` (an interrupted iteration); :class:`Rng` when
``opt.capture_rng()`` retakes the RNG state of a record already handed over; :class:`Snapshot` or
:class:`ShadowSnapshot` at snapshot steps; :class:`BatchSteps` to cut a segment; :class:`ArenaFollows` before the
descriptor of a new shared-memory arena; :class:`Flush`; :class:`Close`; :class:`Wake`. :class:`Several` carries a
seal held back to ride with the next message. Back: :class:`Ready` once started, :class:`Freed` slots,
:class:`Status` after every commit, :class:`Failed`, :class:`Flushed`, :class:`Closed`.

On the wire (:func:`encode`) each message is a plain tuple, its kind's index in :data:`KINDS` then its fields: a
named tuple's pickling looks its class up and calls its Python ``__getnewargs__``, which cost a step's hand-over
about 30 us with the caches cold after a training step. A record repeats nothing unchanged since the record before:
its groups (the same encoded list: ``GroupEncoder``) and its RNG state's bytes go as None, and a seal whose groups
are its record's says :data:`AT_STEP`.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from lowdiff._persist import signals

# -- trainer to persistence process -----------------------------------------------------------------------------


class Start(NamedTuple):
    path: str
    shard: tuple[int, int]
    compressor_params: dict[str, Any] | None
    run_id: str | None
    branch: str | None
    writer: dict[str, Any]
    """The writer's settings: batch_steps, codec, compressor, queue_depth, retention, durable_step, when_behind,
    direct_io, remote."""
    shadow: Any
    log_level: int
    trainer_pid: int


class Record(NamedTuple):
    """A step whose ``opt.step()`` returned: its payloads and changed buffers lie packed in ring ``ring_id`` at
    ``offset`` (slot ``aid``), laid out as layout ``layout_id`` (its wire sent once, then None)."""

    step: int
    ring_id: int
    aid: int
    offset: int
    nbytes: int
    layout_id: int
    wire: Any
    rng: dict[str, bytes] | None
    """None: the same bytes as the record before."""
    groups: list[dict[str, Any]] | None
    """None: the same as the record before."""
    data: dict[str, Any]
    skipped: bool
    keep_if_orphaned: bool
    """If the trainer dies before the iteration ends, commit the record as it is (nothing is tracked at its end)."""
    grad_scale: float | None = None
    """StepRecord.grad_scale."""


class Seal(NamedTuple):
    """The iteration of the record handed over last has ended: its final tracked state and groups; ``rng`` only if
    it was taken again after the step (None: as sent)."""

    step: int
    data: dict[str, Any]
    end_groups: list[dict[str, Any]] | str | None
    """:data:`AT_STEP`: the record's own groups."""
    rng: dict[str, bytes] | None


AT_STEP = "at step"
"""Seal.end_groups: unchanged since the record's ``opt.step()``."""


class EndKnown(NamedTuple):
    """The end state of the record handed over last is known before its iteration formally ends (the loop's
    end-of-iteration calls have run): commit the record with it if the trainer dies before the seal."""

    step: int
    data: dict[str, Any]
    end_groups: list[dict[str, Any]]


class Rng(NamedTuple):
    step: int
    rng: dict[str, bytes]


class Drop(NamedTuple):
    step: int


class Snapshot(NamedTuple):
    """A snapshot packed into the snapshot arena: ``skeleton`` is the state with each tensor replaced by its place
    (lowdiff._storage.packed.unpack_skeleton)."""

    step: int
    regions: list[Any]
    places: list[Any]
    skeleton: Any
    rng: dict[str, bytes]
    groups: list[dict[str, Any]]
    compressor_name: str
    extra: dict[str, Any]


class ShadowSnapshot(NamedTuple):
    step: int


class BatchSteps(NamedTuple):
    steps: int


class Flush(NamedTuple):
    token: int


class ArenaFollows(NamedTuple):
    """The descriptor of a new arena follows this message (SCM_RIGHTS): ``kind`` "r" for the record ring, "s" for
    the snapshot arena, "m" for the mailbox (lowdiff._persist.mailbox)."""

    kind: str
    ring_id: int
    nbytes: int


class Close(NamedTuple):
    pass


class Wake(NamedTuple):
    """Nothing to do but look into the mailbox now: the trainer waits for a reply."""


class Several(NamedTuple):
    messages: list[Any]


# -- persistence process to trainer ---------------------------------------------------------------------------


class Ready(NamedTuple):
    pass


class Freed(NamedTuple):
    slots: list[tuple[str, int, int]]
    """(arena kind, ring id, slot id) of each slot given back."""


class Status(NamedTuple):
    durable_step: int
    stats: tuple[Any, ...]
    """The writer's :class:`lowdiff._persist.writer.WriterStats`, as a tuple of its fields."""
    broken: bool
    shadow_ok: bool


class Failed(NamedTuple):
    args: tuple[Any, ...]
    """The arguments of the :class:`lowdiff.errors.CheckpointWriteError` to raise in the trainer."""


class Flushed(NamedTuple):
    token: int


class Closed(NamedTuple):
    pass


# -- framing ------------------------------------------------------------------------------------------------------

KINDS: tuple[type, ...] = (Start, Record, Seal, EndKnown, Rng, Drop, Snapshot, ShadowSnapshot, BatchSteps, Flush,
                           ArenaFollows, Close, Several, Wake, Ready, Freed, Status, Failed, Flushed, Closed)
_INDEX = {kind: i for i, kind in enumerate(KINDS)}
_SEVERAL = _INDEX[Several]


def encode(msg: Any) -> bytes:
    """``msg`` as the bytes :func:`decode` reads: plain tuples, pickled."""
    return pickle.dumps(_plain(msg), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return _typed(pickle.loads(data))


def _plain(msg: Any) -> tuple[Any, ...]:
    if type(msg) is Several:
        return (_SEVERAL, [_plain(x) for x in msg.messages])
    return (_INDEX[type(msg)], *msg)


def _typed(t: tuple[Any, ...]) -> Any:
    if t[0] == _SEVERAL:
        return Several([_typed(x) for x in t[1]])
    return KINDS[t[0]](*t[1:])

_FRAME = struct.Struct("!i")  # multiprocessing.connection's header for a message under 2 GiB (recv_bytes reads it)
_HELD_BACK = {signal.SIGTERM, signal.SIGINT}


def send(conn: Connection, msg: Any, data: bytes | None = None, sent: Callable[[], None] | None = None,
         head: Callable[[], bytes] | None = None) -> None:
    """Send ``msg`` whole, as ``conn.recv_bytes`` on the other end reads it: one ``write`` of header and body;
    ``head()`` (bytes before the body: a sequence number) is taken and ``sent()`` runs once it is through, inside
    the same guard.

    A signal handler that raises in the middle (KeyboardInterrupt, lowdiff's SIGTERM handler after its
    deferrals, a program's own ``sys.exit`` on SIGTERM) must not leave part of a message unsent or sent twice, nor
    a message taken off a queue and never sent (a kill test lost the step whose seal it was): :func:`sending`. A
    program's handler that sends a message itself (a flush on SIGTERM) runs before or after this one, never
    between the number in its head and the write."""
    if data is None:  # else msg as encode() gave it
        data = encode(msg)
    if len(data) >= 1 << 31:
        whole(_send_big, conn, data, sent, head)
    else:
        sending(_write, conn.fileno(), data, sent, head)


def _write(fd: int, data: bytes, sent: Callable[[], None] | None, head: Callable[[], bytes] | None) -> None:
    body = head() + data if head is not None else data
    frame = memoryview(_FRAME.pack(len(body)) + body)
    while len(frame):
        frame = frame[os.write(fd, frame):]
    if sent is not None:
        sent()


def _send_big(conn: Connection, data: bytes, sent: Callable[[], None] | None,
              head: Callable[[], bytes] | None) -> None:
    conn.send_bytes(head() + data if head is not None else data)
    if sent is not None:
        sent()


def sending(io: Callable[..., Any], *args: Any) -> Any:
    """``io(*args)``, which writes a message and counts it as sent, not cut by a signal handler: lowdiff's own
    handlers defer meanwhile (lowdiff/_persist/signals.py); with a handler of the program's own installed, SIGTERM
    and SIGINT are held back instead (:func:`whole`, two system calls)."""
    if threading.current_thread() is not threading.main_thread():
        return io(*args)  # signal handlers run in the main thread only; its flag is not another thread's to clear
    if not signals.only_lowdiffs():
        return whole(io, *args)
    try:
        signals.state.sending = True
        return io(*args)
    finally:
        signals.state.sending = False


def recv(conn: Connection) -> Any:
    """The next message (raises EOFError or OSError when the other end is gone)."""
    return decode(whole(conn.recv_bytes))


def whole(io: Any, *args: Any) -> Any:
    """One message's socket I/O with SIGTERM and SIGINT held back (in the main thread, where their handlers run):
    a handler that raises in the middle (lowdiff's SIGTERM handler after its deferrals, KeyboardInterrupt) would
    leave half a message on the socket, or a message taken off a queue and never sent (a kill test lost the
    step whose seal it was). The signal is handled as soon as the message is through."""
    if threading.current_thread() is not threading.main_thread():
        return io(*args)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_BACK)
    try:
        return io(*args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def rng_bytes(rng: dict[str, Any]) -> dict[str, bytes]:
    """A record's or snapshot's RNG states as a message carries them (the persistence process turns them back into
    tensors): the bytes they were captured as, when the states are still those of a capture."""
    unchanged_raw = getattr(rng, "unchanged_raw", None)  # lowdiff.rng.Captured
    raw = unchanged_raw() if unchanged_raw is not None else None
    if raw is not None:
        return raw
    return {k: v.numpy().tobytes() for k, v in rng.items()}
