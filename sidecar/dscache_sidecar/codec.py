"""Block codecs: raw, zstd over byte-shuffled elements, or int8 with row scales.

Contract:
    * Raw and zstd are exact: ``decode(encode(a))`` has the same dtype, shape and
      bytes as ``a``.
    * ``INT8_ROWS`` is lossy and only for float blocks (float32, float16,
      bfloat16): each row of the last axis (one token of one head for GQA/MHA
      blocks, one token's latent for MLA) is stored as int8 values
      ``round(x / s)`` with ``s = max|row| / 127`` kept as float16 after the
      values; ``decode`` multiplies back in float32 and returns the block's own
      dtype and shape (bfloat16 rounded to nearest even). Each element's error is
      at most half a step of its row, ``s / 2`` (plus the float16 rounding of
      ``s``). Blocks of a lossy codec must live under their own keys: the model
      server puts ``kv_codec`` in the fingerprint's ``extra``.
    * Raw blocks decode to a view of the given buffer (zero copy); compressed and
      int8 blocks decode to a new array.
    * A zstd payload decodes to the bytes of the block's shape and never more: a
      frame whose header names another content size is refused before any
      allocation (no decompression bomb from a forged frame), and the shape itself
      is bounded where the caller knows a limit (``max_bytes``; the store refuses
      blocks whose decoded size is over its largest block, ``BlockSpec.validate``).
    * One vocabulary names codecs everywhere (the deployment's ``spec.cache.codec``,
      metric labels, benches): ``CODEC_NAMES`` (``raw``, ``zstd``, ``int8``), plus
      ``sample`` for "zstd where a sample of the block shrinks, raw otherwise".
      A store job's decision is one ``Encoding``; the layers below carry it as is.
    * ``CodecPolicy.choose`` compresses a sample of the block and picks zstd only when
      it saves at least ``min_saving`` of the bytes; everything else stays raw.

Byte shuffling puts byte k of every element together, so the slowly varying high
bytes of floats (sign, exponent) form long runs zstd compresses well.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import zstandard

from dscache.keys import KV_DTYPES

#: numpy storage dtype per contract dtype name (the core's table).
NUMPY_DTYPES: dict[str, np.dtype[np.generic]] = {n: d.storage for n, d in KV_DTYPES.items()}
DTYPE_CODES: dict[str, int] = {name: i for i, name in enumerate(sorted(KV_DTYPES))}
DTYPE_NAMES: dict[int, str] = {i: name for name, i in DTYPE_CODES.items()}


class Codec(IntEnum):
    """Same numbers as the ``dscache.v1.Codec`` enum."""

    RAW = 0
    ZSTD_SHUFFLE = 1
    INT8_ROWS = 2


#: The name of each codec in every vocabulary above the wire.
CODEC_NAMES: dict[Codec, str] = {
    Codec.RAW: "raw",
    Codec.ZSTD_SHUFFLE: "zstd",
    Codec.INT8_ROWS: "int8",
}
#: The name of a sampled encoding (each block zstd where it pays, raw otherwise).
SAMPLE = "sample"


@dataclass(frozen=True)
class Encoding:
    """How one store job's blocks are encoded: decided once, carried as is.

    Attributes:
        codec: every block in this codec; None samples each block
            (``CodecPolicy.choose``).
        level: the zstd level; None: the policy's own, adapted to its speed budget.
    """

    codec: Codec | None
    level: int | None = None

    @property
    def name(self) -> str:
        """``raw``, ``zstd``, ``int8`` or ``sample`` (a metric label's value)."""
        return SAMPLE if self.codec is None else CODEC_NAMES[self.codec]

    @classmethod
    def named(cls, name: str, level: int | None = None) -> Encoding:
        """The encoding of a name of ``Encoding.name``'s vocabulary.

        Raises:
            ValueError: an unknown name.
        """
        if name == SAMPLE:
            return cls(None, level)
        for codec, known in CODEC_NAMES.items():
            if known == name:
                return cls(codec, level)
        known = ", ".join([*CODEC_NAMES.values(), SAMPLE])
        raise ValueError(f"unknown codec {name!r}: one of {known}")


#: Every block raw (zero-copy hits).
RAW = Encoding(Codec.RAW)
#: Each block sampled: zstd where it shrinks enough, raw otherwise.
SAMPLED = Encoding(None)


#: Contract dtypes the int8 codec takes (and decodes back to).
INT8_SOURCE_DTYPES = ("float32", "float16", "bfloat16")
#: Bytes of one row scale of the int8 codec (float16).
INT8_SCALE_BYTES = 2


def int8_stored_bytes(shape: tuple[int, ...]) -> int:
    """Stored size of an int8 block of ``shape``: one byte per element, one scale per row."""
    n = int(np.prod(shape)) if shape else 0
    rows = n // shape[-1] if shape and shape[-1] else 0
    return n + INT8_SCALE_BYTES * rows


def as_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """The block's values as float32 (bfloat16 blocks are uint16 bit patterns)."""
    if dtype == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype not in INT8_SOURCE_DTYPES:
        raise ValueError(f"the int8 codec takes {', '.join(INT8_SOURCE_DTYPES)}, not {dtype}")
    return arr.astype(np.float32, copy=False)


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in the contract dtype's storage (bfloat16: round to nearest even)."""
    if dtype == "bfloat16":
        bits = values.view(np.uint32)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        return (rounded >> np.uint32(16)).astype(np.uint16)
    return values.astype(NUMPY_DTYPES[dtype], copy=False)


def encode_int8(arr: np.ndarray, dtype: str) -> bytes:
    """int8 values then float16 row scales (see the module contract)."""
    values = as_float32(np.ascontiguousarray(arr), dtype)
    rows = values.reshape(-1, values.shape[-1]) if values.ndim else values.reshape(1, -1)
    absmax = np.abs(rows).max(axis=1, keepdims=True)
    scales = (absmax / 127.0).astype(np.float16)
    if not np.isfinite(scales).all():
        raise ValueError("the int8 codec needs finite values below float16's range x 127")
    safe = np.where(scales > 0, scales, np.float16(1)).astype(np.float32)
    q = np.clip(np.rint(rows / safe), -127, 127).astype(np.int8)
    return bytes(q.tobytes() + scales.tobytes())


def decode_int8(
    payload: bytes | memoryview | np.ndarray, dtype: str, shape: tuple[int, ...]
) -> np.ndarray:
    """The dequantized block in ``dtype``'s storage type, a new array of ``shape``."""
    if dtype not in INT8_SOURCE_DTYPES:
        raise ValueError(f"the int8 codec decodes to {', '.join(INT8_SOURCE_DTYPES)}, not {dtype}")
    n = int(np.prod(shape))
    width = shape[-1]
    rows = n // width
    raw = np.frombuffer(payload, dtype=np.uint8)
    if raw.size != n + INT8_SCALE_BYTES * rows:
        raise ValueError("int8 payload size does not match the block's shape")
    q = raw[:n].view(np.int8).reshape(rows, width)
    scales = raw[n:].view(np.float16).astype(np.float32).reshape(rows, 1)
    values = q.astype(np.float32)
    values *= scales
    return from_float32(values, dtype).reshape(shape)


def dtype_name(arr: np.ndarray) -> str:
    """The contract dtype name of a numpy array (bfloat16 must be passed as uint16 + name)."""
    for name, dt in NUMPY_DTYPES.items():
        if arr.dtype == dt and name not in ("bfloat16", "float8_e4m3fn"):
            return name
    raise ValueError(f"unsupported dtype {arr.dtype}; expected one of {sorted(NUMPY_DTYPES)}")


def shuffle(buf: np.ndarray, itemsize: int) -> bytes:
    """Byte planes of ``buf`` (viewed as bytes): plane k holds byte k of each element.

    One strided copy per plane: numpy's transpose of an ``(n, itemsize)`` byte
    matrix runs 5-15x slower than these ``itemsize`` copies.
    """
    raw = (
        np.frombuffer(buf, dtype=np.uint8)
        if not isinstance(buf, np.ndarray)
        else np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    )
    if itemsize == 1:
        return raw.tobytes()
    cols = raw.reshape(-1, itemsize)
    planes = np.empty((itemsize, cols.shape[0]), dtype=np.uint8)
    for k in range(itemsize):
        planes[k] = cols[:, k]
    return planes.tobytes()


def unshuffle(planes: bytes, itemsize: int) -> np.ndarray:
    """Inverse of ``shuffle``: a new uint8 array in element order."""
    arr = np.frombuffer(planes, dtype=np.uint8)
    if itemsize == 1:
        return arr.copy()
    rows = arr.reshape(itemsize, -1)
    out = np.empty((rows.shape[1], itemsize), dtype=np.uint8)
    for k in range(itemsize):
        out[:, k] = rows[k]
    return out.reshape(-1)


def encode(
    arr: np.ndarray, codec: Codec, level: int = 1, dtype: str | None = None
) -> bytes | memoryview:
    """Stored bytes of ``arr`` under ``codec`` (raw returns a view, no copy).

    ``dtype`` is the contract name, needed by the int8 codec for bfloat16 blocks
    (uint16 arrays); None takes it from the array.
    """
    arr = np.ascontiguousarray(arr)
    if codec is Codec.RAW:
        flat: Any = arr.reshape(-1).view(np.uint8)
        return memoryview(flat)
    if codec is Codec.INT8_ROWS:
        return encode_int8(arr, dtype or dtype_name(arr))
    planes = shuffle(arr, arr.dtype.itemsize)
    return zstandard.ZstdCompressor(level=level).compress(planes)


def decode(
    payload: bytes | memoryview | np.ndarray,
    codec: Codec,
    dtype: str,
    shape: tuple[int, ...],
    max_bytes: int | None = None,
) -> np.ndarray:
    """The block's array. Raw payloads become a read-only view without copying.

    A compressed payload decodes to exactly the bytes ``shape`` holds, never more:
    a zstd frame whose header names another size is refused before anything is
    allocated, and ``max_bytes`` (the largest block the caller accepts; None: no
    limit beyond the shape) bounds the shape itself.

    Raises:
        ValueError: the payload does not decode to a block of ``shape``.
    """
    np_dtype = NUMPY_DTYPES[dtype]
    n = int(np.prod(shape)) if shape else 0
    if codec is Codec.RAW:
        arr = np.frombuffer(payload, dtype=np_dtype, count=n)
        return arr.reshape(shape)
    if codec is Codec.ZSTD_SHUFFLE:
        want = n * np_dtype.itemsize
        if max_bytes is not None and want > max_bytes:
            raise ValueError(f"a block of shape {shape} is over the {max_bytes}-byte limit")
        data = bytes(payload)
        # A frame that names its content size is decompressed to that size whatever
        # max_output_size says (python-zstandard): check it first, so a forged frame
        # header cannot make the decoder allocate more than the block's shape.
        try:
            framed = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise ValueError(f"not a zstd frame: {exc}") from exc
        if framed not in (-1, want):
            raise ValueError(
                f"the zstd frame holds {framed} bytes, the block's shape {want}: refused"
            )
        try:
            planes = zstandard.ZstdDecompressor().decompress(data, max_output_size=want)
        except zstandard.ZstdError as exc:
            raise ValueError(f"the zstd frame does not decode within {want} bytes") from exc
        if len(planes) != want:
            raise ValueError("decompressed size does not match the block's shape")
        return unshuffle(planes, np_dtype.itemsize).view(np_dtype).reshape(shape)
    if codec is Codec.INT8_ROWS:
        return decode_int8(payload, dtype, shape)
    raise ValueError(f"unknown codec {codec!r}")


@dataclass
class CodecPolicy:
    """Decides per block whether zstd pays (an ``Encoding`` without a codec).

    Attributes:
        min_saving: the share of bytes a sample must save for zstd to be chosen.
        sample_bytes: bytes compressed to decide.
        min_block_bytes: blocks smaller than this stay raw (not worth the CPU).
        budget_bytes_per_s: the compression speed to keep; the level moves down
            (faster) when measured throughput falls below it and up when well above.
    """

    min_saving: float = 0.20
    sample_bytes: int = 256 * 1024
    min_block_bytes: int = 64 * 1024
    budget_bytes_per_s: float = 300e6
    level: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def choose(self, arr: np.ndarray) -> Codec:
        """The codec for this block."""
        if arr.nbytes < self.min_block_bytes:
            return Codec.RAW
        flat = np.ascontiguousarray(arr).reshape(-1)
        n = max(1, self.sample_bytes // arr.dtype.itemsize)
        sample = flat[:n]
        planes = shuffle(sample, arr.dtype.itemsize)
        compressed = zstandard.ZstdCompressor(level=self.level).compress(planes)
        saving = 1.0 - len(compressed) / max(1, len(planes))
        return Codec.ZSTD_SHUFFLE if saving >= self.min_saving else Codec.RAW

    def encode(
        self,
        arr: np.ndarray,
        codec: Codec,
        *,
        dtype: str | None = None,
        level: int | None = None,
    ) -> bytes | memoryview:
        """Encodes ``arr`` (contract ``dtype``; None: the array's own).

        zstd runs at ``level`` when given, else at the policy's level, which moves
        with the measured speed against the budget.
        """
        if codec is not Codec.ZSTD_SHUFFLE:
            return encode(arr, codec, dtype=dtype)
        if level is not None:
            return encode(arr, codec, level=level)
        start = time.perf_counter()
        out = encode(arr, codec, level=self.level)
        elapsed = max(time.perf_counter() - start, 1e-9)
        speed = arr.nbytes / elapsed
        with self._lock:
            if speed < self.budget_bytes_per_s and self.level > -5:
                self.level -= 1
            elif speed > 3 * self.budget_bytes_per_s and self.level < 3:
                self.level += 1
        return out
