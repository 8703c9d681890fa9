"""Lossless payload codecs: exact round trip, and every damaged frame is a CorruptFileError."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowdiff import CorruptFileError
from lowdiff._storage import codecs

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


def test_codec_packages_are_imported_only_when_used() -> None:
    """lowdiff imports and writes with codec none where lz4 / zstandard are not installed (a GPU box without them)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lz4', 'zstandard'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lowdiff\n"
        "from lowdiff._storage import codecs\n"
        "assert bytes(codecs.decode('none', codecs.encode('none', b'abc'), 3, 'w')) == b'abc'\n"
        "for c in ('lz4', 'zstd', 'shuffle-lz4'):\n"
        "    try:\n"
        "        codecs.encode(c, b'abcd', 2)\n"
        "    except ImportError as e:\n"
        "        assert 'install it or use log.codec none' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(c)\n"
        "try:\n"
        "    codecs.decode('lz4', b'x', 1, 'f.h5')\n"
        "except ImportError:\n"
        "    pass\n"
        "assert 'lz4' not in sys.modules and 'zstandard' not in sys.modules\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
