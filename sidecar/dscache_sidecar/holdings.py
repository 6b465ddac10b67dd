"""What a sidecar holds, as a Bloom filter a router can fetch: the holdings format.

The sidecar publishes a filter of every block key in its index at
``GET /dscache/holdings`` on its HTTP port (rebuilt in the background every few
seconds); the router's picker fetches each pod's filter and asks, for a request's
block keys, how long a prefix of them the pod holds.

Contract:
    * The filter is `rbloom <https://pypi.org/project/rbloom/>`_'s, with one
      hash function every process shares: a block key is already a SHA-256
      digest, so its first 16 bytes (little-endian, signed) are the hash. Never
      Python's ``hash()``, which is seeded per process.
    * ``to_bytes`` / ``from_bytes`` round-trip exactly. The bytes are a header
      (4-byte magic, u16 format version, u64 length of the rest, little-endian)
      and then rbloom's own ``save_bytes`` format (a u64 count of hash functions,
      then the bit array). A filter from another program or version, or one cut
      short or padded, is refused, not misread: rbloom itself accepts a
      truncated bit array (and answers wrongly from it) and panics on a very
      short one, so ``from_bytes`` checks the lengths before handing it over.
    * A filter answers "maybe held" or "surely not held": a false positive
      costs a router one less-than-ideal choice, never a wrong answer (the pod
      recomputes what it lacks).
    * Who may read one: a filter tells whoever can compute a tenant's block keys
      whether that tenant's prompts are cached, so where an internal token is
      configured the endpoints that serve filters answer only requests carrying it
      as :data:`INTERNAL_TOKEN_HEADER` (:func:`token_matches`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Sequence

from rbloom import Bloom

#: The first bytes of an encoded filter, then a little-endian u16 format version and
#: the u64 length of the rbloom bytes that follow.
MAGIC = b"DSHF"
VERSION = 1
_HEADER = struct.Struct("<4sHQ")
#: What every version shares: enough to tell a filter of another version apart.
_PREFIX = struct.Struct("<4sH")
#: rbloom's bytes: a u64 count of hash functions, then at least one byte of bits.
_HASHES = struct.Struct("<Q")
#: More hash functions than any false-positive rate above 1e-19 asks for: a
#: larger count is a corrupt filter.
_MAX_HASHES = 64

#: Where the sidecar's HTTP server serves the filter.
HOLDINGS_PATH = "/dscache/holdings"
#: Response headers: keys in the filter, and the build's sequence number.
KEYS_HEADER = "X-Dscache-Holdings-Keys"
GENERATION_HEADER = "X-Dscache-Holdings-Generation"
#: The request header that carries the internal token: what a picker shows to read
#: filters of held keys (the sidecar's holdings, a server's template filter) and a
#: server's key info where a token is configured.
INTERNAL_TOKEN_HEADER = "X-Dscache-Internal-Token"  # noqa: S105 - a header name, not a secret
#: Largest encoded filter a reader accepts (a filter of ~50M keys at 1% false positives).
MAX_FILTER_BYTES = 64 << 20


def token_matches(presented: str | None, token: str) -> bool:
    """Whether ``presented`` is ``token`` (digests compared in constant time)."""
    if presented is None or not token:
        return False
    want = hashlib.sha256(token.encode()).digest()
    got = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(want, got)


class HoldingsFormatError(ValueError):
    """Bytes that are not a holdings filter of this format."""


def key_hash(key: bytes) -> int:
    """The filter's hash of a block key: its first 16 bytes as a signed 128-bit int."""
    return int.from_bytes(key[:16], "little", signed=True)


class HoldingsFilter:
    """A Bloom filter of block keys (see the module contract)."""

    def __init__(self, capacity: int, false_positive_rate: float = 0.01) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if not 0.0 < false_positive_rate < 1.0:
            raise ValueError("false_positive_rate must be in (0, 1)")
        self._bloom = Bloom(capacity, false_positive_rate, key_hash)

    @classmethod
    def of(
        cls, keys: Iterable[bytes], capacity: int, false_positive_rate: float = 0.01
    ) -> HoldingsFilter:
        """A filter sized for ``capacity`` keys holding ``keys``."""
        out = cls(capacity, false_positive_rate)
        out.update(keys)
        return out

    def add(self, key: bytes) -> None:
        self._bloom.add(key)

    def update(self, keys: Iterable[bytes]) -> None:
        self._bloom.update(keys)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key in self._bloom

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's chained block keys) are held, from the first on."""
        n = 0
        for key in keys:
            if key not in self._bloom:
                break
            n += 1
        return n

    @property
    def size_bits(self) -> int:
        """Bits in the filter (rbloom rounds the optimal size up to whole bytes)."""
        return int(self._bloom.size_in_bits)

    def to_bytes(self) -> bytes:
        payload = self._bloom.save_bytes()
        return _HEADER.pack(MAGIC, VERSION, len(payload)) + payload

    @classmethod
    def from_bytes(cls, data: bytes) -> HoldingsFilter:
        """Decodes :meth:`to_bytes`' output; raises :class:`HoldingsFormatError` otherwise."""
        if len(data) < _PREFIX.size:
            raise HoldingsFormatError("too short for a holdings filter")
        magic, version = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise HoldingsFormatError("not a holdings filter (bad magic)")
        if version != VERSION:
            raise HoldingsFormatError(f"holdings filter version {version}, expected {VERSION}")
        if len(data) < _HEADER.size + _HASHES.size + 1:
            raise HoldingsFormatError("too short for a holdings filter")
        _, _, length = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if len(payload) != length:
            raise HoldingsFormatError(
                f"holdings filter of {len(payload)} bytes after its header, expected {length}"
            )
        (hashes,) = _HASHES.unpack_from(payload)
        if not 1 <= hashes <= _MAX_HASHES:
            raise HoldingsFormatError(f"corrupt holdings filter: {hashes} hash functions")
        out = cls.__new__(cls)
        try:
            out._bloom = Bloom.load_bytes(payload, key_hash)
        except (ValueError, TypeError) as exc:
            raise HoldingsFormatError(f"corrupt holdings filter: {exc}") from None
        return out
