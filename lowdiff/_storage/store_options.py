"""How long a request to the remote store may take (``remote.storage_options``; lowdiff._storage.remote).

For ``s3://`` lowdiff gives s3fs botocore's timeouts and attempts (:data:`S3_CONFIG`) and s3fs's own retries
(:data:`S3_RETRIES`), each unless ``remote.storage_options`` gives its own, so that a store that accepts a
connection and never answers fails a request within :func:`request_bound_s`: about a minute by default, after which
the mirror retries it. botocore's read timeout starts only once a request's body is sent (aiohttp's), and an upload
waits for the store's ``100 Continue`` first, so an upload to a hung store would never time out; :class:`Store`
gives each upload that bound plus the time its bytes take at :data:`PUT_MIN_BYTES_PER_S`, then abandons it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from lowdiff.errors import RemoteStoreError

S3_CONFIG: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 20, "retries": {"total_max_attempts": 2}}
"""botocore's ``config_kwargs`` for ``s3://``, each key unless ``remote.storage_options["config_kwargs"]`` gives it."""
S3_RETRIES = 1
"""s3fs's own attempts at a request botocore gave up on, unless ``remote.storage_options["retries"]`` says (s3fs
takes it only as an attribute: :class:`~lowdiff._storage.remote.Store` sets it). s3fs's default, 5, multiplied
botocore's attempts: with lowdiff's earlier 3 attempts of 5 + 30 s, 9 minutes on the training thread at wrap()."""
BOTOCORE_ATTEMPTS = 5
"""botocore's attempts at a request where ``config_kwargs["retries"]`` does not say (legacy mode; standard: 3)."""
PUT_MIN_BYTES_PER_S = 128 * 1024
"""An upload still running after :func:`request_bound_s` plus its size at this rate is abandoned (and retried)."""


def s3_options(storage_options: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The s3fs filesystem's options, and its ``retries``: :data:`S3_CONFIG` under the user's ``config_kwargs`` key
    by key (a user's ``{"config_kwargs": {"region_name": ...}}`` keeps the timeouts), :data:`S3_RETRIES` unless
    ``retries`` is given."""
    opts = dict(storage_options)
    retries = opts.pop("retries", S3_RETRIES)
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 1:
        raise RemoteStoreError(f"remote.storage_options['retries'] must be an integer >= 1 (s3fs's attempts at a "
                               f"request), got {retries!r}")
    # Copies: botocore changes a retries dict it is given (it adds the mode, renames max_attempts)
    opts["config_kwargs"] = copy.deepcopy({**S3_CONFIG, **dict(opts.get("config_kwargs") or {})})
    return opts, retries


def request_bound_s(config_kwargs: Mapping[str, Any], retries: int) -> float:
    """The longest one request takes against a store that accepts connections and never answers (or accepts just
    before the connect timeout): each of s3fs's ``retries`` runs botocore's attempts, each waiting up to
    connect_timeout + read_timeout; botocore sleeps at most min(2**(n-1), 20) s before its attempt n+1 (legacy and
    standard modes alike), s3fs min(1.7**i * 0.1, 15) s after its attempt i."""
    tries = dict(config_kwargs.get("retries") or {})
    attempts = int(tries.get("total_max_attempts") or (int(tries["max_attempts"]) + 1 if "max_attempts" in tries
                                                       else BOTOCORE_ATTEMPTS))
    waits = float(config_kwargs.get("connect_timeout", 60)) + float(config_kwargs.get("read_timeout", 60))
    botocore_sleeps = sum(min(2.0 ** n, 20.0) for n in range(attempts - 1))
    s3fs_sleeps = sum(min(1.7 ** i * 0.1, 15.0) for i in range(retries))
    return retries * (attempts * waits + botocore_sleeps) + s3fs_sleeps
