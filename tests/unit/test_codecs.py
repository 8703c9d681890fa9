"""Lossless payload codecs: exact round trip, and every damaged frame is a CorruptFileError."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowdiff import CorruptFileError
from lowdiff.storage import codecs

CODECS = list(codecs.CODECS)  # none, lz4, zstd and the byte-shuffling variants


@pytest.mark.parametrize("codec", CODECS)
@given(raw=st.binary(max_size=4096) | st.binary(max_size=64).map(lambda b: b * 97),
       itemsize=st.sampled_from([1, 2, 4, 8]))
def test_round_trip(codec: str, raw: bytes, itemsize: int) -> None:
    enc = codecs.encode(codec, raw, itemsize)
    assert bytes(codecs.decode(codec, bytes(enc), len(raw), "where", itemsize)) == raw


@given(raw=st.binary(max_size=512), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_shuffle_is_a_permutation(raw: bytes, itemsize: int) -> None:
    shuffled = bytes(codecs.shuffle(raw, itemsize))
    assert sorted(shuffled) == sorted(raw)
    assert bytes(codecs.unshuffle(shuffled, itemsize)) == raw


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_bytearray_and_memoryview(codec: str) -> None:
    raw = bytes(range(256)) * 10
    for buf in (bytearray(raw), memoryview(raw)):
        assert bytes(codecs.decode(codec, bytes(codecs.encode(codec, buf)), len(raw), "w")) == raw


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_raw_size_is_corrupt(codec: str) -> None:
    raw = b"lowdiff" * 50
    enc = bytes(codecs.encode(codec, raw))
    for n in (len(raw) - 1, len(raw) + 1, 0):
        with pytest.raises(CorruptFileError, match="the/file.h5"):
            codecs.decode(codec, enc, n, "the/file.h5")


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "none"])
def test_damaged_frames_are_corrupt(codec: str) -> None:
    raw = bytes(range(256)) * 40
    enc = bytearray(codecs.encode(codec, raw))
    with pytest.raises(CorruptFileError, match="seg.h5"):
        codecs.decode(codec, bytes(enc[: len(enc) // 2]), len(raw), "seg.h5")
    with pytest.raises(CorruptFileError, match="seg.h5"):
        codecs.decode(codec, b"\x00" * 32, len(raw), "seg.h5")
    with pytest.raises(CorruptFileError, match="seg.h5"):
        codecs.decode(codec, b"", len(raw), "seg.h5")


def test_unknown_codec() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        codecs.encode("gzip", b"x")
    with pytest.raises(CorruptFileError, match="unknown codec"):
        codecs.decode("gzip", b"x", 1, "f.h5")
