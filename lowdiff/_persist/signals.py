"""What lowdiff's signal handlers (lowdiff/_training/lifecycle.py) must know about the code they must not cut.

A message to the persistence process is written with plain ``os.write`` calls, or into the shared-memory mailbox
(lowdiff._persist.mailbox): a handler that raised between a write and the bookkeeping of how much it wrote (or of
the message's sequence number) would leave part of the message to be sent twice or a number used twice (the
persistence process then reads garbage, or waits for a message that never comes), and one that raised before the
write would leave it unsent. While :data:`state`
says a message is being sent, lowdiff's own handlers defer; when a handler of the program's own is installed for
SIGTERM or SIGINT, sends hold both signals back instead (``pthread_sigmask``, two system calls a message).
"""

from __future__ import annotations

import _signal
from typing import Any

HANDLERS: set[Any] = set()
"""lowdiff's own Python-level handlers (registered by lowdiff._training.lifecycle as it installs them)."""


class _State:
    sending = False


state = _State()


def only_lowdiffs() -> bool:
    """No Python-level handler but lowdiff's is installed for SIGTERM or SIGINT (SIG_DFL and SIG_IGN raise
    nothing). Asked of ``_signal`` itself: ``signal.getsignal`` turns SIG_DFL and SIG_IGN into enum members, which
    cost more than the rest of a message's send (it runs once a message, every step)."""
    for sig in _WATCHED:
        h = _signal.getsignal(sig)
        if callable(h) and h not in HANDLERS:
            return False
    return True


_WATCHED = (int(_signal.SIGTERM), int(_signal.SIGINT))


def handler(sig: int) -> Any:
    """``signal.getsignal(sig)`` without its enum conversion of SIG_DFL and SIG_IGN (asked every step)."""
    return _signal.getsignal(int(sig))
