"""A run directory mirrored in object storage, as the storage layer sees it (``remote.url``; docs/guide/durability.md).

The remote prefix holds the run directory's committed files under the same relative names: ``manifest.json``,
``snapshots/step-*.h5``, ``log/steps-*.h5``, ``stops/step-*.h5`` (FORMAT.md section 1), and the prefix's claim
(``claim.json``: lowdiff._storage.remote_claim). Nothing else of the run goes up (no locks, no ``*.tmp``, no
quarantine), and nothing else found under the prefix is ever read or deleted.
An object store makes each object visible whole or not at all; on a file system (``file://``) each upload goes to
``NAME.tmp`` and is renamed. The mirror itself (which files go up when) is lowdiff/_persist/mirror.py; this module
is what it and the readers share: the :class:`Store`, the names, :func:`pull` (a remote run into a local directory,
which recovery then reads with every local check) and the local record of what was uploaded (``mirror.json``, never
uploaded). Local against remote at ``wrap()`` is lowdiff/_storage/reconcile.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lowdiff._storage.atomic import write_json_atomic
from lowdiff._storage.format import (
    LOG_DIR,
    MANIFEST,
    SNAPSHOT_DIR,
    STOP_DIR,
    TMP_SUFFIX,
    parse_segment_name,
    parse_snapshot_name,
)
from lowdiff._storage.manifest import Manifest, read_manifest
from lowdiff._storage.store_options import PUT_MIN_BYTES_PER_S, request_bound_s, s3_options
from lowdiff.errors import CorruptFileError, LowDiffError, RemoteStoreError, RunDirNotFoundError

log = logging.getLogger(__name__)

RECORD = "mirror.json"
"""In the local run directory: the files uploaded to which URL, as ``{"url", "files": {name: [size, mtime_ns]}}``."""
PULL_WORKERS = 8
RELISTS = 3
"""How many times :func:`pull` lists a run again whose listed files went away while it fetched them."""


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and bool(scheme) and scheme.replace("+", "").isalnum()


def step_key(name: str) -> tuple[int, int]:
    """Upload order of a mirrored name: by the last step it holds, snapshots and stop files after the log up to it."""
    base = name.rsplit("/", 1)[-1]
    if (seg := parse_segment_name(base)) is not None:
        return (seg[1], 0)
    if (snap := parse_snapshot_name(base)) is not None:
        return (snap[0], 1)
    return (1 << 62, 2)


def is_mirrored(name: str) -> bool:
    """Whether ``name`` (relative, ``/``-separated) is one of the run's committed files the mirror carries."""
    if name == MANIFEST:
        return True
    parts = name.split("/")
    if len(parts) != 2:
        return False
    where, base = parts
    if where == LOG_DIR:
        return parse_segment_name(base) is not None
    return where in (SNAPSHOT_DIR, STOP_DIR) and parse_snapshot_name(base) is not None


def local_files(root: Path) -> dict[str, tuple[int, int]]:
    """The committed files of the run directory the mirror carries, as ``name: (size, mtime_ns)``. The log is listed
    before the snapshots: retention (a new snapshot committed, then the older ones and the log before it deleted)
    between the two listings then shows the new snapshot and the old log, never neither (the mirror would delete the
    old log from the bucket in a pass that does not upload the snapshot replacing it)."""
    out: dict[str, tuple[int, int]] = {}
    for where in (LOG_DIR, STOP_DIR, SNAPSHOT_DIR):
        d = root / where
        if not d.is_dir():
            continue
        for p in d.iterdir():
            name = f"{where}/{p.name}"
            if is_mirrored(name):
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    out[name] = (st.st_size, st.st_mtime_ns)
    with contextlib.suppress(FileNotFoundError):
        st = (root / MANIFEST).stat()
        out[MANIFEST] = (st.st_size, st.st_mtime_ns)
    return out


Shards = dict[int, set[int]]
"""A file set's shards found, by shard count: ``{count: {index}}``."""


def file_sets(names: Iterable[str]) -> tuple[dict[int, Shards], dict[tuple[int, int], Shards]]:
    """The snapshot and segment file sets the names form, judged by names alone: by step, and by (first, last)
    step (one file of an unsharded run is shard 0 of 1)."""
    snaps: dict[int, Shards] = {}
    segs: dict[tuple[int, int], Shards] = {}
    for name in names:
        where, _, base = name.partition("/")
        if where == SNAPSHOT_DIR and (snap := parse_snapshot_name(base)) is not None:
            snaps.setdefault(snap[0], {}).setdefault(snap[1].count, set()).add(snap[1].index)
        elif where == LOG_DIR and (seg := parse_segment_name(base)) is not None:
            segs.setdefault((seg[0], seg[1]), {}).setdefault(seg[2].count, set()).add(seg[2].index)
    return snaps, segs


def complete(sets: Shards) -> bool:
    """Whether one of a file set's shard counts has every shard (:func:`file_sets`)."""
    return any(len(indexes) == count for count, indexes in sets.items())


def reach(names: Iterable[str]) -> int:
    """The step the named files reach, judged by names alone: the newest complete snapshot set and the complete
    segment sets contiguous after it (-1: no complete snapshot). Under DDP a set is complete once every rank's
    shard is there."""
    snaps, segs = file_sets(names)
    bases = [s for s, sets in snaps.items() if complete(sets)]
    if not bases:
        return -1
    end = max(bases)
    for first, last in sorted(k for k, sets in segs.items() if complete(sets)):
        if first <= end + 1 < last + 1:
            end = last
    return end


def newest_step(names: Any) -> int:
    """The newest step the named snapshots and segments hold (-1: none)."""
    return max([step_key(n)[0] for n in names if n != MANIFEST and is_mirrored(n)], default=-1)


def read_record(root: Path, url: str) -> dict[str, tuple[int, int]]:
    """What an earlier mirror of ``root`` uploaded to ``url`` (empty when it mirrored elsewhere, or never)."""
    try:
        doc = json.loads((root / RECORD).read_text())
        if doc.get("url") != url:
            return {}
        return {str(k): (int(v[0]), int(v[1])) for k, v in doc["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return {}


def write_record(root: Path, url: str, files: Mapping[str, tuple[int, int]]) -> None:
    write_json_atomic(root / RECORD, {"url": url, "files": {k: list(v) for k, v in files.items()}})


class Store:
    """The fsspec filesystem behind a URL, addressed by the run's relative names."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            import fsspec
        except ImportError as e:
            raise RemoteStoreError(f"{url}: reading or writing a remote run needs fsspec (and s3fs for s3://): "
                                   "pip install 'lowdiff[remote]'") from e
        self.url = url.rstrip("/")
        protocol = url.split("://", 1)[0]
        opts = dict(storage_options or {})
        retries = None
        self.request_s: float | None = None
        """How long a request to a hung store takes to fail (lowdiff._storage.store_options); None: not known."""
        if protocol in ("s3", "s3a"):
            opts, retries = s3_options(opts)
            self.request_s = request_bound_s(opts["config_kwargs"], retries)
        try:
            self.fs, path = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **opts)
            if retries is not None:
                self.fs.retries = retries
        except ImportError as e:
            raise RemoteStoreError(f"{url}: no filesystem for {protocol}:// is installed ({e}); pip install "
                                   "'lowdiff[remote]' (s3fs), or the fsspec package for that store") from e
        except ValueError as e:
            raise RemoteStoreError(f"{url}: {e}") from e
        self.root = path.rstrip("/")
        self.local = "file" in _protocols(self.fs)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def list(self) -> dict[str, int]:
        """The run's files under the prefix, ``name: size`` (anything else there is left out)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            path = str(path)
            if not path.startswith(self.root + "/"):
                continue
            name = path[len(self.root) + 1:]
            if is_mirrored(name) and info.get("type", "file") == "file":
                out[name] = int(info.get("size") or 0)
        return out

    def put(self, local: Path, name: str) -> None:
        """Upload ``local`` as ``name``: visible whole or not at all."""
        if self.local:
            tmp = self._path(name + TMP_SUFFIX)
            self.fs.makedirs(self._path(name).rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(local), tmp)
            self.fs.mv(tmp, self._path(name))
        elif self.request_s is None:
            self.fs.put_file(str(local), self._path(name))
        else:  # an AsyncFileSystem's call: cancelled after ``timeout`` (lowdiff._storage.store_options)
            from fsspec.exceptions import FSTimeoutError

            limit = self.request_s + local.stat().st_size / PUT_MIN_BYTES_PER_S
            try:
                self.fs.put_file(str(local), self._path(name), timeout=limit)
            except FSTimeoutError as e:
                raise RemoteStoreError(f"uploading {name} to {self.url} got no answer within {limit:.0f} s (the "
                                       "store hangs, or the network dropped the connection); it is retried") from e

    def get(self, name: str, local: Path) -> None:
        """Download ``name`` into ``local`` (through ``local.tmp``, renamed once whole)."""
        tmp = local.with_name(local.name + TMP_SUFFIX)
        self.fs.get_file(self._path(name), str(tmp))
        os.replace(tmp, local)

    def rm(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def needed(names: Iterable[str], step: int | None) -> set[str]:
    """Of a run's files, those a recovery of ``step`` (None: the newest) reads when nothing is damaged: the newest
    complete snapshot set at or before it (under DDP one whose every shard is there), the segments after that
    snapshot and the stop files from it on."""
    names = set(names)
    snaps = sorted(s for s, sets in file_sets(names)[0].items() if complete(sets))
    bases = [s for s in snaps if step is None or s <= step]
    if not bases:
        return names  # the whole run: its readers say what is missing
    base = bases[-1]
    return {n for n in names if (n.startswith(SNAPSHOT_DIR + "/") and step_key(n)[0] == base)
            or (n.startswith(LOG_DIR + "/") and step_key(n)[0] > base)
            or (n.startswith(STOP_DIR + "/") and step_key(n)[0] >= base)}


class _Gone(RemoteStoreError):
    """A file the listing named was gone when it was fetched."""


def pull(store: Store, dest: Path, *, progress: bool | None = None, workers: int = PULL_WORKERS,
         select: Callable[[Iterable[str]], set[str]] | None = None) -> list[str]:
    """Download the remote run (``select``: only the files it picks from the run's names, the manifest always) into
    ``dest`` (a directory of its own, empty): data files in parallel, the manifest last. Records them in ``dest``'s
    mirror record as uploaded. Returns the names fetched. Raises :class:`RemoteStoreError` when the store cannot be
    read or holds no run. A file listed but gone when fetched (the retention of a trainer still mirroring there
    deleted it) is looked for again in a new listing, up to ``RELISTS`` times (``select`` picks from each)."""
    for attempt in range(RELISTS + 1):
        try:
            return _pull(store, dest, progress, workers, select)
        except _Gone as e:
            if attempt == RELISTS:
                raise RemoteStoreError(f"{e}; the run under {store.url} changed under {RELISTS + 1} listings in a "
                                       "row (a trainer mirroring there: try again, or stop it)") from e
            log.info("lowdiff: %s; listing %s again", e, store.url)
            for where in (SNAPSHOT_DIR, LOG_DIR, STOP_DIR):  # what came down (the manifest comes last: not yet)
                shutil.rmtree(dest / where, ignore_errors=True)
    raise AssertionError("unreachable")


def _pull(store: Store, dest: Path, progress: bool | None, workers: int,
          select: Callable[[Iterable[str]], set[str]] | None) -> list[str]:
    try:
        remote = store.list()
    except Exception as e:
        raise RemoteStoreError(f"cannot list {store.url}: {e}") from e
    if MANIFEST not in remote:
        raise RemoteStoreError(f"{store.url} holds no lowdiff run (no {MANIFEST} under it); check remote.url and "
                               "the store's credentials and endpoint (AWS_ENDPOINT_URL, ...)")
    picked = select(n for n in remote if n != MANIFEST) if select is not None else set(remote)
    wanted = sorted((n for n in picked if n != MANIFEST), key=step_key)
    for where in (SNAPSHOT_DIR, LOG_DIR, STOP_DIR):
        (dest / where).mkdir(parents=True, exist_ok=True)
    total = sum(remote[n] for n in wanted) + remote[MANIFEST]
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"fetching {store.url}", leave=False,
              disable=True if progress is False else None) as bar:
        def one(name: str) -> None:
            try:
                store.get(name, dest / name)
            except FileNotFoundError as e:
                raise _Gone(f"{store.url}/{name} was listed but gone when fetched") from e
            except Exception as e:
                raise RemoteStoreError(f"fetching {store.url}/{name} failed ({type(e).__name__}: {e})") from e
            bar.update(remote[name])

        try:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                list(pool.map(one, wanted))
            one(MANIFEST)
        except RemoteStoreError:
            raise
        except Exception as e:
            raise RemoteStoreError(f"fetching the run from {store.url} failed: {e}") from e
    done = read_record(dest, store.url)
    fetched = local_files(dest)
    done.update({n: fetched[n] for n in [*wanted, MANIFEST] if n in fetched})
    write_record(dest, store.url, done)
    log.info("lowdiff: fetched %d file(s), %d bytes, from %s in %.1f s", len(wanted) + 1, total, store.url,
             time.perf_counter() - t0)
    return [*wanted, MANIFEST]


@contextlib.contextmanager
def fetched(url: str, storage_options: Mapping[str, Any] | None = None, *, progress: bool | None = None,
            select: Callable[[Iterable[str]], set[str]] | None = None) -> Iterator[Path]:
    """A remote run (``select``: see :func:`pull`) fetched into a temporary directory (removed afterwards), for the
    local readers: recovery, verification and inspection then check every file exactly as on a local disk."""
    store = Store(url, storage_options)
    tmp = Path(tempfile.mkdtemp(prefix="lowdiff-remote-"))
    try:
        pull(store, tmp, progress=progress, select=select)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def name_remote(e: BaseException, local: Path, url: str) -> None:
    """Make the message of ``e``, raised reading a run :func:`fetched` into ``local``, name the remote ``url``
    instead of the temporary directory (in place)."""
    if e.args and isinstance(e.args[0], str) and not isinstance(e, OSError):
        e.args = (e.args[0].replace(str(local), url.rstrip("/")), *e.args[1:])


def remote_manifest(store: Store, root: Path) -> Manifest:
    """The manifest under ``store``'s prefix. A damaged one raises :class:`CorruptFileError` naming
    the object's URL, whether the run in ``root`` (left as it is) is intact, and what to do."""
    with fetched_manifest(store) as there:
        try:
            return read_manifest(there)
        except CorruptFileError as e:
            where = str(e).replace(str(there / MANIFEST), f"{store.url}/{MANIFEST}")
            try:
                read_manifest(root)
            except RunDirNotFoundError:
                raise CorruptFileError(
                    f"{where}. The run in the bucket cannot be read, so nothing was pulled into {root}: restore that "
                    "object from a copy of the run's manifest.json, or point remote.url at another prefix (or set "
                    "it to null to train without the mirror)") from e
            except LowDiffError:
                pass  # the local manifest's own error comes where it is read
            else:
                raise CorruptFileError(
                    f"{where}. The run in {root} is intact and was left as it is: if that prefix holds this run, "
                    f"replace the object with a copy of {root / MANIFEST} or delete it (the mirror of the next "
                    "wrap() on this run directory then uploads this run's), or set remote.url to null to train from "
                    "the local run without the mirror") from e
            raise CorruptFileError(where) from e
        except LowDiffError as e:
            name_remote(e, there, store.url)
            raise


@contextlib.contextmanager
def fetched_manifest(store: Store) -> Iterator[Path]:
    """The remote manifest alone, in a temporary directory."""
    tmp = Path(tempfile.mkdtemp(prefix="lowdiff-remote-"))
    try:
        store.get(MANIFEST, tmp / MANIFEST)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
