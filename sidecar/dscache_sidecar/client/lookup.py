"""Lookups without a round trip: the client's read-only handle on the daemon's index.

Contract:
    * :class:`DirectIndex` opens the daemon's LMDB index read-only in this process
      (:class:`~dscache_sidecar.index.IndexReader`), lazily. While it cannot be
      opened (the daemon has not created it yet; the daemon runs in this very
      process; another PID namespace holds this process id's lock slot) ``get()``
      gives None and the client asks the daemon over gRPC; it tries again after
      ``DIRECT_RETRY_S``. A handle whose file was replaced (a new data directory)
      is dropped and opened anew.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import lmdb

from dscache_sidecar.blockstore import tenant_bytes
from dscache_sidecar.index import IndexReader

log = logging.getLogger(__name__)

#: Seconds before a client that could not open the index read-only tries again.
DIRECT_RETRY_S = 5.0
#: Seconds between checks that the index on disk is still the one opened.
_REPLACED_CHECK_S = 1.0


@dataclass(frozen=True)
class LookupAnswer:
    """How many leading blocks are stored, and whether the index said so (no RPC);
    ``remote`` of the ``found`` blocks are in the shared tier (the last ones)."""

    found: int
    direct: bool
    remote: int = 0


@functools.lru_cache(maxsize=4096)
def tenant_id(tenant: str) -> bytes:
    """The index's tenant bytes of a tenant label (cached: one per lookup otherwise)."""
    return tenant_bytes(tenant)


class DirectIndex:
    """The client's read-only handle on the daemon's index, opened lazily."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._reader: IndexReader | None = None
        self._next_try = 0.0
        self._next_check = 0.0
        self._told = False  # the fallback was logged
        self._lock = threading.Lock()

    def get(self) -> IndexReader | None:
        """The open reader, or None while the index cannot be read here."""
        now = time.monotonic()
        reader = self._reader
        if reader is not None and now < self._next_check:
            return reader
        with self._lock:
            if self._reader is not None:
                self._next_check = now + _REPLACED_CHECK_S
                if not self._reader.replaced():
                    return self._reader
                self._drop()
            if now < self._next_try:
                return None
            try:
                self._reader = IndexReader(self._path)
            except (OSError, lmdb.Error) as exc:
                self._next_try = now + DIRECT_RETRY_S
                # Once at info (a pod without a shared PID namespace stays this way);
                # the retries every few seconds at debug.
                level = logging.DEBUG if self._told else logging.INFO
                self._told = True
                log.log(level, "lookups go over gRPC: the index is not readable here (%s)", exc)
                return None
            if self._told:
                log.info("lookups read the index directly again")
                self._told = False
            self._next_check = now + _REPLACED_CHECK_S
            return self._reader

    def failed(self, exc: Exception) -> None:
        """Drops the handle after a read failed; the next ``get`` waits out the retry."""
        log.info("direct index read failed, back to gRPC lookups for a while: %s", exc)
        with self._lock:
            self._drop()
            self._next_try = time.monotonic() + DIRECT_RETRY_S

    def _drop(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(Exception):
                reader.close()

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._next_try = float("inf")
