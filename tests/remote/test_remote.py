"""The remote tier against a real S3 server (tests/remote/conftest.py): a run mirrored to a bucket is recovered, and
resumed, from the bucket alone, exactly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from lowdiff_harness import Scenario, assert_state_equal, start, train_run

import lowdiff

STEPS = 20
BASE = Scenario(model="mlp_bn", optimizer="adamw", groups=2, scheduler=True, compressor="topk", ratio=0.25,
                batch_steps=3, every_steps=7, seed=3)


def wait_remote_durable(opt: lowdiff.LowDiffOptimizer, timeout_s: float = 60.0) -> lowdiff.CheckpointStats:
    """Poll ``opt.stats`` until the mirror has caught up with the local durable step."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = opt.stats
        if st.remote_durable_step == st.durable_step and st.remote_lag_steps == 0:
            return st
        assert time.monotonic() < deadline, f"the mirror did not catch up: {st}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Uninterrupted runs without a remote, per compressor."""
    return {c: train_run(replace(BASE, compressor=c), tmp_path_factory.mktemp(f"ref-{c}") / "run", STEPS)
            for c in ("topk", "none")}


@pytest.mark.parametrize("compressor,persistence", [("topk", "process"), ("none", "thread")])
def test_recover_from_the_bucket_alone(tmp_path: Path, s3, reference, compressor: str, persistence: str,
                                       caplog: pytest.LogCaptureFixture) -> None:
    url = f"s3://{s3.new_bucket()}/runs/a"
    scenario = replace(BASE, compressor=compressor, persistence=persistence, remote_url=url)
    t = train_run(scenario, tmp_path / "run", STEPS, close=False)
    t.opt.flush()
    st = wait_remote_durable(t.opt)
    assert st.remote_durable_step == STEPS and st.remote_lag_bytes == 0 and st.remote_lag_s == 0.0
    t.opt.close()
    shutil.rmtree(tmp_path / "run")  # the machine is lost

    import logging

    caplog.set_level(logging.INFO, logger="lowdiff")
    rec = lowdiff.recover(url)
    assert rec.step == STEPS
    assert_state_equal(*reference[compressor].refs[STEPS], rec)
    # Only what step 20 needs came down: the snapshot of step 14 and the log after it, not snapshots 0 and 7.
    fetches = [r.getMessage() for r in caplog.records if "fetched" in r.getMessage()]
    in_bucket = len([n for n in s3.fs().find(url[len("s3://"):]) if not n.endswith("/claim.json")])
    assert len(fetches) == 1, fetches
    assert int(fetches[0].split("fetched ")[1].split()[0]) < in_bucket - 2, (in_bucket, fetches)
    older = lowdiff.recover(url, step=STEPS - 5)
    assert_state_equal(*reference[compressor].refs[STEPS - 5], older)
    assert lowdiff.verify(url).ok
    assert f"{STEPS}" in lowdiff.inspect(url).summary()

    out = tmp_path / "state.pt"
    cli = shutil.which("lowdiff-recover")
    cmd = [cli] if cli else [sys.executable, "-c", "import sys, lowdiff._recovery.cli as c; sys.exit(c.recover_main())"]
    done = subprocess.run([*cmd, url, "--output", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import torch

    saved = torch.load(out, weights_only=True)
    assert saved["step"] == STEPS
    assert_state_equal(*reference[compressor].refs[STEPS], SimpleNamespace(**saved))


def test_resume_on_a_new_machine(tmp_path: Path, s3, reference) -> None:
    """A clean stop at step 12, the machine lost: a new machine with an empty run directory pulls the run and
    continues exactly (Top-k: the compressor's memory of the clean stop went up too)."""
    url = f"s3://{s3.new_bucket()}/run"
    scenario = replace(BASE, persistence="process", remote_url=url)
    train_run(scenario, tmp_path / "old", 12)
    shutil.rmtree(tmp_path / "old")

    t = start(scenario, tmp_path / "new", resume=False)
    k = t.opt.resume()
    assert k == 12
    t.train(13, STEPS)
    assert_state_equal(*reference["topk"].ends[STEPS], SimpleNamespace(model=t.model.state_dict(),
                                                                      optimizer=t.inner.state_dict()))
    t.opt.close()
    shutil.rmtree(tmp_path / "new")
    assert_state_equal(*reference["topk"].refs[STEPS], lowdiff.recover(url))


KILL_SCENARIO = replace(BASE, scheduler=False, persistence="process", batch_steps=4, every_steps=6)
"""No object tracked at the end of an iteration: the iteration in progress at the kill is kept too."""
KILL_CHILD = Path(__file__).parents[1] / "integration" / "kill9_child.py"


def _latest_in_bucket(url: str) -> int:
    try:
        return lowdiff.inspect(url).latest_step or -1
    except lowdiff.LowDiffError:
        return -1


def test_trainer_sigkilled_then_machine_lost(tmp_path: Path, s3) -> None:
    """SIGKILL of the trainer at step 15: its persistence process commits what it holds and uploads it before it
    exits; then the local disk goes. The bucket alone gives back every step whose opt.step() returned, exactly."""
    import json
    import os
    import signal

    reference = train_run(KILL_SCENARIO, tmp_path / "ref", 40)
    url = f"s3://{s3.new_bucket()}/killed"
    scenario = replace(KILL_SCENARIO, remote_url=url)
    proc = subprocess.Popen([sys.executable, str(KILL_CHILD), str(tmp_path / "run"), json.dumps(scenario.to_dict()),
                             "40"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("START"):
                continue
            if line.strip() == "DONE":
                break
            seen = int(line.split()[0])
            if seen >= 15:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert seen >= 15
    deadline = time.monotonic() + 120
    while _latest_in_bucket(url) < seen:
        assert time.monotonic() < deadline, f"the bucket never reached step {seen} ({_latest_in_bucket(url)})"
        time.sleep(0.5)
    time.sleep(1.0)  # the persistence process's last pass (the manifest is unchanged; nothing else goes up)
    shutil.rmtree(tmp_path / "run")  # the machine is lost
    rec = lowdiff.recover(url)
    assert rec.step >= seen
    assert_state_equal(*reference.refs[rec.step], rec)


def test_server_frozen_then_resumed(tmp_path: Path, s3_env, reference, caplog: pytest.LogCaptureFixture) -> None:
    """The S3 server stopped with SIGSTOP for 12 s mid-run: training goes on at its pace, the lag is reported and
    warned about, and once the server runs again the mirror catches up; the bucket then recovers exactly."""
    import logging
    import os
    import signal

    from s3server import start_server, stop_server

    server = start_server()  # a server of this test's own: stopping the session's would stall the other tests
    before = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    try:
        url = f"s3://{server.new_bucket()}/frozen"
        t = start(replace(BASE, persistence="thread", remote_url=url), tmp_path / "run")
        t.train(1, 5)
        t.opt.flush()
        wait_remote_durable(t.opt)
        caplog.set_level(logging.WARNING, logger="lowdiff")
        os.kill(server.proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            step_s = []
            for k in range(6, STEPS + 1):
                t0 = time.perf_counter()
                t.step(k)
                step_s.append(time.perf_counter() - t0)
                time.sleep(0.5)
            while time.monotonic() - frozen_at < 12:
                time.sleep(0.2)
            t.opt.flush()
            st = t.opt.stats
            assert st.durable_step == STEPS and st.remote_durable_step < STEPS
            assert st.remote_lag_steps > 0 and st.remote_lag_s > 5
            assert max(step_s) < 5, f"a training step waited for the store: {max(step_s):.1f} s"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert any("behind" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        st = wait_remote_durable(t.opt, timeout_s=180)
        assert st.remote_durable_step == STEPS
        t.opt.close()
        shutil.rmtree(tmp_path / "run")
        assert_state_equal(*reference["topk"].refs[STEPS], lowdiff.recover(url))
    finally:
        if before is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = before
        stop_server(server)


@pytest.fixture
def mirrored(tmp_path: Path, s3) -> tuple[str, str]:
    """A closed 20-step Top-k run in a fresh bucket, its local directory gone: (url, bucket path)."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/run"
    train_run(replace(BASE, persistence="thread", remote_url=url), tmp_path / "run", STEPS)
    shutil.rmtree(tmp_path / "run")
    return url, f"{bucket}/run"


def test_foreign_and_garbage_objects_are_stepped_around(s3, mirrored, reference) -> None:
    url, prefix = mirrored
    fs = s3.fs()
    fs.pipe(f"{prefix}/log/steps-0000000021-0000000024.h5", b"\x89HDF\r\n\x1a\n" + bytes(5000))  # not a segment
    fs.pipe(f"{prefix}/notes.txt", b"someone else's object")
    fs.pipe(f"{prefix}/snapshots/step-0000000099.h5.tmp", b"half an upload")
    rec = lowdiff.recover(url)
    assert rec.step == STEPS and rec.report.skipped
    assert_state_equal(*reference["topk"].refs[STEPS], rec)
    report = lowdiff.verify(url)
    assert not report.ok and any(url in p for p in report.problems), report.problems


def test_a_truncated_object_falls_back_to_an_older_step(s3, mirrored, reference) -> None:
    url, prefix = mirrored
    fs = s3.fs()
    newest = max(fs.find(f"{prefix}/log"))
    whole = fs.cat(newest)
    fs.pipe(newest, whole[: len(whole) // 2])
    rec = lowdiff.recover(url)
    assert rec.step < STEPS
    assert_state_equal(*reference["topk"].refs[rec.step], rec)
    assert not lowdiff.verify(url).ok


def test_another_runs_manifest_is_refused(tmp_path: Path, s3, mirrored) -> None:
    url, prefix = mirrored
    other = f"s3://{s3.new_bucket()}/other"
    train_run(replace(BASE, persistence="thread", remote_url=other, seed=11), tmp_path / "other", 4)
    fs = s3.fs()
    fs.pipe(f"{prefix}/manifest.json", fs.cat(f"{other[len('s3://'):]}/manifest.json"))
    with pytest.raises(lowdiff.LowDiffError) as e:
        lowdiff.recover(url)
    assert url in str(e.value) or "run" in str(e.value)
    # A trainer whose local run directory holds a run of its own refuses a prefix that holds another run.
    train_run(replace(BASE, persistence="thread"), tmp_path / "mine", 3)
    with pytest.raises(lowdiff.RemoteStoreError, match="another run"):
        start(replace(BASE, persistence="thread", remote_url=other), tmp_path / "mine").opt.close()


def test_an_empty_prefix_is_no_run(s3) -> None:
    with pytest.raises(lowdiff.RemoteStoreError, match="holds no lowdiff run"):
        lowdiff.recover(f"s3://{s3.new_bucket()}/nothing")


def test_retention_reaches_the_bucket(tmp_path: Path, s3) -> None:
    """snapshot.keep: 2: the bucket ends with exactly the local run's files and the prefix's claim (old snapshots
    and their log deleted there too, each after the newer snapshot went up). Credentials given in
    remote.storage_options are used and written nowhere: not in the run directory, not in the bucket."""
    import lowdiff_harness

    url = f"s3://{s3.new_bucket()}/kept"
    scenario = replace(BASE, persistence="process", remote_url=url)
    model = lowdiff_harness.make_model(scenario.model, scenario.seed)
    inner = lowdiff_harness.make_optimizer(scenario.optimizer, model, scenario.model, scenario.groups)
    config = scenario.config(tmp_path / "run")
    config["snapshot"]["keep"] = 2
    secret = "SECRET-MARKER-5f2c"
    config["remote"]["storage_options"] = {"key": "lowdiff-test", "secret": secret}
    opt = lowdiff.wrap(inner, model, config)
    t = lowdiff_harness.Trainer(scenario, model, inner, opt, None)
    t.train(1, 30)
    opt.close()
    local = {str(p.relative_to(tmp_path / "run")) for sub in ("snapshots", "log", "stops")
             for p in (tmp_path / "run" / sub).iterdir()} | {"manifest.json"}
    prefix = url[len("s3://"):]
    remote = {p[len(prefix) + 1:] for p in s3.fs().find(prefix)}
    assert remote == local | {"claim.json"}  # and the prefix's claim (FORMAT.md section 1)
    assert len([n for n in remote if n.startswith("snapshots/")]) == 2
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not [n for n in s3.fs().find(prefix) if secret.encode() in s3.fs().cat(n)]
    assert_state_equal(*t.refs[30], lowdiff.recover(url))


def test_the_mirror_deletes_only_what_it_put_there(tmp_path: Path, s3) -> None:
    """An object under the prefix that this run directory never uploaded (another tool's, an earlier run's log
    named like this one's) is left alone; the run's own files still arrive and recover exactly."""
    url = f"s3://{s3.new_bucket()}/shared"
    prefix = url[len("s3://"):]
    stranger = f"{prefix}/log/steps-0000009000-0000009001.h5"
    s3.fs().pipe(stranger, b"not lowdiff's")
    scenario = replace(BASE, persistence="process", remote_url=url)
    t = train_run(scenario, tmp_path / "run", 8, close=False)
    t.opt.flush()
    wait_remote_durable(t.opt)
    t.opt.close()
    assert s3.fs().cat(stranger) == b"not lowdiff's"
    assert_state_equal(*t.refs[8], lowdiff.recover(url))


def test_the_newer_of_local_and_remote_wins(tmp_path: Path, s3, caplog: pytest.LogCaptureFixture) -> None:
    """Machines come back with stale copies of the run while the bucket holds step 14, and the bucket's run is
    pulled (the stale files moved to quarantine/) and said so: a copy of the same history taken at step 10, and one
    taken at step 6, before the resume that continued the run (the bucket resumed since, whatever the steps). A
    local run as new as the bucket is kept."""
    import logging

    url = f"s3://{s3.new_bucket()}/run"
    scenario = replace(BASE, persistence="thread", remote_url=url)
    train_run(scenario, tmp_path / "a", 6)
    shutil.copytree(tmp_path / "a", tmp_path / "stale")
    t = start(scenario, tmp_path / "a")
    t.train(7, 10)
    t.opt.flush()
    shutil.copytree(tmp_path / "a", tmp_path / "behind")
    t.train(11, 14)
    t.opt.close()

    caplog.set_level(logging.WARNING, logger="lowdiff")
    tb = start(scenario, tmp_path / "behind", resume=False)
    assert tb.opt.resume() == 14
    tb.opt.close()
    said = [r.getMessage() for r in caplog.records if "is newer than" in r.getMessage()]
    assert said and "pulled it" in said[0] and "quarantine" in said[0], [r.getMessage() for r in caplog.records]
    assert list((tmp_path / "behind" / "quarantine").rglob("*.h5"))

    caplog.clear()
    t2 = start(scenario, tmp_path / "stale", resume=False)
    assert t2.opt.resume() == 14
    wait_remote_durable(t2.opt)  # its resume is in the bucket's manifest
    t2.opt.close()
    said = [r.getMessage() for r in caplog.records if "resumed the run since" in r.getMessage()]
    assert said and "pulled it" in said[0] and "quarantine" in said[0], [r.getMessage() for r in caplog.records]
    assert list((tmp_path / "stale" / "quarantine").rglob("*.h5"))

    caplog.clear()
    t3 = start(scenario, tmp_path / "stale", resume=False)  # as new as the bucket: the local run is used
    assert t3.opt.resume() == 14
    t3.opt.close()
    assert any("at least as new as" in r.getMessage() for r in caplog.records)


def test_a_resume_since_the_other_side_was_written_wins_over_a_higher_step(tmp_path: Path, s3,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Steps 1-20 go to the bucket, and a restart (a resume at step 20, which starts a branch) too; then, with the
    mirror off (the store down), the machine resumes at snapshot 14, going back past that branch's start, and
    trains the new history to 19. The bucket's file names reach step 20, of the history that resume went back from:
    the local run is kept, not replaced by it. A stale copy of the run from before that resume (also up to step 20)
    meets the bucket once the mirror has caught up: the bucket resumed since, and is pulled."""
    import logging

    url = f"s3://{s3.new_bucket()}/run"
    mirrored = replace(BASE, persistence="thread", remote_url=url)
    t = start(mirrored, tmp_path / "a")
    t.train(1, 20)
    t.opt.close()
    t = start(mirrored, tmp_path / "a")  # resumes at 20: a branch of its own, in the bucket's manifest too
    t.opt.flush()
    wait_remote_durable(t.opt)
    t.opt.close()
    shutil.copytree(tmp_path / "a", tmp_path / "stale")
    t = start(replace(mirrored, remote_url=None), tmp_path / "a", resume=False)
    assert t.opt.resume(at="snapshot") == 14
    t.train(15, 19)
    t.opt.close()
    new_history = lowdiff.recover(tmp_path / "a")

    caplog.set_level(logging.WARNING, logger="lowdiff")
    t2 = start(mirrored, tmp_path / "a", resume=False)
    assert t2.opt.resume() == 19
    t2.opt.flush()
    wait_remote_durable(t2.opt)
    t2.opt.close()
    assert any("resumed the run since" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "a" / "quarantine").glob("replaced-by-remote-*"))

    t3 = start(mirrored, tmp_path / "stale", resume=False)  # up to step 20, of the history the resume left
    assert t3.opt.resume() == 19
    t3.opt.close()
    assert list((tmp_path / "stale" / "quarantine").glob("replaced-by-remote-*"))
    assert_state_equal(new_history.model, new_history.optimizer, lowdiff.recover(url))


def test_a_stale_copy_opened_while_the_store_is_down_never_replaces_the_newer_bucket_run(
        tmp_path: Path, s3, caplog: pytest.LogCaptureFixture) -> None:
    """A copy of the run at step 6 is opened on another machine while the store does not answer, so wrap() cannot
    compare it with the bucket (which another machine has taken to step 14 since) and the trainer goes on from the
    copy. Before, the mirror's first pass, once the store answered, uploaded the copy's branch and manifest over the
    bucket's newer run (recovery from the bucket went back from step 14 to 8, found in a review). Now it uploads
    nothing, says why and what to do, and reports nothing remote-durable; the bucket keeps its run."""
    import logging

    from s3server import Outage, relayed

    url = f"s3://{s3.new_bucket()}/run"
    mirrored = replace(BASE, persistence="thread", remote_url=url)
    t = start(mirrored, tmp_path / "a")
    t.train(1, 6)
    t.opt.flush()
    wait_remote_durable(t.opt)
    t.opt.close()
    shutil.copytree(tmp_path / "a", tmp_path / "stale", ignore=shutil.ignore_patterns("*.lock"))
    t = start(mirrored, tmp_path / "a")
    t.train(7, 14)
    t.opt.flush()
    wait_remote_durable(t.opt)
    t.opt.close()
    bucket = lowdiff.recover(url)
    assert bucket.step == 14

    caplog.set_level(logging.WARNING, logger="lowdiff")
    with relayed(Outage(s3.endpoint)) as relay:
        down = {"client_kwargs": {"endpoint_url": relay.endpoint},
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10}}
        t2 = start(replace(mirrored, remote_storage_options=down), tmp_path / "stale")
        assert any("cannot list" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        relay.up.set()
        t2.train(7, 8)
        t2.opt.flush()
        said = not_mirrored(caplog)
        assert "holds a newer state of this run" in said and "reaches step 14" in said, said
        assert t2.opt.stats.remote_durable_step == -1
        t2.opt.close()
    again = lowdiff.recover(url)
    assert again.step == 14
    assert_state_equal(bucket.model, bucket.optimizer, again)


def test_a_file_gone_while_recovery_fetches_it_is_listed_again(tmp_path: Path, s3) -> None:
    """Recovery from a bucket a trainer still mirrors to: the newest snapshot, listed, is deleted before its GET
    reaches the store (as the trainer's retention does once a newer snapshot is up). Before, recovery failed
    ("fetching ... failed"); now it lists again and recovers the newest step from the snapshot before."""
    from s3server import OnRequest, relayed

    url = f"s3://{s3.new_bucket()}/run"
    prefix = url[len("s3://"):]
    t = train_run(replace(BASE, persistence="thread", remote_url=url), tmp_path / "run", 16)
    fs = s3.fs()
    newest = max(fs.find(f"{prefix}/snapshots"), key=_step_of_name)
    assert _step_of_name(newest) == 14
    with relayed(OnRequest(s3.endpoint, (b"GET /", newest.rsplit("/", 1)[1].encode()),
                           lambda: fs.rm(newest))) as relay:
        rec = lowdiff.recover(url, storage_options={"client_kwargs": {"endpoint_url": relay.endpoint}})
        assert relay.fired.is_set()
    assert rec.step == 16 and rec.report.snapshot_step == 7
    assert_state_equal(*t.refs[16], rec)


def _step_of_name(path: str) -> int:
    return int(path.rsplit("/", 1)[1].split(".")[0].rsplit("-", 1)[1])


def test_an_object_the_mirror_never_uploaded_does_not_complete_a_set(tmp_path: Path) -> None:
    """Under DDP a set is complete once every rank's shard is there. Rank 0's shard of steps 4-6 is committed, rank
    1's not yet; the prefix holds a rank-1 shard of that name from another history (never uploaded from here, not in
    mirror.json). Before, the mirror counted it and reported step 6 remote-durable (found in a review); now only
    what this run directory put there counts (the mirror itself: lowdiff._persist.mirror)."""
    from lowdiff._persist.mirror import Mirror
    from lowdiff._persist.writer import WriterStats

    root, store = tmp_path / "run", tmp_path / "store"
    train_run(replace(BASE, persistence="thread", every_steps=100), root, 3)
    first = Mirror(root, {"url": f"file://{store}"}, WriterStats(), durable_step=3)
    first.kick(3)
    assert first.close(30) == 3
    (root / "log" / "steps-0000000004-0000000006.shard-00000-of-00002.h5").write_bytes(b"rank 0's shard")
    (store / "log" / "steps-0000000004-0000000006.shard-00001-of-00002.h5").write_bytes(b"another history's")
    stats = WriterStats()
    mirror = Mirror(root, {"url": f"file://{store}"}, stats, durable_step=3)
    mirror.kick(6)
    deadline = time.monotonic() + 30
    while not (store / "log" / "steps-0000000004-0000000006.shard-00000-of-00002.h5").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # the pass that uploaded it has reported
    assert mirror.close(1) == 3 and stats.remote_durable_step == 3


def test_a_second_trainer_on_the_prefix_stops_the_mirror(tmp_path: Path, s3, caplog: pytest.LogCaptureFixture) -> None:
    """Two trainers started at once on one empty prefix both found it empty at ``wrap()``. Once the other's manifest
    is there (put here as its mirror puts it), this one's next pass stops mirroring with an error naming both runs:
    it neither overwrites that manifest nor goes on reporting steps as remote-durable under a prefix holding
    another run."""
    import logging

    url = f"s3://{s3.new_bucket()}/run"
    t = start(replace(BASE, persistence="thread", remote_url=url), tmp_path / "a")
    t.train(1, 4)
    t.opt.flush()
    before = wait_remote_durable(t.opt).remote_durable_step
    train_run(replace(BASE, persistence="thread"), tmp_path / "other", 2)
    other_id = lowdiff.inspect(tmp_path / "other").manifest.run_id
    s3.fs().put_file(str(tmp_path / "other" / "manifest.json"), f"{url[len('s3://'):]}/manifest.json")

    caplog.set_level(logging.ERROR, logger="lowdiff")
    t.train(5, 12)
    t.opt.flush()
    said = not_mirrored(caplog)
    assert other_id in said and "Another trainer mirrors to that prefix too" in said
    assert t.opt.stats.remote_durable_step == before
    t.opt.close()
    got = json.loads(s3.fs().cat(f"{url[len('s3://'):]}/manifest.json"))
    assert got["run_id"] == other_id  # the other run's manifest stands


def not_mirrored(caplog: pytest.LogCaptureFixture, within_s: float = 60.0) -> str:
    """The mirror's "the run is not mirrored" error, once logged (waited for up to ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        said = [r.getMessage() for r in caplog.records]
        hit = next((m for m in said if "not mirrored" in m), None)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, said
        time.sleep(0.1)


def _run_files(root: Path) -> dict[str, bytes]:
    """The run's files the mirror carries, ``name: bytes``, under a local run directory or a fetched prefix."""
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.h5"))
             if p.parent.name in ("snapshots", "log", "stops")}
    return files | {"manifest.json": (root / "manifest.json").read_bytes()}


def test_two_trainers_on_one_empty_prefix(tmp_path: Path, s3, caplog: pytest.LogCaptureFixture) -> None:
    """A job launched twice: both trainers find the prefix empty at ``wrap()``. The first one's first upload is
    held in flight (a slow network) while the second wraps, trains and mirrors; once it reaches the store, it
    replaces nothing of the second run: that mirror stops before uploading anything, with an error naming both
    runs and the URL, and the bucket holds the second run alone, recovered exactly."""
    import logging

    from s3server import HeldUploads, relayed

    url = f"s3://{s3.new_bucket()}/run"
    prefix = url[len("s3://"):]
    caplog.set_level(logging.ERROR, logger="lowdiff")
    with relayed(HeldUploads(s3.endpoint)) as relay:
        slow = {"client_kwargs": {"endpoint_url": relay.endpoint}, "config_kwargs": {"read_timeout": 120}}
        a = start(replace(BASE, persistence="thread", remote_url=url, remote_storage_options=slow,
                          remote_close_timeout_s=5.0), tmp_path / "a")
        assert relay.held.wait(60), "the first trainer's mirror uploaded nothing"
        b = start(replace(BASE, persistence="thread", remote_url=url, seed=11), tmp_path / "b")
        b.train(1, 8)
        b.opt.flush()
        wait_remote_durable(b.opt)
        mine = _run_files(tmp_path / "b")
        relay.release()
        a.train(1, 8)
        a.opt.flush()
        not_mirrored(caplog)
        a_durable = a.opt.stats.remote_durable_step
        a.opt.close()
    b.opt.close()
    fs = s3.fs()
    got = tmp_path / "bucket"
    fs.get(prefix, str(got), recursive=True)
    assert _run_files(got) == _run_files(tmp_path / "b") and set(_run_files(got)) >= set(mine)
    rec = lowdiff.recover(url)
    assert rec.step == 8
    assert_state_equal(*b.refs[8], rec)
    a_id = lowdiff.inspect(tmp_path / "a").manifest.run_id
    b_id = lowdiff.inspect(tmp_path / "b").manifest.run_id
    said = next(r.getMessage() for r in caplog.records if "not mirrored" in r.getMessage())
    assert a_id in said and b_id in said and url in said and "is claimed by another run" in said, said
    assert a_durable == -1
    assert json.loads(fs.cat(f"{prefix}/claim.json"))["run_id"] == b_id


def test_a_prefix_claimed_by_another_run_is_refused_at_wrap(tmp_path: Path, s3) -> None:
    """A prefix holding no manifest but another run's claim (its trainer started there first and has not uploaded
    its manifest yet, or stopped before it did): wrap() refuses it for a new run and for another local run, naming
    both runs, the URL and the claim to delete; the run the claim names goes on there (a restart), and once the
    claim is deleted the prefix is free again. A damaged claim is refused by its URL. The claim is no run file:
    recovery from the bucket neither fetches nor minds it."""
    url = f"s3://{s3.new_bucket()}/run"
    prefix, fs = url[len("s3://"):], s3.fs()
    other = "0123456789abcdef" * 2
    fs.pipe(f"{prefix}/claim.json", json.dumps({"run_id": other, "by": "pid 7 on elsewhere"}).encode())
    scenario = replace(BASE, persistence="thread", remote_url=url)
    with pytest.raises(lowdiff.RemoteStoreError) as e:
        start(scenario, tmp_path / "new")
    said = str(e.value)
    assert f"is claimed by another run (run id {other}, pid 7 on elsewhere)" in said and url in said, said
    assert f"delete {url}/claim.json" in said, said
    train_run(replace(BASE, persistence="thread"), tmp_path / "mine", 3)
    mine = lowdiff.inspect(tmp_path / "mine").manifest.run_id
    with pytest.raises(lowdiff.RemoteStoreError, match=f"run id {other}.* than .*run id {mine}"):
        start(scenario, tmp_path / "mine")
    assert not fs.find(f"{prefix}/snapshots")

    fs.pipe(f"{prefix}/claim.json", json.dumps({"run_id": mine}).encode())  # the run in "mine" claimed it
    t = start(scenario, tmp_path / "mine")
    t.train(4, 6)
    t.opt.close()
    assert lowdiff.recover(url).step == 6
    assert json.loads(fs.cat(f"{prefix}/claim.json")) == {"run_id": mine}  # left as it is

    fs.pipe(f"{prefix}/claim.json", b"{not json")
    fs.rm(f"{prefix}/manifest.json")
    with pytest.raises(lowdiff.CorruptFileError, match=f"{url}/claim.json: not valid JSON"):
        start(scenario, tmp_path / "new")
    fs.rm(f"{prefix}/claim.json")  # what the message offers
    t = train_run(scenario, tmp_path / "new", 2, close=False)
    t.opt.flush()
    wait_remote_durable(t.opt)
    t.opt.close()
    new = lowdiff.inspect(tmp_path / "new").manifest.run_id
    assert json.loads(fs.cat(f"{prefix}/claim.json"))["run_id"] == new
    assert lowdiff.recover(url).step == 2


def test_a_file_prefix_is_claimed_too(tmp_path: Path) -> None:
    """A ``file://`` prefix is claimed as a bucket's (a hard link, which fails where the claim exists): the first
    run's mirror claims it, a second run's wrap() is refused, the claim never goes into a run directory."""
    pytest.importorskip("fsspec")
    url = f"file://{tmp_path / 'store'}"
    t = train_run(replace(BASE, persistence="thread", remote_url=url), tmp_path / "a", 3, close=False)
    t.opt.flush()
    wait_remote_durable(t.opt)
    t.opt.close()
    a_id = lowdiff.inspect(tmp_path / "a").manifest.run_id
    assert json.loads((tmp_path / "store" / "claim.json").read_text())["run_id"] == a_id
    assert not list((tmp_path / "store").glob("*.tmp")) and not (tmp_path / "a" / "claim.json").exists()
    (tmp_path / "store" / "manifest.json").unlink()  # as if its manifest had not gone up yet
    with pytest.raises(lowdiff.RemoteStoreError, match=f"run id {a_id}"):
        start(replace(BASE, persistence="thread", remote_url=url), tmp_path / "b")
    t = start(replace(BASE, persistence="thread", remote_url=url), tmp_path / "a")  # the same run: a restart
    t.train(4, 5)
    t.opt.close()
    assert lowdiff.recover(url).step == 5
    t = start(replace(BASE, persistence="thread", remote_url=url), tmp_path / "c")  # a new machine: pulled
    assert t.opt.stats.durable_step == 5
    t.opt.close()
    assert not (tmp_path / "c" / "claim.json").exists()


def test_close_names_the_steps_not_in_the_bucket(tmp_path: Path, s3_env, caplog: pytest.LogCaptureFixture) -> None:
    """The store goes away for good: training goes on, and close() (after remote.close_timeout_s) names the steps
    that are only on the local disk."""
    import logging
    import os

    from s3server import start_server, stop_server

    server = start_server()
    before = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    try:
        url = f"s3://{server.new_bucket()}/gone"
        t = start(replace(BASE, persistence="thread", remote_url=url, remote_close_timeout_s=2.0), tmp_path / "run")
        t.train(1, 5)
        t.opt.flush()
        wait_remote_durable(t.opt)
        stop_server(server)
        caplog.set_level(logging.WARNING, logger="lowdiff")
        t.train(6, 10)
        t0 = time.monotonic()
        t.opt.close()
        assert time.monotonic() - t0 < 30
        said = [r.getMessage() for r in caplog.records if "not remote-durable" in r.getMessage()]
        assert said and "to 10 are not remote-durable" in said[0], [r.getMessage() for r in caplog.records]
        assert lowdiff.recover(tmp_path / "run").step == 10  # on the local disk, whole
    finally:
        if before is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = before
        if server.proc.poll() is None:
            stop_server(server)
