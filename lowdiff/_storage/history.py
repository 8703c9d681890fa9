"""The histories of a run (format 2.4): which steps the files of each one may hold.

A resume that goes back (``resume(at="snapshot")``, or past a damaged file) moves every file holding a later step to
``quarantine/`` and continues from there, so the run directory then holds one history made of pieces: the first
history up to the step the resume went back to, then the resumed one. Each resume starts a *branch*: an id of its
own, stamped into every file it writes (``branch`` in the file's metadata; files of the run's first history carry
none), and recorded in the manifest's ``history`` with the step it resumed from. A file of a branch may hold only
the states that branch produced or started from; a file of a discarded history (put back from ``quarantine/``, a
restored backup) is then refused even when it holds no step a file of the current history holds, which the two
-segments-one-step check (lowdiff._storage.log_reader) cannot see (docs/reference/FORMAT.md sections 2 and 8).

A history is a list of ``(branch id, step)``, oldest first, steps not decreasing. Branch ``None`` (the first
history) starts at step 0; each branch's span ends where the next one starts: branch k may hold the states of
steps ``start_k .. start_{k+1}``, the first one shared with the branch before it (the state it resumed from; a
resume may write that step's snapshot again, as one on another number of ``fully_shard`` ranks does). A branch
that resumed at step 0 and wrote snapshot 0 again with other contents (weights loaded after ``wrap()``) starts at
``-1`` once that snapshot is written (:func:`own_step_zero`): the state at step 0 is then its own, and the old
snapshot 0 restored from a backup no longer belongs.
"""

from __future__ import annotations

import re
from typing import Any

from lowdiff.errors import CorruptFileError

History = list[tuple[str, int]]
ID_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_BRANCHES = 1 << 20
"""A run resumed more often than this has a damaged manifest (each resume adds one entry of ~50 bytes)."""


def span(history: History, branch: str | None) -> tuple[int, int | None] | None:
    """The steps whose states files of ``branch`` may hold: (first, last), last None while the branch is current;
    None when ``branch`` is not in this history (a history a resume discarded)."""
    starts: list[tuple[str | None, int]] = [(None, 0), *history]
    for i, (b, first) in enumerate(starts):
        if b == branch:
            return first, starts[i + 1][1] if i + 1 < len(starts) else None
    return None


def current(history: History) -> str | None:
    """The branch new files are stamped with."""
    return history[-1][0] if history else None


def at_step(history: History, step: int) -> str | None:
    """The branch whose span holds the state of ``step``, the newest where two do (for a file written afterwards
    holding that state: a compaction's snapshot)."""
    out: str | None = None
    for b, first in history:
        if first <= step:
            out = b
    return out


def descends(newer: History, older: History) -> bool:
    """Whether ``newer`` is ``older`` resumed since, once or more. Each resume keeps the entries up to its step and
    appends its own (:func:`resumed`), so the first entry of ``newer`` that ``older`` lacks is a resume since,
    and what comes before it is exactly ``older``'s entries up to that resume's step, also when that resume went
    back past the start of ``older``'s current branch (and dropped it). Not when both resumed on their own, except
    where no history can tell that from one resume going back past the other's start (the earlier step counts as
    the later resume)."""
    known = {tuple(e) for e in older}
    for i, (branch, step) in enumerate(newer):
        if (branch, step) not in known:
            return [tuple(e) for e in newer[:i]] == [tuple(e) for e in older if e[1] <= step]
    return False


def resumed(history: History, branch: str, step: int) -> History:
    """``history`` once a resume from the state of ``step`` starts ``branch``: the branches that started after
    ``step`` are discarded with the files the resume moved aside."""
    return [(b, s) for b, s in history if s <= step] + [(branch, step)]


def own_step_zero(history: History, branch: str) -> History | None:
    """``history`` once ``branch`` (resumed at step 0) has written snapshot 0 again: it starts at -1, so the step-0
    state of every branch before it stops belonging. None: ``branch`` is not the current one resumed at step 0."""
    if not history or history[-1] != (branch, 0):
        return None
    return [(b, -1 if s == 0 else s) for b, s in history]


def check(value: Any, where: str) -> History:
    """The manifest's ``history`` as stored (absent: the run was never resumed by a 2.4 writer)."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_BRANCHES:
        raise CorruptFileError(f"{where}: history must be a list of [branch, step] pairs")
    out: History = []
    seen: set[str] = set()
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and ID_RE.match(item[0])
                and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= -1):
            raise CorruptFileError(f"{where}: invalid history entry {str(item)[:80]} (expected [32 hex digits, "
                                   "step >= -1])")
        branch, step = item
        if branch in seen or (out and step < out[-1][1]):
            raise CorruptFileError(f"{where}: history entry {str(item)[:80]} repeats a branch or goes back in steps")
        seen.add(branch)
        out.append((branch, step))
    return out


def check_id(value: Any, where: str, what: str) -> str | None:
    """A 128-bit id as stored (the run's, a branch's): 32 lowercase hexadecimal digits; None when absent."""
    if value is None:
        return None
    if not isinstance(value, str) or not ID_RE.match(value):
        raise CorruptFileError(f"{where}: invalid {what} {str(value)[:40]!r} (expected 32 hex digits)")
    return value
