"""The claim of a mirrored run's prefix (``claim.json``, FORMAT.md section 1, 2.6): which run mirrors there.

Two trainers started at once on one empty prefix (a job launched twice) both find it empty at ``wrap()``. Before its
first upload to a prefix that holds no manifest, the mirror (lowdiff/_persist/mirror.py) claims the prefix for its
run: it creates ``claim.json`` there, holding the run id, with a conditional create that fails where the object
exists (S3: ``PutObject`` with ``If-None-Match: *``, s3fs's ``mode="create"``; ``file://``: a hard link of a
written file), then reads the claim back. The run it names mirrors there; the mirror of any other run stops before
it uploads anything. A restart of the same run finds its own claim and goes on; so does every mirror of one run
(under DDP only rank 0's uploads). ``wrap()`` refuses a prefix without a manifest that another run has claimed
(:func:`refuse_claimed`).

A prefix that holds a manifest is not claimed again: the manifest's run id decides there (runs mirrored before
claims existed have none). A store that ignores the condition (some S3-compatible ones) or has no conditional create
(fsspec's default ``mode="create"`` looks first, then writes) lets a second claim replace the first: the read back
then stops whichever mirror reads the other's claim, and where both read their own, the mirror's manifest check
stays the backstop, as before claims.

The claim is not one of the run's files: never listed (:func:`lowdiff._storage.remote.is_mirrored`), pulled,
recorded in ``mirror.json``, nor deleted by the mirror. A resume or ``lowdiff compact`` keeps the run id, and so the
claim. This module does not import lowdiff._storage.remote (which imports it): a store is anything with the
attributes of :class:`ClaimStore`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from lowdiff._storage.format import CLAIM, MANIFEST, TMP_SUFFIX
from lowdiff._storage.manifest import read_manifest
from lowdiff._storage.validate import check_run_id
from lowdiff.errors import CorruptFileError, LowDiffError, RemoteStoreError, RunDirNotFoundError

CLAIM_MAX_BYTES = 4096
"""A larger ``claim.json`` is refused unread (FORMAT.md section 1)."""
EMPTY_READS = 20
"""An empty claim is read again this many times, 0.1 s apart, before it is judged damaged: on a file system without
hard links a claim is created empty, then written (:func:`_create`)."""
UNSUPPORTED_CODES = ("NotImplemented", "501")
"""A store's answers to a conditional create that say it has none (then the claim is written plainly)."""
NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)
"""``link()`` fails so on a file system without hard links (then the claim is created with ``O_EXCL``)."""


class ClaimStore(Protocol):
    """What of :class:`lowdiff._storage.remote.Store` a claim uses."""

    url: str
    root: str
    local: bool
    fs: Any
    request_s: float | None


class Claim(NamedTuple):
    run_id: str
    by: str
    """Informational: ``pid N on HOST`` of the process that claimed the prefix (may be empty)."""


def claimant(store: ClaimStore) -> Claim | None:
    """The claim under ``store``'s prefix (None: none). Raises :class:`CorruptFileError` naming the object's URL
    when it is not a claim."""
    where = f"{store.url}/{CLAIM}"
    for _ in range(EMPTY_READS):
        try:
            data = store.fs.cat_file(f"{store.root}/{CLAIM}", start=0, end=CLAIM_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        if data:
            break
        time.sleep(0.1)  # empty: being written, on a file system without hard links (:func:`_create`)
    fix = (f"delete it if no trainer mirrors to {store.url} (the mirror of the next wrap() there claims the prefix "
           "again)")
    if len(data) > CLAIM_MAX_BYTES:
        raise CorruptFileError(f"{where}: over {CLAIM_MAX_BYTES} bytes, not a lowdiff claim; {fix}")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptFileError(f"{where}: not valid JSON ({type(e).__name__}), not a lowdiff claim; {fix}") from e
    run_id = check_run_id(doc.get("run_id"), where) if isinstance(doc, dict) else None
    if run_id is None:
        raise CorruptFileError(f"{where}: names no run id, not a lowdiff claim; {fix}")
    by = doc.get("by")
    return Claim(run_id, by[:200] if isinstance(by, str) else "")


def claim(store: ClaimStore, run_id: str) -> Claim:
    """Claim ``store``'s prefix for ``run_id`` unless it is claimed; returns the claim there afterwards: this run's,
    or the one that was there first (on a store that ignores the condition, possibly the one written last).
    Exceptions of the store (it does not answer) pass through: the mirror retries."""
    there = claimant(store)
    if there is not None:
        return there
    body = json.dumps({"run_id": run_id, "by": f"pid {os.getpid()} on {socket.gethostname()}"}).encode()
    with contextlib.suppress(FileExistsError):
        _create(store, f"{store.root}/{CLAIM}", body)
    there = claimant(store)
    if there is None:  # deleted at once (by hand): the mirror's next pass claims again
        raise FileNotFoundError(f"{store.url}/{CLAIM} went away right after it was created")
    return there


def _create(store: ClaimStore, path: str, body: bytes) -> None:
    """Write ``body`` as ``path`` unless it exists (:class:`FileExistsError`), whole when visible."""
    if store.local:
        store.fs.makedirs(store.root, exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        store.fs.pipe_file(tmp, body)
        try:
            os.link(tmp, path)  # fails where the name exists
        except OSError as e:
            if e.errno not in NO_LINKS:
                raise
            with open(path, "xb") as f:  # a file system without hard links: exclusive, though empty for a moment
                f.write(body)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return
    timeout = {} if store.request_s is None else {"timeout": store.request_s}  # an AsyncFileSystem's bound
    try:
        store.fs.pipe_file(path, body, mode="create", **timeout)
    except FileExistsError:
        raise
    except Exception as e:
        code = _code(e)
        if code in ("PreconditionFailed", "412"):  # a 412 s3fs did not recognise (no Condition in the answer)
            raise FileExistsError(str(e)) from e
        if not (isinstance(e, (TypeError, NotImplementedError)) or type(e).__name__ == "ParamValidationError"
                or code in UNSUPPORTED_CODES or (isinstance(e, OSError) and e.errno == errno.ENOSYS)):
            raise  # the store does not answer, or a conflict with a concurrent create (AWS's 409): retried
        store.fs.pipe_file(path, body, **timeout)  # no conditional create there: no worse than without a claim


def _code(e: BaseException) -> str | None:
    """The error code of a store's answer behind ``e`` (botocore's ``response``, also as s3fs's cause)."""
    for x in (e, e.__cause__):
        response = getattr(x, "response", None)
        if isinstance(response, dict):
            return str((response.get("Error") or {}).get("Code"))
    return None


def other_run(store: ClaimStore, there: Claim, root: Path, ours: str | None) -> RemoteStoreError:
    """The error for a prefix claimed by another run than ``ours`` (the run in ``root``; None: a new run)."""
    by = f", {there.by}" if there.by else ""
    mine = (f"{root} (run id {ours})" if ours else f"the run in {root} (written before run ids)"
            if (root / MANIFEST).exists() else f"the new run in {root}")
    return RemoteStoreError(
        f"{store.url} is claimed by another run (run id {there.run_id}{by}) than {mine}: another trainer started "
        "on that prefix while it was empty, and claimed it first (a job launched twice?). Nothing of this run is "
        "uploaded there; point remote.url at a prefix of this run's own, or, if no trainer mirrors there (one "
        f"stopped before its first manifest went up), delete {store.url}/{CLAIM}")


def refuse_claimed(store: ClaimStore, root: Path) -> None:
    """At ``wrap()``, on a prefix holding no manifest: refuse it where another run than the one in ``root`` claimed
    it (its trainer has not uploaded its manifest yet, or stopped before it did). A damaged claim raises
    :class:`CorruptFileError`; one that cannot be read is, as a store that cannot be listed, refused for a new run
    and left to the mirror (which claims before its first upload) for a local run."""
    try:
        there = claimant(store)
    except LowDiffError:
        raise
    except Exception as e:
        if (root / MANIFEST).exists():
            return
        raise RemoteStoreError(f"cannot read {store.url}/{CLAIM} ({e}), and {root} holds no run: starting a new "
                               "run could mirror into a prefix another trainer claimed. Fix the store's endpoint or "
                               "credentials, or leave remote.url unset to train without the mirror") from e
    if there is None:
        return
    try:
        ours = read_manifest(root).run_id
    except RunDirNotFoundError:
        ours = None
    if there.run_id != ours:
        raise other_run(store, there, root, ours)
