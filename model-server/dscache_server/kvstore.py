"""The block store the request path talks to, and its implementation over the sidecar.

Contract:
    * ``KVBlockStore`` is all the request path needs: lookup (no side effects),
      load (leases the leading stored blocks), store, healthy, close. Its methods
      raise ``CacheError`` only; ``CacheError.reason`` is a label of
      ``dscache_server_cache_fallbacks_total``.
    * A load may return before its checksums are checked (``background_verify``):
      ``Loaded.verified()`` then says how many leading blocks matched, and nothing
      computed from a block past that count may leave the process.
    * ``SidecarBlockStore.lookup`` reads the sidecar's index directly when it can
      (no RPC; ``dscache_server_cache_lookups_total{path="direct"}``), else asks
      the daemon (``path="rpc"``); only a lease needs the daemon.
    * ``SidecarBlockStore`` reaches the sidecar only through ``dscache_sidecar.client``.
      After a connection failure (unavailable, deadline, unexpected error) the store
      is skipped for ``cooldown_s`` (``circuit_open``) and the client is rebuilt, so a
      dead sidecar costs one timeout, not one per request, and a restarted one is
      reached at once instead of after gRPC's reconnect backoff.
    * ``Signalling`` (optional; ``SidecarBlockStore`` has it): serving-path signals
      on a chain for the sidecar's eviction policy, best effort.
    * ``Descending`` (optional; ``SidecarBlockStore`` has it): the blocks stored
      under a block with their token ids, for ``respell``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

import numpy as np
from dscache_sidecar import client as sidecar
from dscache_sidecar.client import RAW, Encoding
from prometheus_client import Counter

log = logging.getLogger(__name__)


class CacheError(Exception):
    """A cache operation failed; ``reason`` is a fallback-metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class NewBlock:
    """A block to store: key, parent key (b"" for block 0), its array, and the
    contract dtype name where the array's own type does not say it (``bfloat16``
    travels as ``uint16``); "" = the array's. ``token_ids``: the block's own tokens
    (the sidecar names the block by them in its KV events)."""

    key: bytes
    parent: bytes
    array: np.ndarray
    dtype: str = ""
    token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class StoredBlock:
    """A block stored under another (``Descending``): its key, its parent's, and the
    token ids it was stored with."""

    key: bytes
    parent: bytes
    token_ids: Sequence[int]


class Loaded(Protocol):
    """Leased blocks; arrays stay valid until ``release()``.

    Attributes:
        keys: the blocks' keys, in chain order.
        arrays: their arrays (views on the store's mapping where it has one).
        lease_s: seconds the lease took (its round trip).
        map_s: seconds mapping (and, unless in the background, checking) took.
    """

    keys: list[bytes]
    arrays: list[np.ndarray]
    lease_s: float
    map_s: float

    def verified(self, timeout_s: float | None = None) -> int:
        """How many leading blocks passed their checksum (waits for a background check)."""
        ...

    def held_until(self) -> float:
        """Monotonic time up to which the blocks are known to be leased (extended in
        the background while held; infinite for copies)."""
        ...

    def lapsed(self) -> bool:
        """Whether the lease ran out while held (the arrays may show other bytes)."""
        ...

    def release(self) -> None:
        """Ends the lease."""
        ...


class KVBlockStore(Protocol):
    """What the request path needs from a block store. Raises ``CacheError`` only."""

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Number of leading keys stored; no side effects."""
        ...

    def load(
        self, tenant: str, keys: Sequence[bytes], *, ttl_s: float, background_verify: bool = False
    ) -> Loaded:
        """Leases and maps the leading stored blocks (checked now, or in the background)."""
        ...

    def store(self, tenant: str, blocks: Sequence[NewBlock], encoding: Encoding = RAW) -> int:
        """Stores blocks encoded as ``encoding``; returns how many were new."""
        ...

    def healthy(self) -> bool:
        """Whether the store answers."""
        ...

    def close(self) -> None:
        """Frees connections and mappings."""
        ...


@runtime_checkable
class Signalling(Protocol):
    """Optional capability of a store: serving-path signals reach its eviction policy."""

    def signal(self, tenant: str, keys: Sequence[bytes], kind: str, ttl_s: float = 0.0) -> int:
        """Marks the chain ``keys`` (``ended``, ``expected``, ``queued``); raises
        ``CacheError`` on a failure."""
        ...


@runtime_checkable
class Descending(Protocol):
    """Optional capability of a store: the blocks stored under a block, with the token
    ids they were stored with (``respell``)."""

    def descendants(
        self, tenant: str, key: bytes, max_blocks: int = 256, first_tokens: Sequence[int] = ()
    ) -> tuple[list[StoredBlock], bool]:
        """``tenant``'s blocks under ``key``, parents first (those directly under it
        only when they start with one of ``first_tokens``, if given), and whether the
        answer was cut at ``max_blocks``; raises ``CacheError`` on a failure."""
        ...


def failure_reason(exc: BaseException) -> str:
    """The fallback label of an exception raised by the sidecar client."""
    if isinstance(exc, sidecar.SidecarUnavailableError):
        return "timeout" if "DEADLINE" in str(exc) else "unavailable"
    if isinstance(exc, sidecar.SidecarFullError):
        return "full"
    if isinstance(exc, sidecar.SidecarRejectedError):
        return "rejected"
    return "error"


#: Failures that say the connection is bad (not the request): they open the circuit.
_CONNECTION_FAILURES = frozenset({"timeout", "unavailable", "error"})


class SidecarBlockStore:
    """``KVBlockStore`` over the sidecar client, with a circuit breaker.

    Args:
        socket_path: the daemon's unix socket.
        data_dir: the cache volume as mounted here, for zero-copy reads.
        timeout_s: deadline of each lookup/lease call.
        cooldown_s: how long to skip the sidecar after a failure.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        data_dir: str | None = None,
        timeout_s: float = 0.5,
        cooldown_s: float = 2.0,
        lookups: Counter | None = None,
    ) -> None:
        self._connect = partial(
            sidecar.SidecarClient, socket_path, data_dir=data_dir, timeout_s=timeout_s
        )
        self._lookups = lookups
        self._cooldown = cooldown_s
        self._lock = threading.Lock()  # guards the client swap and the circuit state
        self._client = self._connect()
        self._open_until = 0.0
        self._broken = False

    def _get_client(self) -> sidecar.SidecarClient:
        with self._lock:
            if time.monotonic() < self._open_until:
                raise CacheError("circuit_open", "sidecar failed recently; skipping the cache")
            if self._broken:
                # A fresh channel reconnects at once instead of waiting out gRPC's
                # reconnect backoff, which grows to minutes.
                old, self._client, self._broken = self._client, self._connect(), False
                try:
                    old.close()
                except Exception as exc:
                    log.debug("closing the old sidecar client failed: %s", exc)
            return self._client

    def _failed(self, exc: Exception) -> CacheError:
        if isinstance(exc, CacheError):
            return exc
        reason = failure_reason(exc)
        if reason in _CONNECTION_FAILURES:
            with self._lock:
                self._broken = True
                self._open_until = time.monotonic() + self._cooldown
        return CacheError(reason, f"{type(exc).__name__}: {exc}")

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Leading keys stored (from the index when readable here, else over gRPC)."""
        client = self._get_client()
        try:
            answer = client.find(tenant, keys)
        except Exception as exc:
            raise self._failed(exc) from exc
        if self._lookups is not None:
            self._lookups.labels(path="direct" if answer.direct else "rpc").inc()
        return answer.found

    def load(
        self, tenant: str, keys: Sequence[bytes], *, ttl_s: float, background_verify: bool = False
    ) -> Loaded:
        """Leases the leading stored blocks and maps them."""
        client = self._get_client()
        try:
            t0 = time.perf_counter()
            grant = client.lease(tenant, keys, ttl_s=ttl_s)
            t1 = time.perf_counter()
            verify: sidecar.Verify = "background" if background_verify else True
            loaded = client.map_lease(grant, verify=verify, tenant=tenant, keys=keys)
            loaded.lease_s, loaded.map_s = t1 - t0, time.perf_counter() - t1
            return loaded
        except Exception as exc:
            raise self._failed(exc) from exc

    def store(self, tenant: str, blocks: Sequence[NewBlock], encoding: Encoding = RAW) -> int:
        """Stores blocks through Allocate/Commit (or Put without the volume)."""
        client = self._get_client()
        data = [
            sidecar.BlockData(b.key, b.parent, b.array, b.dtype or None, b.token_ids)
            for b in blocks
        ]
        try:
            return client.store(tenant, data, encoding)
        except Exception as exc:
            raise self._failed(exc) from exc

    def signal(self, tenant: str, keys: Sequence[bytes], kind: str, ttl_s: float = 0.0) -> int:
        """Tells the sidecar's eviction policy about a chain (``ended``, ``expected``,
        ``queued``); returns the blocks it marked (0 from an older sidecar)."""
        client = self._get_client()
        try:
            return client.signal(tenant, keys, kind, int(ttl_s * 1000))
        except Exception as exc:
            raise self._failed(exc) from exc

    def descendants(
        self, tenant: str, key: bytes, max_blocks: int = 256, first_tokens: Sequence[int] = ()
    ) -> tuple[list[StoredBlock], bool]:
        """The stored blocks under ``key`` with their token ids (none from an older
        sidecar)."""
        client = self._get_client()
        try:
            blocks, cut = client.descendants(tenant, key, max_blocks, first_tokens)
        except Exception as exc:
            raise self._failed(exc) from exc
        out = [
            StoredBlock(b.key, b.parent, np.frombuffer(b.tokens, dtype="<u4").tolist())
            for b in blocks
        ]
        return out, cut

    def healthy(self) -> bool:
        """Whether the daemon reports SERVING."""
        try:
            return self._get_client().healthy()
        except CacheError:
            return False

    def close(self) -> None:
        """Closes the client."""
        with self._lock:
            self._client.close()
