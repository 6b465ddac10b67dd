"""The block store the request path talks to, and its implementation over the sidecar.

Contract:
    * ``KVBlockStore`` is all the request path needs: lookup (no side effects),
      load (leases the leading stored blocks), store, healthy, close. Its methods
      raise ``CacheError`` only; ``CacheError.reason`` is a label of
      ``dscache_server_cache_fallbacks_total``.
    * ``SidecarBlockStore`` reaches the sidecar only through ``dscache_sidecar.client``.
      After a connection failure (unavailable, deadline, unexpected error) the store
      is skipped for ``cooldown_s`` (``circuit_open``) and the client is rebuilt, so a
      dead sidecar costs one timeout, not one per request, and a restarted one is
      reached at once instead of after gRPC's reconnect backoff.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
from dscache_sidecar import client as sidecar

log = logging.getLogger(__name__)


class CacheError(Exception):
    """A cache operation failed; ``reason`` is a fallback-metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class NewBlock:
    """A block to store: key, parent key (b"" for block 0) and its array."""

    key: bytes
    parent: bytes
    array: np.ndarray


class Loaded(Protocol):
    """Leased blocks; arrays stay valid until ``release()``."""

    keys: list[bytes]
    arrays: list[np.ndarray]

    def release(self) -> None:
        """Ends the lease."""
        ...


class KVBlockStore(Protocol):
    """What the request path needs from a block store. Raises ``CacheError`` only."""

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Number of leading keys stored; no side effects."""
        ...

    def load(self, tenant: str, keys: Sequence[bytes], *, ttl_s: float) -> Loaded:
        """Leases and maps the leading stored blocks."""
        ...

    def store(self, tenant: str, blocks: Sequence[NewBlock]) -> int:
        """Stores blocks; returns how many were new."""
        ...

    def healthy(self) -> bool:
        """Whether the store answers."""
        ...

    def close(self) -> None:
        """Frees connections and mappings."""
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
        compress: True/False force zstd/raw; None lets the codec sample.
        cooldown_s: how long to skip the sidecar after a failure.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        data_dir: str | None = None,
        timeout_s: float = 0.5,
        compress: bool | None = None,
        cooldown_s: float = 2.0,
    ) -> None:
        self._connect = partial(
            sidecar.SidecarClient, socket_path, data_dir=data_dir, timeout_s=timeout_s
        )
        self._compress = compress
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
        """Leading keys stored."""
        client = self._get_client()
        try:
            return client.lookup(tenant, keys)
        except Exception as exc:
            raise self._failed(exc) from exc

    def load(self, tenant: str, keys: Sequence[bytes], *, ttl_s: float) -> Loaded:
        """Leases the leading stored blocks."""
        client = self._get_client()
        try:
            return client.load(tenant, keys, ttl_s=ttl_s, verify=True)
        except Exception as exc:
            raise self._failed(exc) from exc

    def store(self, tenant: str, blocks: Sequence[NewBlock]) -> int:
        """Stores blocks through Allocate/Commit (or Put without the volume)."""
        client = self._get_client()
        data = [sidecar.BlockData(b.key, b.parent, b.array) for b in blocks]
        try:
            return client.store(tenant, data, compress=self._compress)
        except Exception as exc:
            raise self._failed(exc) from exc

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
