"""Leases that outlive the work: one thread extends every lease whose blocks are in use.

A lease pins the blocks a reader maps; when it runs out the daemon may reuse their
space, and a reader still computing from the mapping would read another block's
bytes after its checksum passed. So a lease is not a guess at how long the work
takes: it is extended for as long as the blocks are in use.

Contract:
    * :meth:`LeaseKeeper.hold` takes a granted lease; from then on it is extended
      (``Lease`` with its id and the same TTL) every third of its TTL until
      :meth:`LeaseKeeper.drop`.
    * :attr:`Held.until` is the monotonic time up to which the lease is known to be
      held: the last grant or extension, counted from when it was asked (never
      later than the daemon's own clock says).
    * :attr:`Held.lapsed` turns true, for good, once the daemon says the lease is
      gone or ``until`` passed without an extension: the bytes may have been
      reused since, and whatever was computed from them must be recomputed. A
      failed extension (a daemon busy or restarting) is retried every tenth of the
      TTL until then.

Thread safety: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dscache.v1 import kvcache_pb2 as pb
from dscache_sidecar.client.rpc import Connection, call
from dscache_sidecar.errors import SidecarError

log = logging.getLogger(__name__)

#: Extend when this share of the TTL is left (a third gone: two tries before it ends).
_RENEW_AT = 2 / 3
#: After a failed extension, try again after this share of the TTL.
_RETRY_AFTER = 0.1


@dataclass
class Held:
    """One lease the keeper extends."""

    lease_id: str
    ttl_s: float
    until: float
    lapsed: bool = False


class LeaseKeeper:
    """Extends held leases on one daemon thread (started on the first ``hold``).

    Args:
        conn: the connection to the daemon.
        monotonic: the clock (tests may pass another).
    """

    def __init__(self, conn: Connection, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._conn = conn
        self._now = monotonic
        self._held: dict[str, Held] = {}
        self._due: dict[str, float] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def hold(self, lease_id: str, ttl_s: float, asked_at: float, expires_unix_ms: int) -> Held:
        """Keeps the lease ``lease_id`` (asked for ``ttl_s`` at monotonic ``asked_at``,
        granted until ``expires_unix_ms``) alive until :meth:`drop`."""
        granted_s = max(0.0, expires_unix_ms / 1000 - time.time())
        # The daemon may have granted less than asked (its longest lease): the shorter.
        ttl = min(ttl_s, granted_s + (self._now() - asked_at)) if ttl_s > 0 else granted_s
        held = Held(lease_id, ttl, asked_at + ttl)
        with self._wake:
            if self._closed:
                return held
            self._held[lease_id] = held
            self._due[lease_id] = held.until - _RENEW_AT * ttl
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="kv-lease-keeper", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return held

    def drop(self, lease_id: str) -> None:
        """Stops extending ``lease_id`` (its blocks are no longer used)."""
        with self._wake:
            self._held.pop(lease_id, None)
            self._due.pop(lease_id, None)

    def close(self) -> None:
        """Ends the thread; leases still held run out on the daemon's clock."""
        with self._wake:
            self._closed = True
            self._held.clear()
            self._due.clear()
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    now = self._now()
                    due = [lid for lid, at in self._due.items() if at <= now]
                    if due:
                        break
                    nearest = min(self._due.values(), default=now + 3600)
                    self._wake.wait(timeout=max(0.0, nearest - now))
                if self._closed:
                    return
                work = [(lid, self._held[lid]) for lid in due]
            for lease_id, held in work:
                self._extend(lease_id, held)

    def _extend(self, lease_id: str, held: Held) -> None:
        asked_at = self._now()
        request = pb.LeaseRequest(lease_id=lease_id, ttl_ms=max(1, int(held.ttl_s * 1000)))
        try:
            resp: pb.LeaseResponse = call(
                self._conn.stub.Lease, request, min(self._conn.timeout_s, held.ttl_s / 3)
            )
        except SidecarError as exc:
            now = self._now()
            with self._wake:
                if now >= held.until:
                    self._lapse(lease_id, held, f"not extended in time ({exc})")
                elif lease_id in self._due:
                    self._due[lease_id] = now + _RETRY_AFTER * held.ttl_s
            return
        with self._wake:
            if lease_id not in self._held:
                return  # dropped meanwhile
            if not resp.lease_id or asked_at >= held.until:
                self._lapse(lease_id, held, "the daemon no longer had it")
                return
            held.until = asked_at + held.ttl_s
            self._due[lease_id] = held.until - _RENEW_AT * held.ttl_s

    def _lapse(self, lease_id: str, held: Held, why: str) -> None:
        held.lapsed = True
        self._held.pop(lease_id, None)
        self._due.pop(lease_id, None)
        log.warning("lease %s lapsed while its blocks were in use: %s", lease_id, why)
