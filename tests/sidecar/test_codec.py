"""Block codecs: exact round trips, zero-copy raw decode, and the sampling decision."""

from __future__ import annotations

import numpy as np
import pytest
from dscache_sidecar.codec import Codec, CodecPolicy, Encoding, decode, encode, int8_stored_bytes


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
    policy = CodecPolicy(min_block_bytes=1024)
    noise = np.random.default_rng(1).integers(0, 256, size=1 << 18, dtype=np.uint8)
    assert policy.choose(noise) is Codec.RAW
    smooth = np.repeat(np.linspace(-1, 1, 1 << 12, dtype=np.float16), 32)
    assert policy.choose(smooth) is Codec.ZSTD_SHUFFLE
    assert len(policy.encode(smooth, Codec.ZSTD_SHUFFLE)) < smooth.nbytes / 2
    assert CodecPolicy().choose(smooth[:100]) is Codec.RAW  # too small to bother


def test_shuffle_beats_plain_zstd_on_float_kv() -> None:
    import zstandard

    kv = np.random.default_rng(2).standard_normal(1 << 16).astype(np.float32)
    plain = len(zstandard.ZstdCompressor(level=1).compress(kv.tobytes()))
    shuffled = len(encode(kv, Codec.ZSTD_SHUFFLE))
    assert shuffled < plain


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as torch does."""
    import torch

    return torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_int8_rows_are_a_quarter_of_the_bytes_within_half_a_step(dtype: str) -> None:
    rng = np.random.default_rng(3)
    # GQA-shaped: (layers, k/v, heads, tokens, head_dim); rows of very different scale,
    # an all-zero row, and outliers.
    values = rng.standard_normal((2, 2, 2, 16, 64)).astype(np.float32)
    values *= rng.uniform(0.01, 30.0, size=(2, 2, 2, 16, 1)).astype(np.float32)
    values[0, 0, 0, 3] = 0.0
    values[1, 1, 1, 7, 5] = 400.0
    arr = _bf16_bits(values) if dtype == "bfloat16" else values.astype(dtype)
    exact = (arr.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else arr
    payload = encode(arr, Codec.INT8_ROWS, dtype=dtype)
    assert len(payload) == int8_stored_bytes(arr.shape) == arr.size + 2 * arr.size // 64
    out = decode(payload, Codec.INT8_ROWS, dtype, arr.shape)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    got = (out.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else out
    step = np.abs(exact.astype(np.float32)).max(axis=-1, keepdims=True) / 127
    # Half a step of the row, plus the rounding of the scale and of the output dtype.
    tolerance = step * 0.51 + np.abs(exact.astype(np.float32)) * (
        2**-7 if dtype != "float32" else 0
    )
    assert (np.abs(got.astype(np.float32) - exact.astype(np.float32)) <= tolerance + 1e-6).all()
    assert (got[0, 0, 0, 3] == 0).all()  # a zero row stays zero
    fp32_bytes = arr.size * 4
    assert len(payload) / fp32_bytes < 0.27


def test_int8_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(ValueError, match="int8 codec"):
        encode(np.zeros((4, 8), dtype=np.uint8), Codec.INT8_ROWS, dtype="uint8")
    with pytest.raises(ValueError, match="size"):
        decode(b"\x00" * 10, Codec.INT8_ROWS, "float32", (4, 8))


def test_an_encoding_has_one_name_each_way() -> None:
    """The names the deployment, the metrics and the benches use map to one decision."""
    for name in ("raw", "zstd", "int8", "sample"):
        assert Encoding.named(name).name == name
    assert Encoding.named("zstd", level=3) == Encoding(Codec.ZSTD_SHUFFLE, 3)
    assert Encoding.named("sample").codec is None  # each block sampled
    with pytest.raises(ValueError, match="unknown codec 'lz4': one of raw, zstd, int8, sample"):
        Encoding.named("lz4")
