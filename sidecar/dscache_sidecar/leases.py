"""Leases: which extents readers hold, and space whose freeing waits for them.

Contract:
    * An extent (segment, offset) is pinned while any lease or in-flight read
      holds it; pins are counted, so two leases on one block need two ends.
    * :meth:`LeaseTable.free_or_defer` frees an extent at once when nothing holds
      it, else when its last pin ends: a leased extent is never reused while a
      reader may still map it.
    * Expiry times are on the store clock's monotonic scale.

Not thread safe: the store calls every method under its lock.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Extent = tuple[int, int]  # (segment, offset of the extent start)

#: Gives an extent's space back: (segment, offset, length).
FreeFn = Callable[[int, int, int], None]


@dataclass(slots=True)
class Lease:
    """One grant: the extents it pins and when it ends (monotonic seconds)."""

    lease_id: str
    extents: list[Extent]
    expires: float


class LeaseTable:
    """Live leases, pin counts per extent, and frees deferred until unpinned."""

    def __init__(self, free: FreeFn) -> None:
        self._free = free
        self._leases: dict[str, Lease] = {}
        self._pins: dict[Extent, int] = {}
        self._deferred: dict[Extent, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def pin(self, extents: Iterable[Extent]) -> None:
        """Holds extents (one count each) without a lease, e.g. for one read."""
        for ext in extents:
            self._pins[ext] = self._pins.get(ext, 0) + 1

    def unpin(self, extents: Iterable[Extent]) -> None:
        """Drops one count per extent; frees space whose free was deferred."""
        for ext in extents:
            n = self._pins.get(ext, 0) - 1
            if n > 0:
                self._pins[ext] = n
                continue
            self._pins.pop(ext, None)
            length = self._deferred.pop(ext, None)
            if length is not None:
                self._free(ext[0], ext[1], length)

    def pinned(self, ext: Extent) -> bool:
        """True while a lease or a read holds ``ext``."""
        return bool(self._pins.get(ext))

    def free_or_defer(self, ext: Extent, length: int) -> None:
        """Frees the extent now, or when its last pin ends."""
        if self.pinned(ext):
            self._deferred[ext] = length
        else:
            self._free(ext[0], ext[1], length)

    def grant(self, extents: list[Extent], expires: float) -> str:
        """Pins ``extents`` under a new lease; returns its id."""
        lease_id = secrets.token_hex(12)
        self.pin(extents)
        self._leases[lease_id] = Lease(lease_id, extents, expires)
        return lease_id

    def extend(self, lease_id: str, expires: float) -> bool:
        """Moves a live lease's end; False if it is gone."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.expires = expires
        return True

    def end(self, lease_id: str) -> bool:
        """Ends a lease (unpinning its extents); False if it was gone."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.unpin(lease.extents)
        return True

    def expire(self, now: float) -> int:
        """Ends every lease whose time is up; returns how many."""
        dead = [lid for lid, lease in self._leases.items() if lease.expires <= now]
        for lid in dead:
            self.end(lid)
        return len(dead)
