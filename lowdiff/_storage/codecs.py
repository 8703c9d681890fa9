"""Lossless codecs for payload bytes, applied outside h5py (lz4 and zstd release the GIL).

``shuffle-lz4`` / ``shuffle-zstd`` first transpose the bytes of each element (all first bytes, then all
second bytes, ...), as Blosc and HDF5's shuffle filter do: float gradients have near-random low mantissa
bytes but very regular sign/exponent bytes, which plain lz4/zstd cannot exploit when they are interleaved.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lowdiff.errors import CorruptFileError

CODECS = ("none", "lz4", "zstd", "shuffle-lz4", "shuffle-zstd")


def shuffle(raw: bytes | bytearray | memoryview, itemsize: int) -> bytes | bytearray | memoryview:
    arr = np.frombuffer(raw, dtype=np.uint8)
    if itemsize <= 1 or arr.size % itemsize:
        return raw
    return arr.reshape(-1, itemsize).T.tobytes()


def unshuffle(data: bytes | memoryview, itemsize: int) -> bytes | memoryview:
    arr = np.frombuffer(data, dtype=np.uint8)
    if itemsize <= 1 or arr.size % itemsize:
        return data
    return arr.reshape(itemsize, -1).T.tobytes()
def _lz4() -> ModuleType:
    """lz4.frame, imported on first use: a run with codec none must not need the package."""
    try:
        import lz4.frame
    except ImportError as e:
        raise ImportError(f"codec lz4 needs the 'lz4' package ({e}); install it or use log.codec none") from e
    return lz4.frame


def _zstd() -> ModuleType:
    try:
        import zstandard
    except ImportError as e:
        raise ImportError(f"codec zstd needs the 'zstandard' package ({e}); install it or use log.codec none") from e
    return zstandard


_ZSTD_LEVEL = 1  # fast: the log is written every step; level 1 already removes most redundancy


def encode(codec: str, raw: bytes | bytearray | memoryview, itemsize: int = 1) -> bytes | memoryview:
    if codec.startswith("shuffle-"):
        return encode(codec.removeprefix("shuffle-"), shuffle(raw, itemsize))
    if codec == "none":
        return raw if isinstance(raw, (bytes, memoryview)) else memoryview(raw)
    if codec == "lz4":
        return _lz4().compress(raw, compression_level=0, store_size=True)
    if codec == "zstd":
        return _zstd().ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)
    raise ValueError(f"unknown codec {codec!r}; allowed: {', '.join(CODECS)}")


def decode(codec: str, data: bytes | memoryview, raw_nbytes: int, where: str, itemsize: int = 1
           ) -> bytes | memoryview:
    """Decompress and check the size; never allocates more than ``raw_nbytes`` for the output."""
    if codec in ("shuffle-lz4", "shuffle-zstd"):
        return unshuffle(decode(codec.removeprefix("shuffle-"), data, raw_nbytes, where), itemsize)
    # Imported before the try: a missing package is an ImportError naming it, not a "damaged file".
    lz4 = _lz4() if codec == "lz4" else None
    zstd = _zstd() if codec == "zstd" else None
    try:
        if codec == "none":
            out: bytes | memoryview = data
        elif lz4 is not None:
            info = lz4.get_frame_info(data)
            if info.get("content_size") != raw_nbytes:
                raise CorruptFileError(f"{where}: lz4 frame declares {info.get('content_size')} bytes, "
                                       f"expected {raw_nbytes}")
            out = lz4.decompress(data)
        elif zstd is not None:
            params = zstd.get_frame_parameters(data)
            if params.content_size != raw_nbytes:
                raise CorruptFileError(f"{where}: zstd frame declares {params.content_size} bytes, "
                                       f"expected {raw_nbytes}")
            out = zstd.ZstdDecompressor().decompress(data, max_output_size=raw_nbytes)
        else:
            raise CorruptFileError(f"{where}: unknown codec {codec!r}")
    except CorruptFileError:
        raise
    except Exception as e:  # lz4/zstd raise their own error types on damaged frames
        raise CorruptFileError(f"{where}: cannot decompress {codec} data: {e}") from e
    if len(out) != raw_nbytes:
        raise CorruptFileError(f"{where}: decompressed to {len(out)} bytes, expected {raw_nbytes}")
    return out
