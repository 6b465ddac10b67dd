"""What each tenant holds: its bytes and its blocks' recency, for per-tenant quotas.

With ``tenant_quota`` below 1 no tenant may hold more than that share of capacity:
a write that would take a tenant over evicts that tenant's own least recently
used blocks first, never another tenant's (:meth:`Catalog.make_room
<dscache_sidecar.catalog.Catalog.make_room>`), so one busy tenant cannot flush
everyone else's blocks.

Contract:
    * :class:`TenantUsage` counts the extent bytes of every published block per
      16-byte tenant id and keeps each tenant's blocks in LRU order
      (:class:`~dscache_sidecar.eviction.LRUPolicy`). The catalog keeps it in step
      on load (rebuilt from the index at start), publish, hit and removal.
    * Touches follow the catalog's order (a chain deepest first), so a tenant's
      own eviction takes children before their parents, as the store-wide policy does.

Not thread safe: the store calls every method under its lock.
"""

from __future__ import annotations

from dscache_sidecar.eviction import LRUPolicy
from dscache_sidecar.index import BlockRecord


class TenantUsage:
    """Bytes held and LRU order of each tenant's published blocks."""

    def __init__(self) -> None:
        self._bytes: dict[bytes, int] = {}
        self._order: dict[bytes, LRUPolicy[bytes]] = {}

    @property
    def tenants(self) -> int:
        """Tenants holding at least one block."""
        return len(self._bytes)

    def held(self, tenant: bytes) -> int:
        """Extent bytes of ``tenant``'s published blocks."""
        return self._bytes.get(tenant, 0)

    def add(self, rec: BlockRecord) -> None:
        """A block was published (or loaded at start): most recent of its tenant."""
        self._bytes[rec.tenant] = self._bytes.get(rec.tenant, 0) + rec.extent_bytes
        self._order.setdefault(rec.tenant, LRUPolicy()).admit(rec.key)

    def touch(self, rec: BlockRecord) -> None:
        """A block was hit: most recent of its tenant."""
        order = self._order.get(rec.tenant)
        if order is not None:
            order.access(rec.key)

    def remove(self, rec: BlockRecord) -> None:
        """A block left the catalog."""
        left = self._bytes.get(rec.tenant, 0) - rec.extent_bytes
        order = self._order.get(rec.tenant)
        if order is not None:
            order.remove(rec.key)
        if left > 0:
            self._bytes[rec.tenant] = left
        else:
            self._bytes.pop(rec.tenant, None)
            self._order.pop(rec.tenant, None)

    def victim(self, tenant: bytes) -> bytes | None:
        """Takes ``tenant``'s least recently used key out of its order (None: none left).

        The caller removes the block, or gives the key back with :meth:`readmit`.
        """
        order = self._order.get(tenant)
        return order.victim() if order is not None else None

    def readmit(self, tenant: bytes, key: bytes) -> None:
        """Puts back a key :meth:`victim` took but that was not evicted (leased)."""
        order = self._order.get(tenant)
        if order is not None:
            order.admit(key)
