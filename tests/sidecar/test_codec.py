"""Block codecs: exact round trips, zero-copy raw decode, and the sampling decision."""

from __future__ import annotations

import numpy as np
import pytest
from dscache_sidecar.codec import Codec, CodecPolicy, decode, encode


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8", "int8"])
@pytest.mark.parametrize("codec", [Codec.RAW, Codec.ZSTD_SHUFFLE])
def test_round_trip_is_exact(dtype: str, codec: Codec) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 5, 7)) * 50).astype(dtype)
    out = decode(bytes(encode(arr, codec)), codec, dtype, arr.shape)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()


def test_bfloat16_travels_as_uint16() -> None:
    arr = np.arange(64, dtype=np.uint16).reshape(8, 8)
    out = decode(bytes(encode(arr, Codec.ZSTD_SHUFFLE)), Codec.ZSTD_SHUFFLE, "bfloat16", (8, 8))
    assert out.tobytes() == arr.tobytes()


def test_raw_decode_is_a_view_without_copy() -> None:
    buf = bytearray(np.arange(16, dtype=np.float32).tobytes())
    arr = decode(memoryview(buf), Codec.RAW, "float32", (4, 4))
    buf[0:4] = np.float32(42).tobytes()
    assert arr[0, 0] == 42  # shares memory with the buffer


def test_auto_policy_compresses_only_what_pays() -> None:
    policy = CodecPolicy(mode="auto", min_block_bytes=1024)
    noise = np.random.default_rng(1).integers(0, 256, size=1 << 18, dtype=np.uint8)
    assert policy.choose(noise) is Codec.RAW
    smooth = np.repeat(np.linspace(-1, 1, 1 << 12, dtype=np.float16), 32)
    assert policy.choose(smooth) is Codec.ZSTD_SHUFFLE
    assert len(policy.encode(smooth, Codec.ZSTD_SHUFFLE)) < smooth.nbytes / 2
    assert CodecPolicy(mode="raw").choose(smooth) is Codec.RAW
    assert CodecPolicy(mode="auto").choose(smooth[:100]) is Codec.RAW  # too small to bother


def test_shuffle_beats_plain_zstd_on_float_kv() -> None:
    import zstandard

    kv = np.random.default_rng(2).standard_normal(1 << 16).astype(np.float32)
    plain = len(zstandard.ZstdCompressor(level=1).compress(kv.tobytes()))
    shuffled = len(encode(kv, Codec.ZSTD_SHUFFLE))
    assert shuffled < plain
