"""The run's history (format 2.4, lowdiff._storage.history): which steps the files of each branch may hold, and the
manifest's record of it read as untrusted input."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowdiff._storage import history
from lowdiff._storage.manifest import Manifest, TensorSpec, read_manifest, write_manifest
from lowdiff._storage.validate import check_belongs
from lowdiff.errors import CorruptFileError, ForeignFileError

A, B, C = "a" * 32, "b" * 32, "c" * 32


def test_each_branch_holds_the_steps_from_its_start_to_the_next_start() -> None:
    h = [(A, 10), (B, 10), (C, 25)]
    assert history.span(h, None) == (0, 10)
    assert history.span(h, A) == (10, 10)  # resumed again at once: only the state it started from
    assert history.span(h, B) == (10, 25)
    assert history.span(h, C) == (25, None)
    assert history.span(h, "d" * 32) is None
    assert history.span([], None) == (0, None)
    assert history.current(h) == C and history.current([]) is None
    assert [history.at_step(h, s) for s in (0, 9, 10, 24, 25, 99)] == [None, None, B, B, C, C]


def test_a_resume_discards_the_branches_that_started_after_its_step() -> None:
    h = [(A, 10), (B, 20)]
    assert history.resumed(h, C, 15) == [(A, 10), (C, 15)]
    assert history.resumed(h, C, 20) == [(A, 10), (B, 20), (C, 20)]
    assert history.resumed([], C, 0) == [(C, 0)]


def test_a_branch_that_wrote_snapshot_0_again_owns_step_0() -> None:
    h = history.own_step_zero([(A, 0)], A)
    assert h == [(A, -1)]
    assert history.span(h, None) == (0, -1)  # holds no state: its snapshot 0 was replaced
    assert history.span(h, A) == (-1, None)
    assert history.own_step_zero([(A, 0)], B) is None and history.own_step_zero([(A, 4)], A) is None
    assert history.resumed(h, B, 0) == [(A, -1), (B, 0)]


@pytest.mark.parametrize("bad", [
    {"x": 1}, [[A]], [[A, -2]], [[A, True]], [[A, 1.5]], [["A" * 32, 1]], [["ab", 1]], [[A, 5], [B, 4]],
    [[A, 1], [A, 2]], [[1, A]],
])
def test_a_malformed_history_is_refused(bad: object) -> None:
    with pytest.raises(CorruptFileError, match="history"):
        history.check(bad, "manifest.json")


def _manifest(h: history.History) -> Manifest:
    return Manifest(params=[TensorSpec("w", (2,), "float32", True)], buffers=[], state_dict_keys=[("w", "w")],
                    optimizer_class="torch.optim.sgd.SGD", optimizer_defaults={"lr": 0.1}, param_groups=[["w"]],
                    run_id="0" * 32, history=h)


def test_the_manifest_keeps_its_history_and_checks_it_when_read(tmp_path: Path) -> None:
    write_manifest(tmp_path, _manifest([(A, 3), (B, 7)]))
    assert read_manifest(tmp_path).history == [(A, 3), (B, 7)]
    write_manifest(tmp_path, _manifest([]))
    assert "history" not in (tmp_path / "manifest.json").read_text()  # a run never resumed: as before 2.4
    write_manifest(tmp_path, _manifest([(B, 7), (A, 3)]))  # checksummed, but going back in steps
    with pytest.raises(CorruptFileError, match="history"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(("branch", "states", "ok"), [
    (None, (0, 0), True), (None, (0, 10), True), (None, (9, 11), False),  # segment 10-11: past the first's end
    (A, (10, 10), True), (A, (10, 11), True), (A, (9, 9), False),  # a branch holds nothing before its start
    ("d" * 32, (12, 12), False),  # a branch the history does not know: discarded by a resume
])
def test_a_file_belongs_only_inside_its_branch(branch: str | None, states: tuple[int, int], ok: bool) -> None:
    meta = {"run_id": "0" * 32} | ({"branch": branch} if branch else {})
    h = [(A, 10)]
    if ok:
        check_belongs(meta, "0" * 32, Path("f.h5"), h, states)
    else:
        with pytest.raises(ForeignFileError):
            check_belongs(meta, "0" * 32, Path("f.h5"), h, states)
    with pytest.raises(CorruptFileError, match="branch"):
        check_belongs(meta | {"branch": "nothex"}, "0" * 32, Path("f.h5"), h, states)


def test_a_resume_rewrites_the_history_alone(tmp_path: Path) -> None:
    """A manifest a newer lowdiff wrote keeps what this one does not know, and its format_minor."""
    import json
    import zlib

    from lowdiff._storage.manifest import write_history

    def _crc(body: dict) -> int:  # FORMAT.md section 2
        return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())

    write_manifest(tmp_path, _manifest([]))
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc.pop("crc32")
    doc |= {"format_minor": 9, "from_the_future": {"x": [1, 2]}}
    (tmp_path / "manifest.json").write_text(json.dumps(doc | {"crc32": _crc(doc)}))
    write_history(tmp_path, [(A, 5)])
    after = json.loads((tmp_path / "manifest.json").read_text())
    assert after.pop("history") == [[A, 5]]
    after.pop("crc32")
    assert after == doc
    assert read_manifest(tmp_path).history == [(A, 5)]
