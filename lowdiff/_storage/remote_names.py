"""A remote run's files named by their URLs in what recovery says about them (``lowdiff.recover(url)``).

Recovery reads a remote run :func:`~lowdiff._storage.remote.fetched` into a temporary directory, removed once it
returns: the files it stepped around (``report.skipped``, ``summary()``, the command line's output), its log lines
and its errors name them in the bucket instead, where the user can look at them or remove them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from lowdiff._storage.remote import name_remote
from lowdiff.errors import LowDiffError


@contextlib.contextmanager
def naming_remote(local: Path, url: str, logger: logging.Logger,
                  said: set[str] | None = None) -> Iterator[Callable[[str], str]]:
    """While recovery reads the run fetched into ``local``: ``logger``'s lines and a :class:`LowDiffError` leaving
    the block name ``url`` instead of ``local``; yields that renaming for other texts (a report's). ``said``: the
    lines already logged by an earlier read of the same run (a second fetch), not logged again."""
    here, there = str(local), url.rstrip("/")

    def rename(text: str) -> str:
        return text.replace(here, there)

    def renamed(record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if here not in msg:
            return True
        record.msg, record.args = rename(msg), None
        if said is not None:
            if record.msg in said:
                return False
            said.add(record.msg)
        return True

    logger.addFilter(renamed)
    try:
        yield rename
    except LowDiffError as e:
        name_remote(e, local, url)
        raise
    finally:
        logger.removeFilter(renamed)
