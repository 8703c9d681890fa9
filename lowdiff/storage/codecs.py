"""Lossless codecs for payload bytes, applied outside h5py (lz4 and zstd release the GIL)."""

from __future__ import annotations

import lz4.frame
import zstandard

from lowdiff.errors import CorruptFileError

CODECS = ("none", "lz4", "zstd")
_ZSTD_LEVEL = 1  # fast: the log is written every step; level 1 already removes most redundancy


def encode(codec: str, raw: bytes | bytearray | memoryview) -> bytes | memoryview:
    if codec == "none":
        return raw if isinstance(raw, (bytes, memoryview)) else memoryview(raw)
    if codec == "lz4":
        return lz4.frame.compress(raw, compression_level=0, store_size=True)
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)
    raise ValueError(f"unknown codec {codec!r}; allowed: {', '.join(CODECS)}")


def decode(codec: str, data: bytes | memoryview, raw_nbytes: int, where: str) -> bytes | memoryview:
    """Decompress and check the size; never allocates more than ``raw_nbytes`` for the output."""
    try:
        if codec == "none":
            out: bytes | memoryview = data
        elif codec == "lz4":
            info = lz4.frame.get_frame_info(data)
            if info.get("content_size") != raw_nbytes:
                raise CorruptFileError(f"{where}: lz4 frame declares {info.get('content_size')} bytes, "
                                       f"expected {raw_nbytes}")
            out = lz4.frame.decompress(data)
        elif codec == "zstd":
            params = zstandard.get_frame_parameters(data)
            if params.content_size != raw_nbytes:
                raise CorruptFileError(f"{where}: zstd frame declares {params.content_size} bytes, "
                                       f"expected {raw_nbytes}")
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_nbytes)
        else:
            raise CorruptFileError(f"{where}: unknown codec {codec!r}")
    except CorruptFileError:
        raise
    except Exception as e:  # lz4/zstd raise their own error types on damaged frames
        raise CorruptFileError(f"{where}: cannot decompress {codec} data: {e}") from e
    if len(out) != raw_nbytes:
        raise CorruptFileError(f"{where}: decompressed to {len(out)} bytes, expected {raw_nbytes}")
    return out
