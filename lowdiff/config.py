"""Configuration: frozen dataclasses, validated on construction, loadable from a dict or a YAML file.

Every mistake names the key, what it got and what is allowed::

    >>> Config.from_dict({"run_dir": "runs/a", "compressor": {"name": "topk", "ratio": 0.01}}).compressor.ratio
    0.01
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lowdiff.errors import ConfigError

COMPRESSORS = ("topk", "powersgd", "none")
CODECS = ("none", "lz4", "zstd", "shuffle-lz4", "shuffle-zstd")
ON_WRITE_ERROR = ("raise", "warn")
CAPTURES = ("auto", "layerwise", "step")
PERSISTENCE = ("thread", "process")
WHEN_BEHIND = ("wait", "replica")
AUTO = "auto"
"""The value of ``snapshot.every_steps`` / ``log.batch_steps`` that hands the knob to the tuner."""


def _check_type(key: str, value: Any, kind: type | tuple[type, ...], allowed: str) -> None:
    # bool is an int subclass; a YAML `true` must not pass for a count, nor 1 for a flag.
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
    if not ok:
        shown = "a value not shown" if "storage_options" in key else repr(value)  # may hold credentials
        raise ConfigError(f"config key '{key}' must be {allowed}, got {shown} ({type(value).__name__})")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"config key '{key}' must be one of {', '.join(choices)}; got {value!r}")


def _check_min_int(key: str, value: Any, minimum: int) -> None:
    _check_type(key, value, int, f"an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"config key '{key}' must be an integer >= {minimum}, got {value}")


def _check_min_int_or_auto(key: str, value: Any, minimum: int) -> None:
    if value == AUTO:
        return
    allowed = f"an integer >= {minimum} or '{AUTO}'"
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config key '{key}' must be {allowed}, got {value!r}")


def _check_number(key: str, value: Any, ok: Any, allowed: str) -> None:
    _check_type(key, value, (int, float), allowed)
    if value != value or not ok(value):  # value != value: NaN
        raise ConfigError(f"config key '{key}' must be {allowed}, got {value}")


@dataclass(frozen=True, kw_only=True)
class CompressorConfig:
    """How the gradient is compressed before the optimizer consumes (and lowdiff logs) it."""

    name: str = "none"
    """topk (keep the largest |g| per tensor), powersgd (rank-r factors) or none (full gradient, LowDiff+)."""
    ratio: float = 0.01
    """topk: fraction of each tensor's elements kept, in (0, 1]."""
    rank: int = 4
    """powersgd: rank of the P, Q factors, >= 1."""
    error_feedback: bool = True
    """Add what compression dropped last step to this step's gradient (residual memory)."""

    def __post_init__(self) -> None:
        _check_choice("compressor.name", self.name, COMPRESSORS)
        _check_type("compressor.ratio", self.ratio, (int, float), "a number in (0, 1]")
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"config key 'compressor.ratio' must be in (0, 1], got {self.ratio}")
        _check_min_int("compressor.rank", self.rank, 1)
        _check_type("compressor.error_feedback", self.error_feedback, bool, "true or false")


@dataclass(frozen=True, kw_only=True)
class SnapshotConfig:
    """Full snapshots: the base that the log is replayed from."""

    every_steps: int | str = 100
    """Take a full snapshot every this many optimizer steps (step 0 is always snapshotted); ``auto``: the tuner
    picks it from measured costs and ``tuner.mtbf_hours`` (docs/reference/tuner-model.md)."""
    keep: int = 0
    """Keep only the newest N snapshots and the log they need (0 keeps everything)."""
    shadow: bool = False
    """Write snapshots from a CPU replica the background writer keeps in step with the log, so the training
    thread never copies its state for them. CPU training and compressor none only (see lowdiff/_persist/shadow.py)."""
    background_copy: bool = False
    """CPU training: copy a snapshot's parameters, optimizer and compressor state on a thread of its own while the
    next forward and backward passes run (``opt.step()`` waits for the copy before it changes them). Only if nothing
    writes parameters or optimizer state in place between two ``opt.step()`` calls: an EMA weight swap for an
    evaluation (Lightning's ``EMAWeightAveraging``, ``torch_ema``'s ``copy_to``) or weights loaded into the model
    would end up in the snapshot, and lowdiff cannot see such writes. Not under DDP with compression."""

    def __post_init__(self) -> None:
        _check_min_int_or_auto("snapshot.every_steps", self.every_steps, 1)
        _check_min_int("snapshot.keep", self.keep, 0)
        _check_type("snapshot.shadow", self.shadow, bool, "true or false")
        _check_type("snapshot.background_copy", self.background_copy, bool, "true or false")


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """The differential log: one committed segment file per `batch_steps` steps."""

    batch_steps: int | str = 16
    """Steps per segment file; a crash loses at most this many unflushed steps. ``auto``: the tuner picks the
    smallest batch the writer sustains, raised only while that pays (docs/reference/tuner-model.md)."""
    codec: str = "auto"
    """Lossless compression of payload bytes: none, lz4, zstd, shuffle-lz4 or shuffle-zstd (byte-shuffle first),
    or auto (= none today): lz4 measured ratio 1.00 on full float gradients (docs/measurements/codecs.md) and the
    log came out 1.02x the raw Top-k/PowerSGD payload with lz4 (docs/measurements/overhead.md), so compressing only
    costs CPU."""
    queue_depth: int = 4
    """Segments' worth of records that may wait for the writer before step() blocks (back-pressure)."""
    capture: str = "auto"
    """compressor none: when the gradient is copied off the device. ``layerwise``: a post-accumulate-grad hook
    copies each gradient as backward finishes it (on a GPU the copy overlaps the rest of backward); ``step``:
    all at once in step(), overlapping the inner optimizer step on a GPU; ``auto``: step, which measured as fast
    or faster on CPU and GPU (docs/reference/design.md). A gradient changed after its hook ran (clipping,
    accumulation) is copied again in step()."""
    capture_bucket_bytes: int = 16 << 20
    """``layerwise``: gradients are staged in buckets of at least this many bytes, in the order backward finishes
    them (one concatenation and one copy per bucket); the last, partial bucket is copied in step(). >= 0."""
    backpressure_warn_s: float = 5.0
    """Warn each time training has waited this many seconds more, in all, for a full writer queue (> 0)."""
    persistence: str = "process"
    """Where records are encoded and written: ``process`` (the default: a persistence process of its own, fed
    through shared memory, which outlives the trainer, so a crash of the training process loses no step whose
    ``opt.step()`` returned; docs/guide/durability.md) or ``thread`` (a background thread of the training process:
    a crash loses the steps not yet written, up to ``batch_steps`` of them). Where a persistence process cannot run
    (not Linux, no ``memfd_create``), lowdiff says so and uses the thread."""
    direct_io: bool = True
    """Write snapshots, segments and stop files past the page cache (``O_DIRECT``) where the file system takes it:
    the kernel's copy into the page cache cost the writer's core about 3 ms of system CPU per MB on a shared VM
    (docs/measurements/directio.md), and a checkpoint is read only at a recovery. File systems that refuse it
    (tmpfs, many FUSE mounts) are written through the page cache as before; ``false``: always through it."""
    when_behind: str = "wait"
    """What happens when the disk falls behind the log: ``wait`` (training waits: back-pressure) or ``replica``
    (LowDiff+: the persistence process applies every step to its shadow replica and writes a snapshot of it
    when the disk has room, so training never waits for the disk; steps in between are kept by the process, not
    on disk; needs ``log.persistence: process`` and ``snapshot.shadow: true``; docs/guide/durability.md)."""

    def __post_init__(self) -> None:
        _check_min_int_or_auto("log.batch_steps", self.batch_steps, 1)
        _check_choice("log.codec", self.codec, (*CODECS, "auto"))
        _check_min_int("log.queue_depth", self.queue_depth, 1)
        _check_choice("log.capture", self.capture, CAPTURES)
        _check_min_int("log.capture_bucket_bytes", self.capture_bucket_bytes, 0)
        _check_number("log.backpressure_warn_s", self.backpressure_warn_s, lambda v: v > 0, "a number > 0")
        _check_choice("log.persistence", self.persistence, PERSISTENCE)
        _check_choice("log.when_behind", self.when_behind, WHEN_BEHIND)
        _check_type("log.direct_io", self.direct_io, bool, "true or false")


@dataclass(frozen=True, kw_only=True)
class TunerConfig:
    """What the tuner optimizes for when ``snapshot.every_steps`` or ``log.batch_steps`` is ``auto``."""

    mtbf_hours: float = 24.0
    """Mean time between failures of the whole job (all ranks), in hours; the failure rate is its inverse."""
    max_overhead: float = 0.02
    """Upper bound on checkpoint overhead as a fraction of training time, in (0, 1)."""
    max_log_bytes: int | None = 0
    """Upper bound on the log kept on disk, in bytes; 0 or null: no bound."""
    retune_drift: float = 0.2
    """Re-solve when the measured iteration time or write bandwidth moves by more than this fraction, in (0, 1]."""
    max_buffer_bytes: int = 1 << 30
    """Host memory the records waiting for the writer may take, in bytes (B is chosen so that queue_depth x B
    records fit); 0: no bound."""

    def __post_init__(self) -> None:
        _check_number("tuner.mtbf_hours", self.mtbf_hours, lambda v: 0 < v < float("inf"),
                      "a finite number of hours > 0")
        _check_number("tuner.max_overhead", self.max_overhead, lambda v: 0 < v < 1, "a fraction in (0, 1)")
        if self.max_log_bytes is not None:
            _check_min_int("tuner.max_log_bytes", self.max_log_bytes, 0)
        _check_number("tuner.retune_drift", self.retune_drift, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
        _check_min_int("tuner.max_buffer_bytes", self.max_buffer_bytes, 0)


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """A mirror of the run directory in object storage (docs/guide/durability.md): every committed file is uploaded
    by the persistence side after its local commit, the manifest last, so the remote prefix is always a run
    directory that ``lowdiff.recover(url)`` and ``opt.resume()`` on a new machine read. Needs ``pip install
    lowdiff[remote]`` (fsspec, and s3fs for ``s3://``)."""

    url: str | None = None
    """An fsspec URL: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///mnt/nfs/runs/a``; None: no mirror.
    Endpoint and credentials come from the store's standard sources (for S3: ``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``~/.aws``), never from here."""
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    """Keyword arguments of the fsspec filesystem (e.g. ``{"config_kwargs": {"read_timeout": 60}}`` for s3fs).
    Never written into the run directory or a log line."""
    close_timeout_s: float = 60.0
    """How long ``opt.close()`` waits for the mirror to upload everything committed, then names the steps that are
    not remote-durable (>= 0)."""
    lag_warn_s: float = 300.0
    """Warn once the oldest committed file not yet uploaded has waited this many seconds (> 0)."""

    def __post_init__(self) -> None:
        if self.url is not None:
            _check_type("remote.url", self.url, str, "an fsspec URL such as s3://bucket/prefix")
            scheme, sep, rest = self.url.partition("://")
            if not sep or not scheme or not rest.strip("/") or not scheme.replace("+", "").isalnum():
                raise ConfigError(f"config key 'remote.url' must be an fsspec URL such as s3://bucket/prefix or "
                                  f"file:///mnt/nfs/run, got {self.url!r}")
            if "@" in rest.split("/", 1)[0] or "?" in rest:
                raise ConfigError("config key 'remote.url' must not hold credentials or query parameters: give "
                                  "them in the store's environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) or "
                                  "remote.storage_options")
        _check_type("remote.storage_options", self.storage_options, Mapping, "a mapping of filesystem options")
        if not all(isinstance(k, str) for k in self.storage_options):
            raise ConfigError("config key 'remote.storage_options' must have string keys")
        _check_number("remote.close_timeout_s", self.close_timeout_s, lambda v: 0 <= v < float("inf"),
                      "a finite number of seconds >= 0")
        _check_number("remote.lag_warn_s", self.lag_warn_s, lambda v: 0 < v < float("inf"),
                      "a finite number of seconds > 0")


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything lowdiff needs to know. Build with :meth:`from_dict` or :meth:`from_yaml`."""

    run_dir: str
    """Directory holding the manifest, snapshots and log of one training run."""
    enabled: bool = True
    """false: compress and decode exactly as usual but write nothing (the overhead baseline)."""
    on_write_error: str = "raise"
    """raise: a failed background write is raised at the next step; warn: log it and train on unprotected."""
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    log: LogConfig = field(default_factory=LogConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)

    def __post_init__(self) -> None:
        _check_type("run_dir", self.run_dir, (str, os.PathLike), "a path string")
        if not str(self.run_dir):
            raise ConfigError("config key 'run_dir' must be a non-empty path")
        if str(self.run_dir).startswith("~"):  # a YAML file's "~/runs/a": the user's home, not a folder named "~"
            object.__setattr__(self, "run_dir", os.path.expanduser(str(self.run_dir)))
        _check_type("enabled", self.enabled, bool, "true or false")
        _check_choice("on_write_error", self.on_write_error, ON_WRITE_ERROR)
        if self.snapshot.shadow and self.compressor.name != "none":
            raise ConfigError("config key 'snapshot.shadow' requires 'compressor.name: none' (error-feedback "
                              f"residuals of {self.compressor.name!r} are not in the log); got "
                              f"{self.compressor.name!r}")
        if self.log.when_behind == "replica" and (self.log.persistence != "process" or not self.snapshot.shadow):
            raise ConfigError("config key 'log.when_behind: replica' keeps the steps the disk has not taken in the "
                              "persistence process's shadow replica: it needs 'log.persistence: process' and "
                              f"'snapshot.shadow: true' (got persistence {self.log.persistence!r}, shadow "
                              f"{self.snapshot.shadow})")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build a Config from nested mappings, e.g. parsed YAML. Unknown keys are errors."""
        return _build(cls, data, prefix="")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Config:
        """Load a YAML file; the error names the file on a syntax error."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
        except yaml.YAMLError as e:
            raise ConfigError(f"YAML syntax error in {path}: {e}") from e
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Every setting but ``remote`` (where the run is mirrored is not what the run is, and its storage options
        may hold secrets): this is what manifest.json records."""
        out = dataclasses.asdict(self)
        out["run_dir"] = str(self.run_dir)
        del out["remote"]
        return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: the safe loader keeps the
    last value silently, so an edited file with a leftover line would run a configuration nobody wrote."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def resolve_codec(codec: str, compressor: str) -> str:
    """The codec ``log.codec: auto`` stands for with this compressor."""
    if codec != "auto":
        return codec
    # Measured: no lz4 gain on any payload kind (docs/measurements/codecs.md, docs/measurements/overhead.md). Kept
    # per compressor so a payload that does compress (e.g. low-entropy indices) can opt in here.
    return "none"


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key '{prefix.rstrip('.')}' must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            where = f"'{prefix}{key}'" if prefix else f"'{key}'"
            raise ConfigError(f"unknown config key {where}; allowed keys here: {', '.join(sorted(fields))}")
        ftype = fields[key].type
        sub = _NESTED.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        kwargs[key] = _build(sub, value, f"{prefix}{key}.") if sub is not None else value
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required config key '{prefix}{missing[0]}'")
    return cls(**kwargs)


_NESTED: dict[str, type] = {
    "CompressorConfig": CompressorConfig,
    "SnapshotConfig": SnapshotConfig,
    "LogConfig": LogConfig,
    "TunerConfig": TunerConfig,
    "RemoteConfig": RemoteConfig,
}


def load_config(config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
    """Accept a Config, a dict or a YAML path (what :func:`lowdiff.wrap` takes)."""
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return Config.from_yaml(config)
    raise ConfigError(f"config must be a lowdiff.Config, a dict or a YAML path, got {type(config).__name__}")
