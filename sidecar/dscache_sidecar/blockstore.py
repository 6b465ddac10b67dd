"""What the daemon needs from a block store: a small interface, optional capabilities.

Contract:
    * :class:`BlockStore` is the interface every store offers: ``lookup`` (how many
      leading keys are stored, no side effects), ``read`` (one verified block or a
      miss), ``put`` (store one block from bytes), ``delete``, ``clear_tenant``,
      ``gauges`` (totals for Stats and the metrics collector) and ``close``.
    * Optional capabilities are separate protocols, not flags: :class:`Leasing`
      (pin blocks in place for zero-copy readers, with a TTL) and
      :class:`Reserving` (reserve space, let the writer fill it in place, then
      publish). The daemon answers UNIMPLEMENTED for the RPCs of a capability the
      store lacks. :class:`Signalling` passes serving-path hints (session ended,
      next turn expected, request queued) to the eviction policy. :class:`Listing`
      (every stored key at once, and a change counter) is what the holdings
      publisher reads; a store without it publishes no holdings. :class:`Descending`
      lists the blocks stored under a block with their token ids.
    * A miss is never an exception; malformed input raises ``ValueError``; a store
      that cannot make room raises :class:`StoreFullError`.
    * Time: a store reads time only through a :class:`Clock`. ``monotonic`` measures
      TTLs and the restart quarantine (immune to wall-clock steps); ``wall`` stamps
      what leaves the process or outlives it (``expires_unix_ms``, access and
      creation times in the index).

The value types the interface speaks (:class:`BlockSpec`, :class:`SlotGrant`,
:class:`LeaseGrant`, :class:`CommitResult`) live here too, so the daemon needs no
import of a concrete store.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol, runtime_checkable

from dscache_sidecar.codec import INT8_SOURCE_DTYPES, NUMPY_DTYPES, Codec, int8_stored_bytes
from dscache_sidecar.index import BlockRecord
from dscache_sidecar.metrics import StoreGauges
from dscache_sidecar.segments import StoreFullError

KEY_BYTES = 32
_HEX_TENANT = re.compile(r"^[0-9a-f]{32}$")

__all__ = [
    "KEY_BYTES",
    "BlockEvents",
    "BlockSpec",
    "BlockStore",
    "Clock",
    "CommitResult",
    "LeaseGrant",
    "Leasing",
    "Listing",
    "Reserving",
    "Signalling",
    "SlotGrant",
    "StoreFullError",
    "SystemClock",
    "tenant_bytes",
]


def tenant_bytes(tenant: str) -> bytes:
    """The 16-byte tenant id stored per block.

    A contract tenant label (32 hex chars) maps to its bytes; any other string is
    hashed, so every tenant string maps to one stable id.
    """
    if _HEX_TENANT.match(tenant):
        return bytes.fromhex(tenant)
    return hashlib.sha256(b"dscache/tenant-id/v1\x00" + tenant.encode()).digest()[:16]


class Clock(Protocol):
    """The store's only source of time (tests inject a fake one)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never steps back: TTLs, quarantine, flush period."""
        ...

    def wall(self) -> float:
        """Unix seconds: expiry times told to clients, access times kept in the index."""
        ...


class SystemClock:
    """:class:`Clock` on ``time.monotonic`` and ``time.time``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class CommitResult(IntEnum):
    """Same numbers as ``dscache.v1.CommitResult``."""

    OK = 0
    CHECKSUM_MISMATCH = 1
    EXPIRED = 2
    DUPLICATE = 3


#: Most token ids one block may be announced with (a block of the key contract
#: holds far fewer).
MAX_BLOCK_TOKENS = 65536


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """A block a writer wants to store (everything but its bytes)."""

    key: bytes
    parent: bytes
    codec: int
    dtype: str
    shape: tuple[int, ...]
    raw_bytes: int
    stored_bytes: int
    tokens: bytes = b""
    """The block's own token ids as little-endian u32 (empty: not given): kept
    beside the index only to name the block in KV events."""

    def validate(self, max_stored: int) -> None:
        """ValueError with a message a client author can act on."""
        if len(self.tokens) > MAX_BLOCK_TOKENS * 4:
            raise ValueError(f"more than {MAX_BLOCK_TOKENS} token ids for one block")
        if len(self.key) != KEY_BYTES:
            raise ValueError("key must be 32 bytes")
        if self.parent and len(self.parent) != KEY_BYTES:
            raise ValueError("parent must be empty or 32 bytes")
        if self.parent == self.key:
            raise ValueError("a block cannot be its own parent")
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.codec not in tuple(Codec):
            raise ValueError(f"unknown codec {self.codec}")
        if not 1 <= len(self.shape) <= 6 or any(d <= 0 for d in self.shape):
            raise ValueError("shape needs 1 to 6 positive dimensions")
        self._check_sizes(max_stored)

    def _check_sizes(self, max_stored: int) -> None:
        if math.prod(self.shape) * NUMPY_DTYPES[self.dtype].itemsize != self.raw_bytes:
            raise ValueError("raw_bytes does not equal prod(shape) * itemsize")
        if self.codec == Codec.RAW and self.stored_bytes != self.raw_bytes:
            raise ValueError("a raw block stores exactly raw_bytes")
        if self.codec == Codec.INT8_ROWS:
            if self.dtype not in INT8_SOURCE_DTYPES:
                raise ValueError(f"int8 blocks decode to {', '.join(INT8_SOURCE_DTYPES)}")
            if self.stored_bytes != int8_stored_bytes(self.shape):
                raise ValueError("an int8 block stores one byte per element + a scale per row")
        if not 0 < self.stored_bytes <= max_stored:
            raise ValueError(f"stored_bytes must be in (0, {max_stored}]")
        if self.raw_bytes > max_stored:
            # What a decoder allocates: a compressed block must decode to no more than
            # the largest block stored as it is (no decompression bomb by shape).
            raise ValueError(f"raw_bytes must be at most {max_stored} (the largest block)")


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """Where a writer puts one block's payload."""

    key: bytes
    write_id: str
    segment: str
    offset: int
    exists: bool


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """Leased blocks, in chain order, and when the lease ends."""

    lease_id: str
    blocks: list[tuple[BlockRecord, str, int]]  # (record, segment name, payload offset)
    expires_unix_ms: int


class BlockStore(Protocol):
    """The interface every block store offers the daemon."""

    @property
    def policy_name(self) -> str:
        """The eviction policy in use (reported by Stats)."""
        ...

    @property
    def max_stored_bytes(self) -> int:
        """Largest payload one block may have."""
        ...

    def lookup(self, tenant: str, keys: Sequence[bytes], block_tokens: int = 0) -> int:
        """Number of leading keys stored for ``tenant``; no side effects."""
        ...

    def read(self, tenant: str, key: bytes) -> tuple[BlockRecord, bytes] | None:
        """One block's verified stored bytes, or ``None`` on a miss."""
        ...

    def put(self, tenant: str, spec: BlockSpec, data: bytes, client_sum: int) -> tuple[bool, bool]:
        """Stores one block from bytes: (newly stored, already existed)."""
        ...

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Removes blocks of ``tenant`` and their descendants; returns how many."""
        ...

    def clear_tenant(self, tenant: str) -> int:
        """Removes every block of ``tenant``; returns how many."""
        ...

    def gauges(self) -> StoreGauges:
        """Current totals (blocks, bytes, leases, pending writes)."""
        ...

    def close(self) -> None:
        """Flushes what must outlive the process and closes files; idempotent."""
        ...


class BlockEvents(Protocol):
    """Who wants to know what a store publishes and what it serves (the shared tier)."""

    def stored(self, rec: BlockRecord) -> None:
        """A block was published. Called with the store's lock held: must not block
        and must not call the store."""
        ...

    def hit(self, recs: Sequence[BlockRecord]) -> None:
        """Blocks were leased (reused), in chain order. Called outside the lock."""
        ...


class HoldingsEvents(Protocol):
    """Who is told of every block the store gains or loses (the KV-event publisher).

    Both are called with the store's lock held: they must not block and must not
    call the store.
    """

    def stored(self, recs: Sequence[BlockRecord], tokens: Sequence[bytes]) -> None:
        """Blocks were published, in chain order; ``tokens[i]`` are ``recs[i]``'s
        token ids (little-endian u32, empty when the writer gave none)."""
        ...

    def removed(self, recs: Sequence[BlockRecord]) -> None:
        """Blocks left the store (evicted, deleted, cleared, found corrupt)."""
        ...


@runtime_checkable
class Leasing(Protocol):
    """Capability: pin blocks in place so readers map them without a copy."""

    def lease(
        self,
        tenant: str,
        keys: Sequence[bytes],
        ttl_s: float | None = None,
        block_tokens: int = 0,
    ) -> LeaseGrant:
        """Pins the leading stored blocks and returns their locations."""
        ...

    def extend(self, lease_id: str, ttl_s: float | None = None) -> int:
        """New expiry of a live lease (unix ms), 0 if it is gone."""
        ...

    def release(self, lease_id: str, corrupt_keys: Sequence[bytes] = ()) -> bool:
        """Ends a lease; blocks the reader found corrupt are re-checked and dropped."""
        ...


@runtime_checkable
class Reserving(Protocol):
    """Capability: writers fill reserved space in place, then publish it."""

    def allocate(
        self, tenant: str, specs: Sequence[BlockSpec], ttl_s: float | None = None
    ) -> list[SlotGrant]:
        """Reserves space for the leading blocks that fit."""
        ...

    def commit(self, writes: Sequence[tuple[str, int | None]]) -> list[CommitResult]:
        """Verifies and publishes reserved blocks: one result per (write id, checksum)."""
        ...

    def abort(self, write_ids: Iterable[str]) -> int:
        """Drops reservations; returns how many were live."""
        ...


@runtime_checkable
class Signalling(Protocol):
    """Capability: serving-path signals about a chain reach the eviction policy."""

    def signal(self, tenant: str, keys: Sequence[bytes], kind: str, ttl_s: float) -> int:
        """Marks the leading stored blocks of ``keys`` (``kind``: ended, expected,
        queued); returns how many the policy marked (0 for a policy without signals)."""
        ...


@dataclass(frozen=True, slots=True)
class Descendant:
    """A stored block below another: its key, its parent's, and its token ids
    (little-endian u32, as its writer gave them)."""

    key: bytes
    parent: bytes
    tokens: bytes


@runtime_checkable
class Descending(Protocol):
    """Capability: the stored blocks under a block, with their token ids, so a
    server can follow how a conversation was tokenized when it was stored."""

    def descendants(
        self, tenant: str, key: bytes, max_blocks: int, first_tokens: Sequence[int] = ()
    ) -> tuple[list[Descendant], bool]:
        """Up to ``max_blocks`` of ``tenant``'s blocks under ``key``, breadth first
        (parents before children), leaving out blocks without token ids and what is
        under them, and (with ``first_tokens``) the blocks directly under ``key``
        that start with another token; and whether more were left out by the bound.
        Nothing for a key that is not ``tenant``'s."""
        ...


@runtime_checkable
class Listing(Protocol):
    """Capability: every stored key of every tenant in one cheap pass, and a counter
    that tells whether anything changed (:mod:`dscache_sidecar.holdings_publisher`)."""

    def change_id(self) -> int:
        """A number that differs after any change to the stored keys (it may also
        change when they did not)."""
        ...

    def scan_keys(self) -> AbstractContextManager[tuple[int, Iterator[bytes]]]:
        """(count, keys) of a consistent snapshot, valid inside the ``with`` block."""
        ...
