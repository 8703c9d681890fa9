"""What ``wrap()`` does with a remote when the local run directory holds the run too (reconcile: the newer wins)
and something under the prefix, or the store itself, misbehaves (tests/remote/conftest.py's real S3 server)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from lowdiff_harness import Scenario, assert_state_equal, start, train_run

import lowdiff

BASE = Scenario(model="mlp_bn", optimizer="adamw", groups=2, scheduler=False, compressor="topk", ratio=0.25,
                batch_steps=3, every_steps=7, seed=3, persistence="thread")


def _step_of(name: str) -> int:
    """The last step a snapshot, segment or stop file holds, by its name."""
    base = name.rsplit("/", 1)[-1].split(".")[0]  # step-0000000014, steps-0000000010-0000000012
    return int(base.rsplit("-", 1)[-1])


@pytest.mark.parametrize("stranger", ["log/steps-0000009000-0000009015.h5", "snapshots/step-0000009000.h5",
                                      "log/steps-0000000010-0000009015.h5"])
def test_a_foreign_object_named_like_the_runs_does_not_make_the_bucket_newer(tmp_path: Path, s3, stranger: str,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The bucket holds steps 0-9 of the run (the uploads after them never happened: deleted here), the local run
    directory the same history up to step 20, and another run's segment lies under the prefix named like a later
    file of this run. wrap() keeps the local run (nothing pulled, nothing quarantined) and the resume continues
    from step 20; an object it read to judge the bucket is named by its URL."""
    import logging

    url = f"s3://{s3.new_bucket()}/run"
    prefix = url[len("s3://"):]
    scenario = replace(BASE, remote_url=url)
    t = train_run(scenario, tmp_path / "run", 20)
    fs = s3.fs()
    for path in fs.find(prefix):
        name = path[len(prefix) + 1:]
        if name not in ("manifest.json", "claim.json") and _step_of(name) > 10:
            fs.rm(path)
    train_run(replace(BASE, seed=11), tmp_path / "other", 3)
    fs.put_file(str(tmp_path / "other" / "log" / "steps-0000000001-0000000003.h5"), f"{prefix}/{stranger}")
    caplog.set_level(logging.WARNING, logger="lowdiff")
    t2 = start(scenario, tmp_path / "run", resume=False)
    assert t2.opt.resume() == 20, [r.getMessage() for r in caplog.records]
    t2.opt.close()
    assert not (tmp_path / "run" / "quarantine").exists()
    assert_state_equal(*t.refs[20], lowdiff.recover(tmp_path / "run"))
    said = [r.getMessage() for r in caplog.records]
    assert any(f"{url}/{stranger}: " in m and "not counted" in m for m in said) == ("00010-" in stranger or
                                                                                   "snapshots" in stranger), said
    assert not [m for m in said if ".pulling-" in m], said


@pytest.mark.parametrize("resumed", [False, True])
def test_a_pull_that_fails_leaves_the_local_run_as_it_was(tmp_path: Path, s3, resumed: bool) -> None:
    """A stale copy of the run (step 10) meets a bucket that reaches step 14, whose newest segment cannot be read
    (archived to another storage class: every GET of it is refused). The bucket's run is the same history further
    on (read to judge it newer), or resumed since the copy (pulled at once). wrap() refuses, naming the object and
    what to do, and leaves the local run directory as it was (nothing quarantined, nothing half pulled in). Once
    the object is readable again, wrap() pulls the bucket's run and the resume continues exactly."""
    url = f"s3://{s3.new_bucket()}/run"
    prefix = url[len("s3://"):]
    scenario = replace(BASE, remote_url=url)
    reference = train_run(replace(BASE), tmp_path / "ref", 20)
    t = start(scenario, tmp_path / "a")
    t.train(1, 10)
    if resumed:
        t.opt.close()
        t = start(scenario, tmp_path / "a")
    else:
        t.opt.flush()
    shutil.copytree(tmp_path / "a", tmp_path / "stale", ignore=shutil.ignore_patterns("*.lock"))
    t.train(11, 14)
    t.opt.close()
    fs = s3.fs()
    newest = max((p for p in fs.find(f"{prefix}/log")), key=_step_of)
    whole = fs.cat(newest)
    fs.pipe(newest, whole, StorageClass="GLACIER")

    def files() -> list[str]:
        return sorted(str(p.relative_to(tmp_path / "stale")) for p in (tmp_path / "stale").rglob("*")
                      if p.suffix != ".lock")

    before = files()
    with pytest.raises(lowdiff.RemoteStoreError) as e:
        start(scenario, tmp_path / "stale", resume=False)
    said = str(e.value)
    assert f"fetching {url}/{newest[len(prefix) + 1:]} failed" in said, said
    assert f"{tmp_path / 'stale'} was left as it was" in said and "remote.url to null" in said, said
    assert files() == before
    assert lowdiff.recover(tmp_path / "stale").step == 10

    fs.pipe(newest, whole)  # readable again
    t2 = start(scenario, tmp_path / "stale", resume=False)
    assert t2.opt.resume() == 14
    t2.train(15, 20)
    t2.opt.close()
    assert_state_equal(*reference.refs[20], lowdiff.recover(tmp_path / "stale"))
    assert_state_equal(*reference.refs[20], lowdiff.recover(url))


def test_files_without_a_manifest_go_aside_when_the_bucket_run_is_pulled(tmp_path: Path, s3) -> None:
    """A pull cut short while it moved the older local run aside (the manifest goes first) leaves that run's other
    files without a manifest. Before, the next wrap() pulled the bucket's run in among them: same names replaced,
    the others kept, and uploaded by the mirror (found in a review). Now they go to quarantine/ first, never
    deleted, and the run trains on exactly."""
    url = f"s3://{s3.new_bucket()}/run"
    prefix = url[len("s3://"):]
    scenario = replace(BASE, remote_url=url)
    reference = train_run(replace(BASE), tmp_path / "ref", 12)
    train_run(scenario, tmp_path / "a", 9)
    train_run(replace(BASE, seed=11, every_steps=5), tmp_path / "other", 6)
    # Named like none of the bucket's files (its snapshots are 0 and 7), at a step before the resume's (which moves
    # the files of later steps aside by itself).
    stray = next(p for p in (tmp_path / "other").glob("snapshots/*.h5") if "0005" in p.name)
    stray_name = stray.relative_to(tmp_path / "other").as_posix()
    (tmp_path / "b" / "snapshots").mkdir(parents=True)
    shutil.copy(stray, tmp_path / "b" / stray_name)

    t = start(scenario, tmp_path / "b", resume=False)
    assert t.opt.resume() == 9
    assert not (tmp_path / "b" / stray_name).exists()
    assert [p.name for p in (tmp_path / "b" / "quarantine").glob("no-run-*/snapshots/*")] == [stray.name]
    t.train(10, 12)
    t.opt.close()  # waits for the uploads
    assert not s3.fs().exists(f"{prefix}/{stray_name}")
    assert_state_equal(*reference.refs[12], lowdiff.recover(url))
