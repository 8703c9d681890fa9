"""The filesystem options lowdiff gives s3fs (lowdiff._storage.store_options): a hung store fails a request within
a minute by default, and the user's remote.storage_options override each of them."""

from __future__ import annotations

import pytest

from lowdiff._storage.store_options import request_bound_s, s3_options
from lowdiff.errors import RemoteStoreError


def test_a_hung_store_fails_a_request_within_a_minute() -> None:
    opts, retries = s3_options({})
    config = opts["config_kwargs"]
    # 1 s3fs try x 2 botocore attempts x (5 s connect + 20 s read), 1 s between the attempts, 0.1 s after s3fs's.
    assert (retries, config["retries"]["total_max_attempts"], config["connect_timeout"], config["read_timeout"]) \
        == (1, 2, 5, 20)
    assert request_bound_s(config, retries) == pytest.approx(51.1)
    assert request_bound_s(config, retries) <= 60.0  # configuration.md: "within about a minute"
    # What lowdiff set before: botocore max_attempts 2 (3 attempts) of 5 + 30 s, under s3fs's 5: over 9 minutes.
    assert request_bound_s({"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}, 5) > 540


def test_the_users_options_override_each_default() -> None:
    given = {"config_kwargs": {"read_timeout": 1, "region_name": "eu-west-1"}, "retries": 3, "anon": False}
    opts, retries = s3_options(given)
    assert retries == 3 and "retries" not in opts and opts["anon"] is False
    assert opts["config_kwargs"] == {"connect_timeout": 5, "read_timeout": 1, "region_name": "eu-west-1",
                                     "retries": {"total_max_attempts": 2}}
    assert given["config_kwargs"] == {"read_timeout": 1, "region_name": "eu-west-1"}  # not changed in place
    opts, _ = s3_options({"config_kwargs": {"retries": {"max_attempts": 9}}})
    assert opts["config_kwargs"]["retries"] == {"max_attempts": 9}
    assert request_bound_s(opts["config_kwargs"], 1) > 10 * 25  # 10 attempts of 5 + 20 s
    with pytest.raises(RemoteStoreError, match="retries"):
        s3_options({"retries": 0})


def test_botocore_changes_nothing_of_lowdiffs_defaults() -> None:
    """botocore adds its mode to, and renames the keys of, a retries dict it is given: each Store gets a copy."""
    opts, _ = s3_options({})
    opts["config_kwargs"]["retries"]["mode"] = "legacy"
    assert "mode" not in s3_options({})[0]["config_kwargs"]["retries"]
