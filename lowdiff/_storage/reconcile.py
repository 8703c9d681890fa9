"""Local against remote at ``wrap()`` (``remote.url``; docs/guide/durability.md): which copy of the run a trainer
continues when its run directory, the remote prefix, or both hold the run. Where only the remote holds it (a new
machine) it is pulled; where both hold it, the newer wins and the older local files are moved to ``quarantine/``,
never deleted; a remote holding (or, without a manifest, claimed by) another run is refused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from lowdiff._storage import history
from lowdiff._storage.format import MANIFEST
from lowdiff._storage.manifest import read_manifest
from lowdiff._storage.remote import RECORD, Store, local_files, newest_step, pull, remote_manifest
from lowdiff._storage.remote_claim import refuse_claimed
from lowdiff.errors import RemoteStoreError


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
    if MANIFEST not in remote:
        refuse_claimed(store, root)  # another trainer started on the empty prefix first (a job launched twice)
        return False, f"{store.url} holds no run yet: the mirror uploads {root}"
    theirs = remote_manifest(store, root)
    if not (root / MANIFEST).exists():
        pull(store, root)
        return True, f"{root} held no run: pulled the run from {store.url} (up to step {newest_step(remote)})"
    ours = read_manifest(root)
    if theirs.run_id != ours.run_id:
        raise RemoteStoreError(f"{store.url} holds another run (run id {theirs.run_id}) than {root} (run id "
                               f"{ours.run_id}); point remote.url at this run's prefix or at an empty one")
    local_step = newest_step(local_files(root))
    remote_step = newest_step(remote)
    # A resume is later than every step before it: the side that resumed since the other was written wins,
    # whichever file names reach the higher step (the other's may be a history the resume went back from).
    if history.descends(ours.history, theirs.history):
        return True, (f"{root} resumed the run since {store.url} was last written: resuming from the local run "
                      f"directory (up to step {local_step}; the store's files, up to step {remote_step}, are replaced "
                      "by the mirror)")
    if not history.descends(theirs.history, ours.history) and remote_step <= local_step:
        return True, (f"{root} (up to step {local_step}) is at least as new as {store.url} (up to step {remote_step}): "
                "resuming from the local run directory")
    aside = root / "quarantine" / f"replaced-by-remote-{int(time.time())}"
    for name in local_files(root):
        target = aside / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(root / name, target)
    (root / RECORD).unlink(missing_ok=True)
    pull(store, root)
    why = (f"resumed the run since {root} was written" if history.descends(theirs.history, ours.history)
           else f"(up to step {remote_step}) is newer than {root} (up to step {local_step})")
    return True, f"{store.url} {why}: pulled it; the local files are in {aside}"
