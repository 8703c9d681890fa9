"""Local against remote at ``wrap()`` (``remote.url``; docs/guide/durability.md): which copy of the run a trainer
continues when its run directory, the remote prefix, or both hold the run.

Where only the remote holds it (a new machine) it is pulled; where both hold it, the newer wins and the older
local files are moved to ``quarantine/``, never deleted; a remote holding (or, without a manifest, claimed by)
another run is refused. Two rules keep that sound against what else a bucket may hold and against a store that
fails meanwhile:

- **What the bucket reaches** is judged by its complete file sets (:func:`~lowdiff._storage.remote.reach`), and a
  file holding a step after the local run's newest counts only once it has been fetched and its metadata read as
  recovery reads it (:func:`vouched_reach`; run id, branch, steps, metadata CRC: not the tensor data): an object
  that is not the run's (another run's file, or anything named like one of its files) never makes the bucket look
  newer than a local run it would then replace.
- **A pull** goes into ``RUN_DIR/.pulling-*/`` first (:func:`pull_in`); only once it is whole are the local files
  moved aside and the pulled ones moved in (renames on one file system). A pull that fails leaves the run
  directory as it was, and the error says so and what to do.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from lowdiff._storage import history
from lowdiff._storage.format import LOG_DIR, MANIFEST, SNAPSHOT_DIR, FileSet, list_segments, list_snapshots
from lowdiff._storage.layout import for_files
from lowdiff._storage.manifest import read_manifest
from lowdiff._storage.remote import (
    RECORD,
    Store,
    local_files,
    newest_step,
    pull,
    reach,
    remote_manifest,
    step_key,
)
from lowdiff._storage.remote_claim import refuse_claimed
from lowdiff._storage.segment_reader import SegmentReader
from lowdiff._storage.snapshot import read_snapshot
from lowdiff.errors import LowDiffError, RemoteStoreError

log = logging.getLogger(__name__)

PULLING = ".pulling-"
"""Prefix of the directory in ``RUN_DIR`` a pull goes into before its files are moved in (left only by a crash
during the pull; removed by the next :func:`reconcile`)."""


def reconcile(root: Path, store: Store) -> tuple[bool, str]:
    """Before a trainer opens ``root`` (holding its writer lock) with a remote: where only the remote holds the run
    (a new machine), pull it; where both hold it, the newer wins (the older local files are moved to
    ``quarantine/``, never deleted); a remote holding (or, without a manifest, claimed by) another run is refused.
    Returns whether both held the run or the remote's was pulled (the user is told which is used), and what was
    done."""
    try:
        remote = store.list()
    except Exception as e:
        if (root / MANIFEST).exists():
            return True, (f"cannot list {store.url} ({e}): resuming from {root}; the mirror uploads it once the "
                          "store answers")
        raise RemoteStoreError(f"cannot list {store.url} ({e}), and {root} holds no run: starting a new run could "
                               "replace one the store holds. Fix the store's endpoint or credentials "
                               "(AWS_ENDPOINT_URL, ...), or leave remote.url unset to train without the mirror") from e
    for stale in root.glob(PULLING + "*"):  # a pull, or a read of the bucket's later files, a crash interrupted
        shutil.rmtree(stale, ignore_errors=True)
    if MANIFEST not in remote:
        refuse_claimed(store, root)  # another trainer started on the empty prefix first (a job launched twice)
        return False, f"{store.url} holds no run yet: the mirror uploads {root}"
    theirs = remote_manifest(store, root)
    if not (root / MANIFEST).exists():
        # Files without a manifest: a pull cut short while it moved the older run aside (the manifest first), or
        # files copied in by hand. None of them is the pulled run's: they go aside too, not up to the bucket.
        strays = local_files(root)
        aside = root / "quarantine" / f"no-run-{int(time.time())}" if strays else None
        pull_in(store, root, aside, f"Nothing was pulled into {root}: wrap() again once the store serves it "
                "(check the store, its endpoint and credentials: AWS_ENDPOINT_URL, ...)")
        return True, (f"{root} held no run: pulled the run from {store.url} (up to step {reach(remote)})"
                      + (f"; the {len(strays)} file(s) it held without a manifest are in {aside}" if strays else ""))
    ours = read_manifest(root)
    if theirs.run_id != ours.run_id:
        raise RemoteStoreError(f"{store.url} holds another run (run id {theirs.run_id}) than {root} (run id "
                               f"{ours.run_id}); point remote.url at this run's prefix or at an empty one")
    local_step = newest_step(local_files(root))
    left = (f"{root} was left as it was (its run, up to step {local_step}, was not moved aside). wrap() again once "
            "the store serves it, and the run in the bucket is pulled then if it is newer; or set remote.url to null "
            "to train on from the local run without the mirror")
    try:
        newer = bucket_newer(store, root, remote, theirs.history, local_step)
    except RemoteStoreError as e:
        raise RemoteStoreError(f"{e}. {left}") from e
    if newer is None:
        return True, (f"{root} resumed the run since {store.url} was last written: resuming from the local run "
                      f"directory (up to step {local_step}; the store's files, up to step {newest_step(remote)}, are "
                      "replaced by the mirror)")
    resumed, remote_step = newer
    if not resumed and remote_step <= local_step:
        return True, (f"{root} (up to step {local_step}) is at least as new as {store.url} (up to step "
                      f"{remote_step}): resuming from the local run directory")
    aside = root / "quarantine" / f"replaced-by-remote-{int(time.time())}"
    pull_in(store, root, aside, left)
    why = (f"resumed the run since {root} was written" if resumed
           else f"(up to step {remote_step}) is newer than {root} (up to step {local_step})")
    return True, f"{store.url} {why}: pulled it; the local files are in {aside}"


def bucket_newer(store: Store, root: Path, remote: Mapping[str, int], theirs: history.History,
                 local_step: int) -> tuple[bool, int] | None:
    """How the run under ``store`` (listed: ``remote``; its manifest's history ``theirs``) stands against the same
    run in ``root`` (whose files reach ``local_step``): None where ``root`` resumed the run since the bucket was
    written (the local run wins whatever step the bucket's names reach); else whether the bucket's run resumed since
    ``root``'s was written, and the step the bucket reaches (:func:`vouched_reach`, needed only where it did not
    resume since: it wins then in any case). The newer wins: :func:`reconcile` at ``wrap()``, and the mirror before
    it first writes to a prefix it could not list at ``wrap()`` (lowdiff._persist.mirror)."""
    ours = read_manifest(root).history
    # A resume is later than every step before it: the side that resumed since the other was written wins,
    # whichever file names reach the higher step (the other's may be a history the resume went back from).
    if history.descends(ours, theirs):
        return None
    if history.descends(theirs, ours):
        return True, reach(remote)
    return False, vouched_reach(store, root, remote, local_step)


def pull_in(store: Store, root: Path, aside: Path | None, then: str) -> None:
    """Pull the remote run into ``root``: into ``root/.pulling-*`` first; once it is whole, the local files (with
    ``aside``) are moved there, the manifest first, then the pulled files into ``root``, the manifest last. A pull
    that fails raises :class:`RemoteStoreError` naming what failed, followed by ``then`` (the state ``root`` is in,
    what to do)."""
    staging = Path(tempfile.mkdtemp(prefix=PULLING, dir=root))
    try:
        try:
            names = pull(store, staging)
        except RemoteStoreError as e:
            raise RemoteStoreError(f"{e}. {then}") from e
        if aside is not None:
            # The manifest first: a crash in the middle leaves no run (the next wrap() pulls the whole run again),
            # never a run that resumes at an older step with its newer files moved aside.
            names_here = sorted(local_files(root), key=lambda n: n != MANIFEST)
            for name in names_here:
                target = aside / name
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(root / name, target)
        for name in [*names, RECORD]:  # the data files, the manifest, then what the mirror holds as its own
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, root / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def vouched_reach(store: Store, root: Path, remote: Mapping[str, int], above: int) -> int:
    """The step the remote's files reach (:func:`~lowdiff._storage.remote.reach`), counting a file set that holds a
    step after ``above`` (the local run's newest) only once it has been fetched and read as recovery reads it: it
    names this run, a branch of the remote manifest's history and the steps its name says. Such sets come down
    only where the names alone reach past ``above``, into ``root`` (the run directory's file system, which has
    room for the run; a temporary directory may not)."""
    names = [n for n in remote if n != MANIFEST]
    hoped = reach(names)
    if hoped <= above:
        return hoped
    later = {n for n in names if n.split("/", 1)[0] in (SNAPSHOT_DIR, LOG_DIR) and above < step_key(n)[0] <= hoped}
    tmp = Path(tempfile.mkdtemp(prefix=PULLING, dir=root))  # removed by the next reconcile should a crash leave it
    try:
        pull(store, tmp, select=lambda listed: later & set(listed))
        readable = _readable(tmp, store.url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return reach([n for n in names if step_key(n)[0] <= above] + readable)


def _readable(root: Path, url: str) -> list[str]:
    """The names of the complete file sets in ``root`` (a part of the run at ``url``, fetched with its manifest)
    that read as recovery reads them; each of the others is logged, named by its URL."""
    manifest = read_manifest(root)
    sets: list[tuple[FileSet, int | None, int | None]] = [(f, None, None) for f in list_snapshots(root).values()]
    sets += [(files, first, last) for first, last, files in list_segments(root)]
    out: list[str] = []
    for files, first, last in sets:
        try:
            if first is None or last is None:
                read_snapshot(files, for_files(manifest, files), only=set(), with_buffers=False)
            else:
                SegmentReader(files, for_files(manifest, files), first, last).close()
        except LowDiffError as e:
            log.warning("lowdiff: %s; not counted as a step the run in %s reaches", str(e).replace(str(root), url),
                        url)
            continue
        out += [p.relative_to(root).as_posix() for p in files.paths]
    return out
