"""Which names the mirror carries, what a recovery fetches, and the step a set of uploaded names reaches
(lowdiff._storage.remote): by names alone, as the remote tier judges them."""

from __future__ import annotations

from lowdiff._storage.remote import is_mirrored, is_url, needed, reach


def snap(s: int, shard: str = "") -> str:
    return f"snapshots/step-{s:010d}{shard}.h5"


def seg(a: int, b: int, shard: str = "") -> str:
    return f"log/steps-{a:010d}-{b:010d}{shard}.h5"


def test_only_the_runs_committed_files_are_mirrored() -> None:
    assert is_mirrored("manifest.json") and is_mirrored(snap(7)) and is_mirrored(seg(1, 3))
    assert is_mirrored("stops/step-0000000012.h5")
    for other in ("writer.lock", "persist-00000.lock", "tuner.json", "mirror.json", snap(7) + ".tmp",
                  "quarantine/" + snap(7)[10:], "log/../manifest.json", "snapshots/x/" + snap(7)[10:],
                  "log/" + snap(7)[10:], "notes.txt"):
        assert not is_mirrored(other), other
    assert is_url("s3://b/p") and is_url("file:///tmp/x") and not is_url("/tmp/x") and not is_url("runs/a")


def test_reach_needs_complete_sets_and_a_contiguous_log() -> None:
    assert reach([seg(1, 3)]) == -1
    assert reach([snap(0), seg(1, 3), seg(4, 6), seg(8, 9)]) == 6
    assert reach([snap(0), seg(1, 3), snap(7), seg(6, 9)]) == 9  # a segment across the snapshot
    two = ".shard-{:05d}-of-00002"
    names = [snap(0, two.format(0)), snap(0, two.format(1)), seg(1, 3, two.format(0)), seg(1, 3, two.format(1)),
             seg(4, 6, two.format(0))]
    assert reach(names) == 3  # rank 1's shard of steps 4-6 is not up yet
    assert reach(names + [seg(4, 6, two.format(1))]) == 6


def test_needed_is_the_newest_snapshot_at_or_before_the_step_and_what_follows() -> None:
    names = [snap(0), snap(7), snap(14), seg(1, 3), seg(4, 7), seg(8, 10), seg(11, 14), seg(15, 16),
             "stops/step-0000000016.h5", "stops/step-0000000005.h5"]
    assert needed(names, None) == {snap(14), seg(15, 16), "stops/step-0000000016.h5"}
    assert needed(names, 9) == {snap(7), seg(8, 10), seg(11, 14), seg(15, 16), "stops/step-0000000016.h5"}
    assert needed([seg(1, 3)], None) == {seg(1, 3)}  # no snapshot: everything, and the readers say what is wrong
    two = ".shard-{:05d}-of-00002"
    sharded = [snap(0, two.format(0)), snap(0, two.format(1)), snap(7, two.format(0)), seg(1, 3, two.format(0)),
               seg(1, 3, two.format(1)), seg(4, 9, two.format(0)), seg(4, 9, two.format(1))]
    # Rank 1's shard of snapshot 7 is not in the bucket: the snapshot a recovery can start from is 0's.
    assert needed(sharded, None) == {n for n in sharded if not n.startswith(snap(7)[:-3])}


def test_a_restarted_mirror_starts_where_its_record_reaches() -> None:
    from lowdiff._persist.mirror import uploaded_reach

    record = {"manifest.json": (10, 1), snap(0): (50, 1), seg(1, 3): (9, 1), seg(4, 5): (9, 1)}
    here = {"manifest.json": (11, 2), snap(0): (50, 1), seg(1, 3): (9, 1), seg(4, 5): (9, 1), seg(6, 8): (9, 1)}
    assert uploaded_reach(record, here) == 5  # the manifest changed since (a resume): its older copy is up
    assert uploaded_reach(record, {**here, seg(4, 5): (9, 2)}) == 3  # rewritten since: not known to be up
    assert uploaded_reach({n: v for n, v in record.items() if n != "manifest.json"}, here) == -1  # no manifest up
    assert uploaded_reach({n: v for n, v in record.items() if n != snap(0)}, here) == -1  # no snapshot up
    # Retention deleted snapshot 0 here after snapshot 7 went up: the bucket keeps what the record says.
    assert uploaded_reach({**record, snap(7): (50, 1)}, {n: v for n, v in here.items() if n != snap(0)}) == 7


def test_a_missing_shard_is_said_as_a_loss_only_where_a_whole_set_follows(caplog) -> None:
    """A set lacking a shard before a whole later set is a hole in the bucket (WARNING); one past every whole set is
    the run's newest, which a live run's other rank may not have committed yet (INFO, and said so)."""
    import logging

    from lowdiff._storage.remote_names import missing_shards

    two = ".shard-{:05d}-of-00002"
    both = [snap(0, two.format(0)), snap(0, two.format(1)), seg(1, 10, two.format(0)), seg(1, 10, two.format(1))]
    log = logging.getLogger("test-missing-shards")
    with caplog.at_level(logging.INFO, logger="test-missing-shards"):
        said = missing_shards([*both, seg(11, 20, two.format(0))], "s3://b/p", 0, None, log)
    assert len(said) == 1 and said[0].startswith("s3://b/p/" + seg(11, 20, two.format(1)) + ": missing")
    assert "the run's newest steps" in said[0] and [r.levelno for r in caplog.records] == [logging.INFO]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="test-missing-shards"):
        said = missing_shards([*both, seg(11, 20, two.format(0)), seg(21, 30, two.format(0)),
                               seg(21, 30, two.format(1))], "s3://b/p", 0, None, log)
    assert len(said) == 1 and "an upload that never happened" in said[0]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
