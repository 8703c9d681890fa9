"""Fixtures of the remote tier's tests: the session's S3 server (tests/remote/s3server.py) and the credentials a
user's environment would hold."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from s3server import S3Server, start_server, stop_server


@pytest.fixture(scope="session")
def s3_env() -> Iterator[None]:
    """Credentials for the local server, through the environment as a user's would come (the persistence process
    inherits them)."""
    keys = {"AWS_ACCESS_KEY_ID": "lowdiff-test", "AWS_SECRET_ACCESS_KEY": "lowdiff-test",
            "AWS_DEFAULT_REGION": "us-east-1"}
    before = {k: os.environ.get(k) for k in [*keys, "AWS_ENDPOINT_URL"]}
    os.environ.update(keys)
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3(s3_env: None) -> Iterator[S3Server]:
    """The session's S3 server; ``AWS_ENDPOINT_URL`` points at it."""
    server = start_server()
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    try:
        yield server
    finally:
        stop_server(server)
