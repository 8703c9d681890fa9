"""A remote run's files named by their URLs in what recovery says about them (``lowdiff.recover(url)``).

Recovery reads a remote run :func:`~lowdiff._storage.remote.fetched` into a temporary directory, removed once it
returns: the files it stepped around (``report.skipped``, ``summary()``, the command line's output), its log lines
and its errors name them in the bucket instead, where the user can look at them or remove them. A file set of a
run trained on several ranks that lacks a shard in the bucket (an upload that never happened) is stepped around as
on a local disk, and said too (:func:`missing_shards`): locally that is a rank that died before its commit, in a
bucket a loss the user should know of.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from lowdiff._storage.format import LOG_DIR, SNAPSHOT_DIR, Shard, segment_name, snapshot_name
from lowdiff._storage.remote import complete, file_sets, name_remote
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


def listing(select: Callable[[Iterable[str]], set[str]] | None, into: list[str]) -> Callable[[Iterable[str]], set[str]]:
    """What :func:`~lowdiff._storage.remote.pull` fetches with ``select`` (None: every file), keeping the names it
    picks from (the remote run's listing) in ``into``."""
    def pick(names: Iterable[str]) -> set[str]:
        into[:] = list(names)
        return set(into) if select is None else select(into)
    return pick


def missing_shards(names: Iterable[str], url: str, after: int, upto: int | None, logger: logging.Logger) -> list[str]:
    """Of a remote run's ``names``, the shards missing from the incomplete file sets a recovery from the snapshot
    of step ``after`` to step ``upto`` (None: the newest) would have read: one line each, naming the object by its
    URL, also logged."""
    snaps, segs = file_sets(names)
    found = [(s, s, sets, True) for s, sets in snaps.items()] + [(a, b, sets, False) for (a, b), sets in segs.items()]
    whole = max((last for _, last, sets, _ in found if complete(sets)), default=-1)
    out = []
    for first, last, sets, is_snapshot in sorted(found, key=lambda f: (f[1], not f[3])):
        if complete(sets) or last <= after or (upto is not None and first > upto):
            continue
        # Past every whole set: the run's newest files, which a live or stopped run's other rank had not committed
        # (or the mirror not uploaded) when the bucket was last written, as often as they were lost.
        newest = last > whole
        why = ("the run's newest steps: not committed by every rank or not uploaded yet when the bucket was last "
               "written, or lost" if newest else "an upload that never happened, or an object deleted")
        for count, have in sorted(sets.items()):
            for i in sorted(set(range(count)) - have):
                name = (f"{SNAPSHOT_DIR}/{snapshot_name(first, Shard(i, count))}" if is_snapshot
                        else f"{LOG_DIR}/{segment_name(first, last, Shard(i, count))}")
                out.append(f"{url.rstrip('/')}/{name}: missing, while {len(have)} other shard(s) of its {count}-shard "
                           f"set are in the bucket ({why})")
                logger.log(logging.INFO if newest else logging.WARNING, "recovery: %s; stepping around that set",
                           out[-1])
    return out
