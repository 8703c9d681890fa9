"""The remote tier when the store misbehaves: a store that accepts connections and never answers, a mirror closed
while the store hangs, a damaged manifest in the bucket (tests/remote/conftest.py's real S3 server, and a silent
socket standing for a hung one)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lowdiff_harness import Scenario, Trainer, make_model, make_optimizer

import lowdiff

BASE = Scenario(model="mlp_bn", optimizer="adamw", groups=2, scheduler=False, compressor="topk", ratio=0.25,
                batch_steps=3, every_steps=7, seed=3, persistence="thread")
FAST = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
"""A hung store's request then fails after 2 attempts of 1 + 1 s (S3_CONFIG's attempts, S3_RETRIES) plus backoff."""
FAST_BOUND_S = 8.0
"""What a request failing within FAST's bound (5.1 s) takes at most here (s3fs's own 5 retries made it 30 s)."""


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """An S3 endpoint that accepts every connection and never answers nor reads (a hung store)."""
    pytest.importorskip("s3fs")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        for conn in held:
            conn.close()


@pytest.fixture
def silent(monkeypatch: pytest.MonkeyPatch, s3_env: None) -> Iterator[str]:
    """``AWS_ENDPOINT_URL`` pointing at a :func:`silent_endpoint`."""
    with silent_endpoint() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        yield endpoint


def wrap(scenario: Scenario, run_dir: Path, storage_options: dict[str, Any] | None = None,
         **remote: Any) -> Trainer:
    model = make_model(scenario.model, scenario.seed)
    inner = make_optimizer(scenario.optimizer, model, scenario.model, scenario.groups)
    config = scenario.config(run_dir)
    config["remote"].update(storage_options=storage_options or {}, **remote)
    opt = lowdiff.wrap(inner, model, config)
    return Trainer(scenario, model, inner, opt, None)


def test_a_hung_store_fails_wrap_within_the_bound(tmp_path: Path, silent: str) -> None:
    """An empty run directory and a store that never answers: wrap() refuses (a new run could replace the one the
    store holds) once a request has failed, naming the URL, within the request's bound, not after minutes of
    retries on the training thread. The user's own config_kwargs (a read timeout) keep lowdiff's attempts."""
    url = "s3://hung-bucket/run"
    t0 = time.monotonic()
    with pytest.raises(lowdiff.RemoteStoreError, match=f"cannot list {url}") as e:
        wrap(replace(BASE, remote_url=url), tmp_path / "run", FAST)
    took = time.monotonic() - t0
    assert took < FAST_BOUND_S, f"wrap() took {took:.1f} s against a hung store"
    assert "remote.url" in str(e.value)


def test_a_hung_store_at_wrap_of_a_local_run(tmp_path: Path, s3, caplog: pytest.LogCaptureFixture) -> None:
    """With a local run, a store that never answers at wrap() is a warning naming the URL, within the bound:
    training starts and goes on from the local run."""
    url = f"s3://{s3.new_bucket()}/run"
    scenario = replace(BASE, remote_url=url, remote_close_timeout_s=0.0)
    t = wrap(scenario, tmp_path / "run")
    t.train(1, 3)
    t.opt.close()
    caplog.set_level(logging.WARNING, logger="lowdiff")
    with silent_endpoint() as endpoint, pytest.MonkeyPatch.context() as mp:  # the same bucket, hung
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
        t0 = time.monotonic()
        t = wrap(scenario, tmp_path / "run", FAST)
        took = time.monotonic() - t0
        assert t.opt.resume() == 3
        t.train(4, 5)
        t.opt.close()
    assert took < FAST_BOUND_S, f"wrap() took {took:.1f} s against a hung store"
    said = [r.getMessage() for r in caplog.records if f"cannot list {url}" in r.getMessage()]
    assert said and "resuming from" in said[0], [r.getMessage() for r in caplog.records]


def test_an_upload_to_a_hung_store_is_abandoned_within_the_bound(tmp_path: Path, silent: str) -> None:
    """botocore's read timeout starts only once a request's body is sent, and an upload first waits for the
    store's 100 Continue: without lowdiff's own limit an upload to a hung store waited forever (the mirror with
    it). It fails, naming the URL, within the request's bound plus its bytes' time."""
    from lowdiff._storage.remote import Store

    store = Store("s3://hung-bucket/run", FAST)
    assert store.request_s is not None and store.request_s < FAST_BOUND_S - 2
    (tmp_path / "f.h5").write_bytes(bytes(64 * 1024))  # + 0.5 s at PUT_MIN_BYTES_PER_S
    failed: list[BaseException] = []

    def put() -> None:
        try:
            store.put(tmp_path / "f.h5", "snapshots/step-0000000007.h5")
        except BaseException as e:
            failed.append(e)

    t0 = time.monotonic()
    worker = threading.Thread(target=put, daemon=True)
    worker.start()
    worker.join(FAST_BOUND_S + 5)
    assert not worker.is_alive(), f"the upload still waits after {time.monotonic() - t0:.0f} s"
    assert time.monotonic() - t0 < FAST_BOUND_S
    assert failed and isinstance(failed[0], lowdiff.RemoteStoreError), failed
    assert "s3://hung-bucket/run" in str(failed[0]) and "no answer" in str(failed[0])


@contextlib.contextmanager
def own_server() -> Iterator[Any]:
    """An S3 server of the test's own (stopping the session's would stall the other tests); AWS_ENDPOINT_URL
    points at it meanwhile."""
    from s3server import start_server, stop_server

    server = start_server()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AWS_ENDPOINT_URL", server.endpoint)
            yield server
    finally:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
            stop_server(server)


def wait_remote_durable(opt: lowdiff.LowDiffOptimizer, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (opt.stats.remote_durable_step == opt.stats.durable_step and opt.stats.remote_lag_steps == 0):
        assert time.monotonic() < deadline, f"the mirror did not catch up: {opt.stats}"
        time.sleep(0.1)


def test_the_mirror_stops_at_close(tmp_path: Path, s3_env: None, caplog: pytest.LogCaptureFixture) -> None:
    """log.persistence: thread, the store hangs (SIGSTOP), close() gives up after remote.close_timeout_s: once it
    has returned, the mirror neither uploads (beyond the upload it was in) nor logs, even when the store answers
    again (it went on with the pass, warned about its lag and uploaded a snapshot)."""
    with own_server() as server:
        url = f"s3://{server.new_bucket()}/run"
        prefix = url[len("s3://"):]
        t = wrap(replace(BASE, remote_url=url, remote_close_timeout_s=1.0), tmp_path / "run")
        t.train(1, 5)
        t.opt.flush()
        wait_remote_durable(t.opt)
        before = set(server.fs().find(prefix))
        caplog.set_level(logging.INFO, logger="lowdiff")
        os.kill(server.proc.pid, signal.SIGSTOP)
        t.train(6, 12)  # snapshot 7 and three segments wait for the store
        t.opt.close()
        said = len(caplog.records)
        assert any("not remote-durable" in r.getMessage() for r in caplog.records)
        record = (tmp_path / "run" / "mirror.json").stat().st_mtime_ns
        time.sleep(3.0)  # past remote.lag_warn_s (3 s in the harness) since step 6 waits
        os.kill(server.proc.pid, signal.SIGCONT)
        time.sleep(5.0)  # the upload in flight ends; the old mirror went on with its pass, its record, its warning
        late = [f"{r.name}: {r.getMessage()}" for r in caplog.records[said:]]
        assert not late, late
        after = set(server.fs().find(prefix))
        assert len(after - before) <= 1, sorted(after - before)
        assert (tmp_path / "run" / "mirror.json").stat().st_mtime_ns == record


def test_a_damaged_manifest_in_the_bucket_is_named_by_its_url(tmp_path: Path, s3) -> None:
    """The bucket's manifest.json truncated: wrap() refuses, naming that object by its URL (not the temporary
    directory it was fetched into, already removed), saying whether the local run is intact and what to do; an
    empty run directory gets nothing pulled into it."""
    url = f"s3://{s3.new_bucket()}/run"
    scenario = replace(BASE, remote_url=url)
    t = wrap(scenario, tmp_path / "run")
    t.train(1, 6)
    t.opt.close()
    fs, manifest = s3.fs(), f"{url[len('s3://'):]}/manifest.json"
    fs.pipe(manifest, fs.cat(manifest)[:40])
    with pytest.raises(lowdiff.CorruptFileError) as e:
        wrap(scenario, tmp_path / "run")
    said = str(e.value)
    assert f"{url}/manifest.json: not valid JSON" in said and "lowdiff-remote-" not in said, said
    assert f"{tmp_path / 'run'} is intact" in said and "remote.url to null" in said, said
    with pytest.raises(lowdiff.CorruptFileError) as e:
        wrap(scenario, tmp_path / "new")
    said = str(e.value)
    assert f"{url}/manifest.json" in said and "nothing was pulled" in said, said
    assert not (tmp_path / "new" / "manifest.json").exists()
    assert lowdiff.recover(tmp_path / "run").step == 6
    fs.rm(manifest)  # what the message offers: the mirror then uploads the local run's manifest
    t = wrap(scenario, tmp_path / "run")
    assert t.opt.resume() == 6
    t.train(7, 8)
    t.opt.close()
    assert lowdiff.recover(url).step == 8


def test_recovery_names_the_damaged_objects_by_their_urls(tmp_path: Path, s3,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A truncated snapshot and a foreign segment in the bucket: recover(url) steps around them and says so, in
    report.skipped, summary() and its warnings, by their URLs (not the temporary directory they were fetched into,
    removed by then), each warning once although the run is fetched twice."""
    url = f"s3://{s3.new_bucket()}/run"
    t = wrap(replace(BASE, remote_url=url), tmp_path / "run")
    t.train(1, 16)
    t.opt.close()
    fs, prefix = s3.fs(), url[len("s3://"):]
    newest = f"{prefix}/snapshots/step-0000000014.h5"
    fs.pipe(newest, fs.cat(newest)[:1000])
    fs.pipe(f"{prefix}/log/steps-0000000017-0000000018.h5", fs.cat(f"{prefix}/log/steps-0000000001-0000000003.h5"))
    caplog.set_level(logging.WARNING, logger="lowdiff")
    rec = lowdiff.recover(url)
    assert rec.step == 16 and rec.report.snapshot_step == 7
    texts = [*rec.report.skipped, rec.report.summary(), *(r.getMessage() for r in caplog.records)]
    assert not [s for s in texts if "lowdiff-remote-" in s], texts
    assert any(f"{url}/snapshots/step-0000000014.h5: " in s for s in rec.report.skipped), rec.report.skipped
    assert any(f"{url}/log/steps-0000000017-0000000018.h5: " in s for s in rec.report.skipped), rec.report.skipped
    assert f"skipped: {url}/snapshots/step-0000000014.h5" in rec.report.summary()
    warned = [r.getMessage() for r in caplog.records if "stepping around" in r.getMessage()]
    assert len(warned) == len(set(warned)) == 2, warned


def test_a_restarted_mirror_starts_from_what_it_uploaded(tmp_path: Path, s3_env: None,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Steps 0-5 went up, then the store went away: a trainer resuming the local run starts its remote-durable step
    at 5 (mirror.json's record), so its lag warning and close() name the steps after 5, not every step from 0."""
    from s3server import stop_server

    with own_server() as server:
        url = f"s3://{server.new_bucket()}/run"
        scenario = replace(BASE, remote_url=url, remote_close_timeout_s=1.0)
        t = wrap(scenario, tmp_path / "run")
        t.train(1, 5)
        t.opt.close()
        stop_server(server)
        caplog.set_level(logging.WARNING, logger="lowdiff")
        t = wrap(scenario, tmp_path / "run", FAST)
        assert t.opt.resume() == 5
        assert t.opt.stats.remote_durable_step == 5
        t.train(6, 8)
        time.sleep(4.0)  # past remote.lag_warn_s (3 s in the harness)
        t.opt.close()
    said = [r.getMessage() for r in caplog.records]
    assert [s for s in said if "behind (remote-durable step 5, local" in s and "steps after 5" in s], said
    assert [s for s in said if "steps 6 to 8 are not remote-durable" in s], said
