"""The store's memory of what is cached: blocks, chains, policy order, free space.

Contract:
    * :class:`Catalog` holds every published block, the parent -> children map, the
      eviction policy's order, the extent allocator, and the bytes stored.
    * Removing a block removes its cached descendants (a cascade): they can never
      hit without it. A removed block's extent is freed now, or when the last
      lease on it ends (:class:`~dscache_sidecar.leases.LeaseTable`).
    * :meth:`Catalog.make_room` evicts by policy above the high watermark down to
      the low one, skips leased blocks (evicting one frees nothing until its lease
      ends) and gives them back to the policy afterwards.
    * With ``tenant_quota`` < 1, :meth:`Catalog.make_room` first keeps the writing
      tenant within its share: it evicts that tenant's own least recently used
      blocks (reason ``quota``), never another tenant's, and refuses the write
      (``tenant_quota``) when they are all leased (:mod:`dscache_sidecar.quota`).
    * After a restart, space is not reused until ``quarantine_until`` (monotonic):
      readers of the previous process may still map it.
    * Hits touch a chain deepest-first, so parents stay fresher than children.
    * A block that fails verification is dropped with its descendants; a
      truncated segment loses every block past its new end at once, and is
      extended again (:meth:`Catalog.drop_corrupt`).
    * Index records of removed blocks are deleted by :meth:`Catalog.forget`, which
      never fails: on a full disk, reconciliation at the next start drops them.

Not thread safe: the store calls every method under its lock.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import lmdb

from dscache_sidecar.blockstore import Clock, HoldingsEvents
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.eviction import EvictionPolicy, Resizable, Signalled, make_policy
from dscache_sidecar.index import BlockIndex, BlockRecord
from dscache_sidecar.leases import LeaseTable
from dscache_sidecar.metrics import SidecarMetrics
from dscache_sidecar.quota import TenantUsage
from dscache_sidecar.segments import ExtentAllocator, SegmentFiles, StoreFullError

log = logging.getLogger(__name__)


class Catalog:
    """Membership, chains, eviction order and space of the published blocks."""

    def __init__(
        self,
        settings: SidecarSettings,
        *,
        policy_name: str,
        metrics: SidecarMetrics,
        index: Callable[[], BlockIndex],
        clock: Clock,
        segments: SegmentFiles,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._clock = clock
        self._segments = segments
        #: Monotonic time until which space is not reused after a restart.
        self.quarantine_until = 0.0
        self._index = index
        self.blocks: dict[bytes, BlockRecord] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self.dirty_stats: set[bytes] = set()
        self.stored_raw = 0
        self.stored_payload = 0
        self._hint = max(16, settings.capacity_bytes // (1024 * 1024))
        self.policy: EvictionPolicy[Any] = make_policy(policy_name, self._hint, clock.monotonic)
        self.alloc = ExtentAllocator(settings.segment_bytes, 0)
        self.leases = LeaseTable(self.free)
        self.usage = TenantUsage()
        #: Told of every published block (the store's events; None = nobody).
        self.on_publish: Callable[[BlockRecord], None] | None = None
        #: Told of every block gained and lost (the KV-event publisher; None = nobody).
        self.holdings_events: HoldingsEvents | None = None

    def free(self, seg: int, offset: int, length: int) -> None:
        """Gives an extent back to the allocator."""
        self.alloc.free(seg, offset, length)

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.segments * self.settings.segment_bytes

    def owned(self, key: bytes, tenant: bytes) -> BlockRecord | None:
        """The block stored under ``key`` for ``tenant``, if any."""
        rec = self.blocks.get(key)
        return rec if rec is not None and rec.tenant == tenant else None

    def children_of(self, key: bytes, tenant: bytes) -> list[BlockRecord]:
        """``tenant``'s blocks stored directly under ``key`` (in key order)."""
        kids = (self.owned(k, tenant) for k in sorted(self._children.get(key, ())))
        return [rec for rec in kids if rec is not None]

    # ------------------------------------------------------------------ membership

    def load(self, good: Sequence[BlockRecord]) -> None:
        """Takes in reconciled records, oldest access first."""
        for rec in good:
            self.blocks[rec.key] = rec
            self.stored_raw += rec.raw_bytes
            self.stored_payload += rec.stored_bytes
            self.usage.add(rec)
        for rec in good:
            if rec.parent and rec.parent in self.blocks:
                self._children.setdefault(rec.parent, set()).add(rec.key)
            self.policy.admit(rec.key, rec.extent_bytes, rec.parent or None)
            if rec.hits:
                self.policy.access(rec.key)

    def publish(self, rec: BlockRecord) -> None:
        """Makes a committed block visible."""
        self.blocks[rec.key] = rec
        if rec.parent:
            self._children.setdefault(rec.parent, set()).add(rec.key)
        self.policy.admit(rec.key, rec.extent_bytes, rec.parent or None)
        self.usage.add(rec)
        self.stored_raw += rec.raw_bytes
        self.stored_payload += rec.stored_bytes
        self.metrics.stored_blocks.inc()
        self.metrics.stored_bytes.inc(rec.stored_bytes)

    def announce(self, published: Sequence[BlockRecord], tokens: Sequence[bytes] = ()) -> None:
        """Tells ``on_publish`` and ``holdings_events`` of published blocks, in the
        order given (chain order: a parent before its children); ``tokens`` are
        their token ids, where known."""
        if self.on_publish is not None:
            for rec in published:
                self.on_publish(rec)
        if self.holdings_events is not None and published:
            self.holdings_events.stored(published, tokens or [b""] * len(published))

    def hit(self, recs: Sequence[BlockRecord], now_ms: int) -> None:
        """Counts a hit on each block, in the order given (deepest first)."""
        for rec in recs:
            self.policy.access(rec.key)
            self.usage.touch(rec)
            rec.last_access_ms = now_ms
            rec.hits += 1
            self.dirty_stats.add(rec.key)

    def touch_ancestors(self, published: Sequence[BlockRecord]) -> None:
        """Freshens the stored ancestors of new blocks, after the blocks themselves.

        Not for a chain-aware policy: it orders chains itself, and a second touch
        in one request would count as a reuse.
        """
        if getattr(self.policy, "chain_aware", False):
            return
        new = {r.key for r in published}
        seen: set[bytes] = set()
        for rec in published:
            parent = rec.parent
            while parent and parent not in new and parent not in seen:
                seen.add(parent)
                if parent not in self.blocks:
                    break
                self.policy.access(parent)
                self.usage.touch(self.blocks[parent])
                parent = self.blocks[parent].parent

    def signal(self, keys: Sequence[bytes], tenant: bytes, kind: str, ttl_s: float) -> int:
        """Passes a serving-path signal on the leading stored blocks of ``tenant``
        among ``keys`` to a policy that takes signals; returns blocks marked (0
        for a policy without signals)."""
        if not isinstance(self.policy, Signalled):
            return 0
        held: list[bytes] = []
        for key in keys:
            if self.owned(key, tenant) is None:
                break
            held.append(key)
        return self.policy.signal(held, kind, ttl_s) if held else 0

    # ------------------------------------------------------------------ removal

    def remove_tree(self, roots: Sequence[BlockRecord], reason: str) -> list[BlockRecord]:
        """Removes blocks and their cached descendants from memory and the policy.

        Returns the removed records; the caller passes them to :meth:`forget`.
        """
        removed: list[BlockRecord] = []
        stack = [r.key for r in roots]
        while stack:
            key = stack.pop()
            rec = self.blocks.pop(key, None)
            if rec is None:
                continue
            removed.append(rec)
            self.policy.remove(key)
            self.usage.remove(rec)
            self.dirty_stats.discard(key)
            stack.extend(self._children.pop(key, ()))
            self._unlink_from_parent(rec)
            self.stored_raw -= rec.raw_bytes
            self.stored_payload -= rec.stored_bytes
            self.leases.free_or_defer((rec.segment, rec.offset), rec.extent_bytes)
        if removed:
            if self.holdings_events is not None:
                self.holdings_events.removed(removed)
            first = {r.key for r in roots}
            n_cascade = sum(1 for r in removed if r.key not in first)
            self.metrics.evictions.labels(reason=reason).inc(len(removed) - n_cascade)
            if n_cascade:
                self.metrics.evictions.labels(reason="cascade").inc(n_cascade)
        return removed

    def _unlink_from_parent(self, rec: BlockRecord) -> None:
        if not rec.parent:
            return
        siblings = self._children.get(rec.parent)
        if siblings is not None:
            siblings.discard(rec.key)
            if not siblings:
                del self._children[rec.parent]

    def discard(self, victims: list[BlockRecord], reason: str) -> int:
        """Removes blocks, their descendants and their index records; returns how many."""
        removed = self.remove_tree(victims, reason)
        self.forget(removed)
        return len(removed)

    def drop_corrupt(self, recs: Sequence[BlockRecord], where: str) -> None:
        """Drops blocks that failed verification, and every block a truncated
        segment lost; counts them and extends the segment again."""
        if not recs:
            return
        for rec in recs:
            log.warning("block %s failed verification (%s): dropped", rec.key.hex()[:16], where)
        # A truncated segment (someone cut the file) loses every block past its new
        # end; they go now, and the file is extended again. Without this, the space
        # stayed in the allocator, new blocks were published there and then dropped
        # at every read, for good (test_corruption.py).
        seg_bytes = self.settings.segment_bytes
        sizes = {
            r.segment: size
            for r in recs
            if (size := self._segments.file_size(r.segment)) < seg_bytes
        }
        if sizes:
            seen = {r.key for r in recs}
            recs = list(recs) + [
                r
                for r in self.blocks.values()
                if r.segment in sizes
                and r.offset + r.extent_bytes > sizes[r.segment]
                and r.key not in seen
            ]
        self.metrics.checksum_failures.labels(where=where).inc(len(recs))
        self.discard(list(recs), "corrupt")
        for seg in sizes:
            log.error("segment %d was truncated: its lost blocks were dropped", seg)
            try:
                os.posix_fallocate(self._segments.fd(seg), 0, seg_bytes)
            except OSError as exc:
                log.error("could not extend truncated segment %d again: %s", seg, exc)

    def forget(self, removed: list[BlockRecord]) -> None:
        """Drops records from the index. On a full disk the records stay behind;
        reconciliation discards them at the next start (their extents may have
        been reused, so their headers no longer match), so this never fails."""
        try:
            self._index().delete_many(removed)
        except lmdb.Error as exc:
            log.error("could not delete %d index records (disk full?): %s", len(removed), exc)

    # ------------------------------------------------------------------ eviction

    def make_room(
        self, size: int, removed: list[BlockRecord], tenant: bytes = b"", reserved: int = 0
    ) -> tuple[int, int]:
        """An extent of ``size`` bytes for ``tenant``, evicting as needed.

        ``reserved``: bytes ``tenant`` already holds in reservations (they count
        against its quota). Evicted records are appended to ``removed`` for
        :meth:`forget`.

        Raises:
            StoreFullError: the block is larger than a segment, there is no
                segment space, everything left is leased or reserved, or the
                tenant is at its quota with every block of its own leased.
        """
        if size > self.settings.segment_bytes:
            self.reject("too_large", "block larger than a segment")
        if self._clock.monotonic() < self.quarantine_until:
            self.reject(
                "quarantine",
                "space is quarantined after a restart (readers of the previous process "
                "may still map it); writes resume in "
                f"{self.quarantine_until - self._clock.monotonic():.0f}s",
            )
        cap = self.capacity_bytes
        if cap == 0:
            self.reject("disk_full", "no segment space (disk full at start)")
        if self.settings.tenant_quota < 1:
            self._keep_quota(tenant, reserved + size, cap, removed)
        used = cap - self.alloc.free_bytes
        # Leased blocks are skipped by eviction and go back to the policy afterwards:
        # evicting one frees nothing until its lease ends, so a single write near
        # the watermark used to drop every leased (in use, hottest) block from the
        # index, and a failed write emptied it (test_concurrency.py, test_disk_full.py).
        leased: list[BlockRecord] = []
        try:
            if used + size > self.settings.high_watermark * cap:
                self._resize_policy(cap, size)
                target = self.settings.low_watermark * cap - size
                while cap - self.alloc.free_bytes > target:
                    if not self._evict_one(removed, leased):
                        break
            ext = self.alloc.allocate(size)
            while ext is None:
                if not self._evict_one(removed, leased):
                    self.reject("full", "store is full of leased or reserved blocks")
                ext = self.alloc.allocate(size)
        finally:
            for rec in leased:
                if self.blocks.get(rec.key) is rec:
                    self.policy.admit(rec.key, rec.extent_bytes, rec.parent or None)
        return ext

    def _keep_quota(self, tenant: bytes, adding: int, cap: int, removed: list[BlockRecord]) -> None:
        """Evicts ``tenant``'s own LRU blocks until ``adding`` more bytes fit its quota."""
        limit = int(self.settings.tenant_quota * cap)
        if adding > limit:
            self.reject("tenant_quota", f"a block larger than a tenant's quota ({limit} bytes)")
        usage = self.usage
        leased: list[bytes] = []
        try:
            while usage.held(tenant) + adding > limit:
                key = usage.victim(tenant)
                if key is None:
                    self.reject(
                        "tenant_quota",
                        f"tenant over its quota ({limit} bytes, "
                        f"{self.settings.tenant_quota:g} of capacity) and its blocks are leased",
                    )
                rec = self.blocks[key]
                if self.leases.pinned((rec.segment, rec.offset)):
                    leased.append(key)
                    continue
                removed.extend(self.remove_tree([rec], "quota"))
        finally:
            for key in leased:
                if key in self.blocks:
                    usage.readmit(tenant, key)

    def reject(self, reason: str, message: str) -> NoReturn:
        """Counts a refused write and raises :class:`StoreFullError`."""
        self.metrics.write_rejections.labels(reason=reason).inc()
        raise StoreFullError(message)

    def _resize_policy(self, cap: int, size: int) -> None:
        """Tells a resizable policy how many blocks of the current size fit."""
        if not isinstance(self.policy, Resizable):
            return
        live = len(self.blocks)
        mean = ((cap - self.alloc.free_bytes) / live) if live else float(size)
        estimate = max(16, int(cap / max(mean, 1.0)))
        if not 0.8 * self._hint <= estimate <= 1.25 * self._hint:
            self._hint = estimate
            self.policy.resize(estimate)

    def _evict_one(self, removed: list[BlockRecord], leased: list[BlockRecord]) -> bool:
        while True:
            victim = self.policy.victim()
            if victim is None:
                return False
            rec = self.blocks.get(victim)
            if rec is None:
                return True
            if self.leases.pinned((rec.segment, rec.offset)):
                leased.append(rec)
                continue
            removed.extend(self.remove_tree([rec], "capacity"))
            return True
