"""Config validation: every mistake is a ConfigError (also a ValueError) naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff import Config, ConfigError


def _cfg(**kw):
    return Config.from_dict({"run_dir": "runs/a", **kw})


def test_defaults_and_nested_values() -> None:
    c = _cfg(compressor={"name": "topk", "ratio": 0.1}, snapshot={"every_steps": 7}, log={"codec": "zstd"})
    assert c.compressor.name == "topk" and c.compressor.ratio == 0.1
    assert c.snapshot.every_steps == 7 and c.log.codec == "zstd" and c.log.batch_steps == 16
    assert Config.from_dict(c.to_dict()) == c


def test_config_is_frozen() -> None:
    c = _cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.run_dir = "elsewhere"  # type: ignore[misc]


def test_config_error_is_also_value_error() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, lowdiff.LowDiffError)


@pytest.mark.parametrize("data, key", [
    ({"run_dir": "r", "bogus": 1}, "'bogus'"),
    ({"run_dir": "r", "log": {"batch_step": 4}}, "'log.batch_step'"),
    ({"run_dir": "r", "compressor": {"name": "topk", "k": 5}}, "'compressor.k'"),
    ({"run_dir": "r", "snapshot": {"every": 5}}, "'snapshot.every'"),
])
def test_unknown_key_is_named(data, key) -> None:
    with pytest.raises(ConfigError, match="unknown config key") as e:
        Config.from_dict(data)
    assert key in str(e.value)
    assert "allowed keys" in str(e.value)


@pytest.mark.parametrize("data, key", [
    ({"run_dir": 5}, "run_dir"),
    ({"run_dir": ""}, "run_dir"),
    ({"run_dir": "r", "compressor": {"ratio": "0.1"}}, "compressor.ratio"),
    ({"run_dir": "r", "compressor": {"rank": 2.0}}, "compressor.rank"),
    ({"run_dir": "r", "compressor": {"name": "dgc"}}, "compressor.name"),
    ({"run_dir": "r", "log": {"batch_steps": "4"}}, "log.batch_steps"),
    ({"run_dir": "r", "log": {"codec": "gzip"}}, "log.codec"),
    ({"run_dir": "r", "on_write_error": "ignore"}, "on_write_error"),
    ({"run_dir": "r", "log": 3}, "log"),
    ({"run_dir": "r", "snapshot": None}, "snapshot"),
])
def test_wrong_type_is_named(data, key) -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_dict(data)
    assert f"'{key}'" in str(e.value)


@pytest.mark.parametrize("section, key, value", [
    ("compressor", "ratio", 0),
    ("compressor", "ratio", -0.5),
    ("compressor", "ratio", 1.5),
    ("compressor", "ratio", float("nan")),
    ("compressor", "ratio", float("inf")),
    ("compressor", "rank", 0),
    ("snapshot", "every_steps", 0),
    ("snapshot", "keep", -1),
    ("log", "batch_steps", 0),
    ("log", "queue_depth", 0),
])
def test_out_of_range_is_named(section, key, value) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(**{section: {key: value}})
    assert f"'{section}.{key}'" in str(e.value)


def test_boundary_values_are_accepted() -> None:
    c = _cfg(compressor={"ratio": 1, "rank": 1}, snapshot={"every_steps": 1, "keep": 0},
             log={"batch_steps": 1, "queue_depth": 1})
    assert c.compressor.ratio == 1 and c.snapshot.every_steps == 1


@pytest.mark.parametrize("section, key, value", [
    ("log", "batch_steps", True),        # bool is an int subclass: must not pass for a count
    ("snapshot", "every_steps", False),
    ("compressor", "rank", True),
    ("compressor", "ratio", True),
    ("compressor", "error_feedback", 1),  # ... nor an int for a flag
    ("compressor", "error_feedback", "yes"),
])
def test_bool_and_int_are_not_interchangeable(section, key, value) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(**{section: {key: value}})
    assert f"'{section}.{key}'" in str(e.value)


@pytest.mark.parametrize("value", [1, 0, "true"])
def test_enabled_must_be_a_bool(value) -> None:
    with pytest.raises(ConfigError, match="'enabled'"):
        _cfg(enabled=value)


def test_missing_run_dir() -> None:
    with pytest.raises(ConfigError, match="'run_dir'"):
        Config.from_dict({"log": {"batch_steps": 2}})


def test_run_dir_may_be_a_path(tmp_path: Path) -> None:
    assert Config.from_dict({"run_dir": tmp_path}).to_dict()["run_dir"] == str(tmp_path)


def test_yaml_round_trip(tmp_path: Path) -> None:
    p = tmp_path / "lowdiff.yaml"
    p.write_text("run_dir: runs/x\ncompressor:\n  name: powersgd\n  rank: 2\nlog:\n  batch_steps: 8\n  codec: none\n")
    c = Config.from_yaml(p)
    assert (c.compressor.name, c.compressor.rank, c.log.batch_steps, c.log.codec) == ("powersgd", 2, 8, "none")


def test_yaml_syntax_error_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text("run_dir: runs/x\ncompressor: {name: topk\nlog: [\n")
    with pytest.raises(ConfigError, match="YAML syntax error") as e:
        Config.from_yaml(p)
    assert str(p) in str(e.value)


def test_yaml_yes_is_a_bool_not_a_count(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("run_dir: r\nlog:\n  batch_steps: yes\n")
    with pytest.raises(ConfigError, match="'log.batch_steps'"):
        Config.from_yaml(p)


def test_yaml_unknown_key_and_bad_top_level(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("run_dir: r\nsnapshot:\n  every_step: 3\n")
    with pytest.raises(ConfigError, match="'snapshot.every_step'"):
        Config.from_yaml(p)
    p.write_text("- run_dir\n- r\n")
    with pytest.raises(ConfigError, match="top level") as e:
        Config.from_yaml(p)
    assert str(p) in str(e.value)


def test_yaml_missing_file_names_it(tmp_path: Path) -> None:
    p = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        Config.from_yaml(p)
    assert str(p) in str(e.value)


def test_wrap_accepts_a_yaml_path_and_validates(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    p = tmp_path / "c.yaml"
    p.write_text(f"run_dir: {tmp_path / 'run'}\nlog:\n  batch_steps: 2\n")
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, p)
    try:
        assert opt.config.log.batch_steps == 2
    finally:
        opt.close()
    with pytest.raises(ConfigError, match="'log.batch_steps'"):
        lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model,
                     {"run_dir": str(tmp_path / "r2"), "log": {"batch_steps": 0}})
    with pytest.raises(ConfigError):
        lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, 42)  # type: ignore[arg-type]


def test_yaml_key_given_twice_is_refused(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently: an edited file with a leftover line would run settings
    nobody chose."""
    path = tmp_path / "c.yaml"
    path.write_text("run_dir: r\nsnapshot:\n  every_steps: 10\n  every_steps: 100\n")
    with pytest.raises(ConfigError, match="'every_steps' is given twice"):
        Config.from_yaml(path)


def test_run_dir_with_a_tilde_is_the_users_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("run_dir: ~/runs/a\n")
    assert Config.from_yaml(path).run_dir == str(tmp_path / "runs" / "a")
    assert Config.from_dict({"run_dir": "runs/~a"}).run_dir == "runs/~a"


def test_topk_on_complex_parameters_is_refused_at_wrap(tmp_path: Path) -> None:
    """torch.topk has no complex kernel: it failed with torch's own error at the first step."""
    model = torch.nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(lowdiff.UnsupportedError, match="topk cannot select from complex parameters"):
        lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model,
                     {"run_dir": str(tmp_path / "run"), "compressor": {"name": "topk"}})
    assert not (tmp_path / "run").exists()


def test_remote_section_is_validated_and_never_recorded() -> None:
    c = Config.from_dict({"run_dir": "r", "remote": {"url": "s3://bucket/runs/a", "close_timeout_s": 5,
                                                      "storage_options": {"key": "secret"}}})
    assert c.remote.url == "s3://bucket/runs/a" and c.remote.close_timeout_s == 5
    assert "remote" not in c.to_dict()  # manifest.json records to_dict(): no storage option (a secret) goes there
    assert Config.from_dict({"run_dir": "r"}).remote.url is None
    for bad, named in [({"url": "bucket/runs"}, "remote.url"), ({"url": "s3://"}, "remote.url"),
                       ({"url": "s3://key:secret@bucket/a"}, "credentials"), ({"url": 3}, "remote.url"),
                       ({"storage_options": [1]}, "remote.storage_options"),
                       ({"close_timeout_s": -1}, "remote.close_timeout_s"), ({"lag_warn_s": 0}, "remote.lag_warn_s"),
                       ({"bucket": "x"}, "remote.bucket")]:
        with pytest.raises(ConfigError, match=named):
            Config.from_dict({"run_dir": "r", "remote": {"url": "s3://b/p", **bad}})
    for key in ("close_timeout_s", "lag_warn_s"):  # infinity is refused, and the message says so
        with pytest.raises(ConfigError, match=f"'remote.{key}' must be a finite number of seconds"):
            Config.from_dict({"run_dir": "r", "remote": {"url": "s3://b/p", key: float("inf")}})
