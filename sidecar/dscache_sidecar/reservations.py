"""Reservations: space handed to a writer between Allocate and Commit.

Contract:
    * A reservation owns its extent until it is committed, aborted or expires;
      :class:`ReservationTable` gives the extent back (through ``free``) on abort
      and expiry, and hands it to the caller on :meth:`ReservationTable.finish`
      (published, or freed by the caller on a failed commit).
    * A claimed reservation (its commit is verifying bytes outside the store lock)
      neither expires nor aborts: the committer finishes it.
    * Expiry times are on the store clock's monotonic scale.
    * :meth:`ReservationTable.reserved_by` is the bytes a tenant holds in live
      reservations (they count against its quota until committed or dropped).

Not thread safe: the store calls every method under its lock.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from dscache_sidecar.blockstore import BlockSpec
from dscache_sidecar.leases import FreeFn


@dataclass(slots=True)
class Reservation:
    """Space reserved for one block."""

    write_id: str
    tenant: bytes
    spec: BlockSpec
    segment: int
    offset: int  # extent start
    extent: int
    expires: float
    committing: bool = False


class ReservationTable:
    """Live reservations by write id."""

    def __init__(self, free: FreeFn) -> None:
        self._free = free
        self._live: dict[str, Reservation] = {}
        self._by_tenant: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(
        self, tenant: bytes, spec: BlockSpec, extent: tuple[int, int], size: int, expires: float
    ) -> Reservation:
        """Records a reservation of ``size`` bytes at ``extent``; returns it."""
        res = Reservation(secrets.token_hex(12), tenant, spec, extent[0], extent[1], size, expires)
        self._live[res.write_id] = res
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + size
        return res

    def reserved_by(self, tenant: bytes) -> int:
        """Extent bytes of ``tenant``'s live reservations."""
        return self._by_tenant.get(tenant, 0)

    def _forget(self, res: Reservation) -> None:
        del self._live[res.write_id]
        left = self._by_tenant.get(res.tenant, 0) - res.extent
        if left > 0:
            self._by_tenant[res.tenant] = left
        else:
            self._by_tenant.pop(res.tenant, None)

    def get(self, write_id: str) -> Reservation | None:
        return self._live.get(write_id)

    def claim(self, write_id: str) -> Reservation | None:
        """Marks a reservation as being committed; None if gone or already claimed."""
        res = self._live.get(write_id)
        if res is None or res.committing:
            return None
        res.committing = True
        return res

    def finish(self, write_id: str) -> None:
        """Forgets a claimed reservation; its extent is now the caller's."""
        res = self._live.get(write_id)
        if res is not None:
            self._forget(res)

    def abort(self, write_ids: Iterable[str]) -> int:
        """Drops unclaimed reservations and frees their space; returns how many."""
        n = 0
        for write_id in write_ids:
            res = self._live.get(write_id)
            if res is not None and not res.committing:
                self._drop(res)
                n += 1
        return n

    def expire(self, now: float) -> int:
        """Drops unclaimed reservations whose time is up; returns how many."""
        dead = [r for r in self._live.values() if r.expires <= now and not r.committing]
        for res in dead:
            self._drop(res)
        return len(dead)

    def _drop(self, res: Reservation) -> None:
        self._forget(res)
        self._free(res.segment, res.offset, res.extent)
