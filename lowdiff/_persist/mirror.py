"""The mirror (``remote.url``): a thread beside the writer that uploads every committed file of the run directory
to object storage, the manifest last (docs/guide/durability.md, docs/reference/design.md).

It runs where the writer runs: in the persistence process (``log.persistence: process``, so it outlives a dead
trainer and finishes the uploads of what was committed before that process exits) or beside the writer thread;
never on the training thread. The writer calls :meth:`Mirror.kick` after each commit with its durable step; the
mirror then makes one *pass* (the first, on a prefix holding no manifest, claims it for this run before anything
goes up: lowdiff._storage.remote_claim):

1. every committed snapshot, segment and stop file not uploaded yet (or changed), oldest step first;
2. the manifest, when it changed;
3. the run's files that are on the remote but no longer local (retention, a resume's quarantine) are deleted: only
   now, so an old snapshot goes only once the newer one that replaced it is remote-durable.

An object is visible whole or not at all, and readers take only complete sets that the manifest's run and history
own, so the remote prefix is a consistent run directory at every instant. A pass that ends with every file listed
at its start uploaded makes the step durable when it started *remote-durable*, once the uploaded names reach it
(under DDP rank 0's mirror uploads every rank's shards, and waits for a set whose other shards are still being
committed). A failing or hanging store never
reaches training: the pass is retried with backoff (0.5 s to 30 s), a warning says once when the lag passes
``remote.lag_warn_s``, and the next pass uploads whatever is current then. What was uploaded is recorded in
``RUN_DIR/mirror.json`` (lowdiff._storage.remote), so a restarted mirror uploads only what is missing, and its
remote-durable step starts where the files recorded there reach (:func:`uploaded_reach`), not at -1.

:meth:`Mirror.close` stops it: once it has returned no upload or deletion starts and nothing is logged (an upload
still running in a hung store may finish; nothing follows it, not even the record).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lowdiff._persist.writer import WriterStats
from lowdiff._storage.format import MANIFEST
from lowdiff._storage.manifest import Manifest, read_manifest
from lowdiff._storage.reconcile import bucket_newer
from lowdiff._storage.remote import (
    Store,
    local_files,
    newest_step,
    reach,
    read_record,
    remote_manifest,
    step_key,
    write_record,
)
from lowdiff._storage.remote_claim import claim, other_run
from lowdiff.errors import CorruptFileError, RemoteStoreError

log = logging.getLogger(__name__)

BACKOFF_S = (0.5, 30.0)
"""First and longest wait before a failed pass is retried."""
INCOMPLETE_WAIT_S = 0.5
"""How long a pass that found another rank's shard of a file set missing waits before it looks again."""


def uploaded_reach(record: Mapping[str, tuple[int, int]], here: Mapping[str, tuple[int, int]]) -> int:
    """The step that the files a mirror recorded as uploaded (``mirror.json``: the manifest among them) reach, of
    those unchanged ``here`` since (or gone from here: retention; the bucket keeps them until a newer snapshot is
    up): where a restarted mirror's remote-durable step starts (-1: nothing known)."""
    if MANIFEST not in record:
        return -1
    return reach(n for n, stat in record.items() if n != MANIFEST and here.get(n, stat) == stat)


class _Stopped(Exception):
    """close() stopped the mirror between two uploads."""


class Mirror:
    """Uploads ``root`` to ``settings["url"]`` (a ``remote`` config section as a dict) on a thread of its own;
    ``stats`` gets ``remote_durable_step``, ``remote_lag_bytes`` and ``remote_behind_since``; ``on_progress`` is
    called after each pass (the persistence process reports its counters then)."""

    def __init__(self, root: Path, settings: Mapping[str, Any], stats: WriterStats, *, durable_step: int = 0,
                 on_progress: Callable[[], None] = lambda: None) -> None:
        self.root = Path(root)
        self.url = str(settings["url"])
        self.options = dict(settings.get("storage_options") or {})
        self.close_timeout_s = float(settings.get("close_timeout_s", 60.0))
        self.lag_warn_s = float(settings.get("lag_warn_s", 300.0))
        self.stats = stats
        self.on_progress = on_progress
        self._cond = threading.Condition()
        self._wanted = durable_step
        self._dirty = True  # the first pass uploads what an earlier process left
        self._done = min(durable_step, uploaded_reach(read_record(self.root, self.url), local_files(self.root)))
        self._stop = False
        self._busy = False  # a pass is running: close() waits for it even where it uploads nothing newer
        self._dead = False  # a permanent failure (no filesystem for the URL): mirroring is off
        self._foreign = False  # the prefix holds another run's manifest: never written to
        self._run_id: str | None = None  # this run's, read from its manifest once
        self._failing: str | None = None
        self._lag_warned = False
        self._store: Store | None = None
        self._remote: set[str] | None = None
        self._record: dict[str, tuple[int, int]] = {}
        stats.remote_durable_step = self._done
        stats.remote_behind_since = time.time()
        self._thread = threading.Thread(target=self._run, name="lowdiff-mirror", daemon=True)
        self._thread.start()

    @property
    def remote_durable_step(self) -> int:
        with self._cond:
            return self._done

    def kick(self, durable_step: int) -> None:
        """Files up to ``durable_step`` are committed locally: upload them (returns at once)."""
        with self._cond:
            self._wanted = max(self._wanted, durable_step)
            self._dirty = True
            if not self.stats.remote_behind_since:
                self.stats.remote_behind_since = time.time()
            self._cond.notify_all()
        self._check_lag()

    def close(self, timeout_s: float | None = None) -> int:
        """Wait up to ``timeout_s`` (default ``remote.close_timeout_s``) for the mirror to upload everything kicked,
        then stop it: no upload starts and nothing is logged once this returns. Returns the remote-durable step
        (-1: nothing confirmed)."""
        deadline = time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while (self._dirty or self._busy or self._done < self._wanted) and not self._dead \
                    and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            self._stop = True
            self._cond.notify_all()
            done = self._done
        self._thread.join(timeout=1.0)  # one hung in the store stays behind (a daemon thread) and then does nothing
        return done

    # -- the mirror's thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF_S[0]
        while True:
            with self._cond:
                while not self._dirty and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._dirty, self._busy = False, True
                target = self._wanted
            try:
                whole = self._pass()
            except _Stopped:
                return
            except RemoteStoreError as e:
                if self._store is None or self._foreign:  # no filesystem, or another run's: retrying cannot help
                    self._say(logging.ERROR, "lowdiff: the run is not mirrored: %s", e)
                    with self._cond:
                        self._dead = True
                        self._cond.notify_all()
                    return
                backoff = self._retry_after(e, backoff)
                continue
            except Exception as e:
                backoff = self._retry_after(e, backoff)
                continue
            backoff = BACKOFF_S[0]
            if self._failing is not None:
                self._say(logging.WARNING, "lowdiff: %s answers again; the mirror is catching up", self.url)
                self._failing = None
            assert self._remote is not None
            # Of what the prefix holds, what this run directory put there (or pulled): an object it never uploaded
            # (another history's shard of the same name, under DDP) must not complete a set it did not commit.
            reached = min(target, reach(self._remote & self._record.keys()))
            with self._cond:
                self._busy = False
                if not whole:
                    self._dirty = True  # a file went while uploading (retention): list again at once
                elif reached < target and not self._stop:
                    # Under DDP another rank's shard of the newest files is not committed yet: look again shortly.
                    self._done = max(self._done, reached)
                    self.stats.remote_durable_step = self._done
                    self._dirty = True
                    self._cond.wait(INCOMPLETE_WAIT_S)
                else:
                    self._done = max(self._done, target)
                    self.stats.remote_durable_step = self._done
                    if self._done >= self._wanted and not self._dirty:
                        self.stats.remote_behind_since = 0.0
                        if self._lag_warned:
                            self._say(logging.WARNING, "lowdiff: the mirror to %s has caught up (step %d)", self.url,
                                      self._done)
                        self._lag_warned = False
                self._cond.notify_all()
                if self._stop:
                    return
            self._check_lag()
            self.on_progress()

    def _retry_after(self, e: BaseException, backoff: float) -> float:
        what = f"{type(e).__name__}: {e}"
        if self._failing is None:
            self._say(logging.WARNING, "lowdiff: uploading to %s failed (%s); retrying with backoff, training goes on "
                      "and the files wait on the local disk", self.url, what)
        self._failing = what
        with self._cond:
            self._dirty, self._busy = True, False
            if not self._stop:
                self._cond.wait(backoff)
        self._check_lag()
        return min(backoff * 2, BACKOFF_S[1])

    def _check_lag(self) -> None:
        since = self.stats.remote_behind_since
        if since and not self._lag_warned and time.time() - since > self.lag_warn_s:
            self._lag_warned = self._say(
                logging.WARNING, "lowdiff: the mirror to %s is %.0f s behind (remote-durable step %d, local %d); a "
                "loss of this machine now loses the steps after %d%s", self.url, time.time() - since, self._done,
                self._wanted, self._done, f" (last error: {self._failing})" if self._failing else "")

    def _say(self, level: int, msg: str, *args: Any) -> bool:
        """Log, unless close() has stopped the mirror (under the lock close() stops it with: never after it
        returned). Whether it was logged."""
        with self._cond:
            if self._stop:
                return False
            log.log(level, msg, *args)
            return True

    def _go(self) -> None:
        """Before each upload, deletion and record: raise :class:`_Stopped` once close() has stopped the mirror."""
        with self._cond:
            if self._stop:
                raise _Stopped

    def _pass(self) -> bool:
        """One pass (the module's docstring); False when a listed file vanished before its upload."""
        if self._store is None:
            self._store = Store(self.url, self.options)
        store = self._store
        if self._remote is None:
            listed = store.list()
            remote = set(listed)
            if MANIFEST in remote:
                self._check_not_behind(store, listed, self._check_same_run(store))
            else:
                self._claim(store)
            self._remote = remote
            self._record = {n: v for n, v in read_record(self.root, self.url).items() if n in self._remote}
            with self._cond:  # the starting point, of what the record says went up and the bucket still holds
                self._done = min(self._done, uploaded_reach(self._record, local_files(self.root)))
                self.stats.remote_durable_step = self._done
        elif MANIFEST in self._record:
            self._still_ours(store)  # another trainer started on the same empty prefix may have taken it since
        local = local_files(self.root)
        todo = sorted((n for n in local if n != MANIFEST and self._record.get(n) != local[n]), key=step_key)
        self.stats.remote_lag_bytes = sum(local[n][0] for n in todo)
        whole = True
        for name in todo:
            self._go()
            try:
                store.put(self.root / name, name)
            except FileNotFoundError:
                if (self.root / name).exists():
                    raise
                whole = False  # deleted by retention since the listing
                continue
            self._uploaded(name, local[name])
            self.stats.remote_lag_bytes -= local[name][0]
        if not whole:
            return False
        if MANIFEST in local and self._record.get(MANIFEST) != local[MANIFEST]:
            self._go()
            self._still_ours(store)  # never over another run's manifest that went up since the listing
            store.put(self.root / MANIFEST, MANIFEST)
            self._uploaded(MANIFEST, local[MANIFEST])
        # Only what this run directory put there (or pulled from there): never a name it does not know
        for name in sorted((self._remote & set(self._record)) - set(local), key=step_key):
            if name == MANIFEST:
                continue
            self._go()
            store.rm(name)
            self._remote.discard(name)
            self._record.pop(name, None)
        self._go()
        write_record(self.root, self.url, self._record)
        return True

    def _check_same_run(self, store: Store) -> Manifest:
        """Before the first upload: a prefix holding another run's manifest is never written to (the open checks
        it too, but a store that could not be listed then was not). Returns the manifest there."""
        try:
            theirs = remote_manifest(store, self.root)
        except CorruptFileError as e:  # damaged: which run's is not known, so the prefix is not written to either
            self._foreign = True
            raise RemoteStoreError(str(e)) from e
        ours = self._ours()
        if theirs.run_id != ours:
            self._foreign = True
            raise RemoteStoreError(f"{self.url} holds another run (run id {theirs.run_id}) than {self.root} (run id "
                                   f"{ours}): nothing is uploaded there; point remote.url at this run's prefix")
        return theirs

    def _check_not_behind(self, store: Store, listed: Mapping[str, int], theirs: Manifest) -> None:
        """Before the first upload: the run under the prefix is not newer than this run directory's, by the rules
        ``wrap()`` follows (lowdiff._storage.reconcile.bucket_newer). Where the store did not answer at ``wrap()``
        (the trainer went on from its local run directory, a stale copy perhaps) or another machine has continued
        the run since, uploading would replace the newer run's files, and its manifest, with older ones."""
        local_step = newest_step(local_files(self.root))
        newer = bucket_newer(store, self.root, listed, theirs.history, local_step)
        if newer is None or (not newer[0] and newer[1] <= local_step):
            return
        self._foreign = True
        with self._cond:
            self._done = -1  # what the record says went up is not what the prefix holds now
            self.stats.remote_durable_step = -1
        why = "it resumed the run since that was written" if newer[0] else f"it reaches step {newer[1]}"
        raise RemoteStoreError(
            f"{self.url} holds a newer state of this run than {self.root} (up to step {local_step}): {why}. The "
            "store did not serve it when this trainer opened the run directory, or another machine has continued the "
            "run since. Nothing is uploaded there, which would replace it. To continue from the bucket's run, stop "
            "this trainer and wrap() again once the store answers (the newer run is pulled, the local files moved to "
            "quarantine/); or point remote.url at another prefix to keep this one")

    def _claim(self, store: Store) -> None:
        """Before the first upload to a prefix holding no manifest: claim it for this run, or stop where another
        run's trainer claimed it first (a job launched twice; lowdiff._storage.remote_claim)."""
        ours = self._ours()
        if ours is None:
            return  # a run written before run ids: nothing tells two runs apart
        try:
            there = claim(store, ours)
        except CorruptFileError as e:  # which run's is not known, so the prefix is not written to
            self._foreign = True
            raise RemoteStoreError(str(e)) from e
        if there.run_id != ours:
            self._foreign = True
            raise other_run(store, there, self.root, ours)

    def _ours(self) -> str | None:
        """This run's id, read from its manifest once."""
        if self._run_id is None:
            self._run_id = read_manifest(self.root).run_id
        return self._run_id

    def _still_ours(self, store: Store) -> None:
        """The manifest under the prefix, if there is one, is this run's. Two trainers started at once on one empty
        prefix (a job launched twice) both found it empty at ``wrap()``; the claim (:meth:`_claim`) lets only one
        of them upload. On a store that ignores the claim's condition both may have: the second whose manifest
        would go up, or that finds the other's there at its next pass, stops mirroring (:meth:`_check_same_run`)
        instead of both reporting steps as remote-durable under a prefix that holds one run. Files either uploaded
        before its manifest went up may have replaced the other's of the same name (snapshot 0); the error says
        so."""
        try:
            self._check_same_run(store)
        except FileNotFoundError:
            self._record.pop(MANIFEST, None)  # ours is gone (deleted by hand): it goes up again
        except RemoteStoreError as e:
            if not self._foreign or isinstance(e.__cause__, CorruptFileError):  # a damaged one: no other trainer
                raise
            raise RemoteStoreError(f"{e}. Another trainer mirrors to that prefix too (both started on it while it was "
                                   "empty, and the prefix's claim did not keep one out: a store that ignores "
                                   "conditional writes, or a lowdiff without claims); files this run uploaded before "
                                   "it noticed may have replaced that run's of the same name there") from e

    def _uploaded(self, name: str, stat: tuple[int, int]) -> None:
        assert self._remote is not None
        self._remote.add(name)
        self._record[name] = stat
