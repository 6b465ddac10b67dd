"""The KV block store: segments + LMDB index + eviction, safe under concurrency.

:class:`KVStore` is the one concrete :class:`~dscache_sidecar.blockstore.BlockStore`;
it also offers the ``Leasing``, ``Reserving``, ``Signalling``, ``Descending`` and
``Listing`` capabilities. It composes:
:class:`~dscache_sidecar.catalog.Catalog` (what is cached, eviction, space),
:class:`~dscache_sidecar.leases.LeaseTable` (pins), :class:`~dscache_sidecar.writes.Writes`
(reservations and the commit path) and :mod:`~dscache_sidecar.reconcile` (start).

Contract:
    * ``lookup`` has no side effects; ``lease`` pins blocks and counts as an access.
    * A block is visible only after its payload is on disk (fsync'd when
      ``durable``), its checksum known, its header written, and its index record
      committed, in that order (:mod:`dscache_sidecar.writes`).
    * A block whose bytes or header do not verify is never returned: it becomes a
      miss, is removed from the index and counted.
    * A leased extent is never reused: eviction removes the block from the index at
      once, but its space is freed only when the last lease on it ends.
    * After a restart, space is not reused for ``restart_quarantine_s``: readers of
      the previous process may still map it.
    * Evicting a block also evicts its cached descendants (they can never hit
      without it); hits touch the chain deepest-first so parents stay fresher.
    * A store that cannot make room raises ``StoreFullError``; reads go on.
    * ``signal`` hands serving-path hints to the policy: no I/O, no error for keys
      not stored, nothing for a policy without signals.
    * Counts (evictions, checksum failures) live only in :class:`SidecarMetrics`.
    * One store per data directory: ``open`` takes its exclusive lock
      (:mod:`dscache_sidecar.dirlock`) before it touches anything in it, and
      ``close`` frees it; a held lock is ``DataDirLockedError``.
    * Time comes only from the injected :class:`~dscache_sidecar.blockstore.Clock`:
      monotonic for TTLs and the quarantine, wall for unix times.

Thread safety: every public method may be called from any thread. State changes
happen under one lock; hashing of payloads happens outside it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager

from dscache_sidecar.blockstore import (
    BlockEvents,
    BlockSpec,
    Clock,
    CommitResult,
    Descendant,
    HoldingsEvents,
    LeaseGrant,
    SlotGrant,
    StoreFullError,
    SystemClock,
    tenant_bytes,
)
from dscache_sidecar.catalog import Catalog
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.dirlock import DataDirLock
from dscache_sidecar.eviction import DEFAULT_POLICY
from dscache_sidecar.faults import FaultInjector
from dscache_sidecar.index import BlockIndex, BlockRecord
from dscache_sidecar.metrics import SidecarMetrics, StoreGauges
from dscache_sidecar.reconcile import reconcile
from dscache_sidecar.segments import HEADER_BYTES, ExtentAllocator, SegmentFiles, checksum
from dscache_sidecar.upkeep import Reaper
from dscache_sidecar.writes import WriteContext, Writes

log = logging.getLogger(__name__)

__all__ = ["KVStore", "StoreFullError"]


def _chain_order(blocks: dict[bytes, BlockRecord]) -> list[BlockRecord]:
    """``blocks``, each after its stored parent, depth first: a chain's blocks
    come one after another, so they make few events."""
    children: dict[bytes, list[BlockRecord]] = {}
    stack: list[BlockRecord] = []
    for rec in blocks.values():
        if rec.parent and rec.parent in blocks:
            children.setdefault(rec.parent, []).append(rec)
        else:
            stack.append(rec)
    out: list[BlockRecord] = []
    stack.reverse()
    while stack:
        rec = stack.pop()
        out.append(rec)
        stack.extend(reversed(children.get(rec.key, ())))
    return out


def _index_reserve(settings: SidecarSettings) -> int:
    """Free disk space segment preallocation leaves for the index to grow into:
    about 1 KiB per 4 KiB-extent block at most, at least 256 KiB, at most 64 MiB."""
    return min(64 * 1024**2, max(256 * 1024, settings.capacity_bytes // 64))


class KVStore:
    """The node-local block store. Build with ``KVStore(settings)``, then ``open()``."""

    def __init__(
        self,
        settings: SidecarSettings,
        metrics: SidecarMetrics | None = None,
        clock: Clock | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        """``faults``: injected faults (:mod:`dscache_sidecar.faults`); None = never any."""
        self.settings = settings
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._clock = clock if clock is not None else SystemClock()
        self._lock = threading.RLock()
        self.policy_name = settings.policy or DEFAULT_POLICY
        seg_count = max(1, settings.capacity_bytes // settings.segment_bytes)
        self._segments = SegmentFiles(
            settings.data_dir / "segments",
            settings.segment_bytes,
            seg_count,
            settings.segment_init,
            faults,
        )
        self._index: BlockIndex | None = None
        self._catalog = Catalog(
            settings,
            policy_name=self.policy_name,
            metrics=self.metrics,
            index=self._idx,
            clock=self._clock,
            segments=self._segments,
        )
        self._leases = self._catalog.leases
        self._hooks: dict[str, Callable[[], None]] = {}
        self._writes = Writes(
            WriteContext(
                settings,
                self._segments,
                self._catalog,
                self._idx,
                self._lock,
                self._clock,
                self._hook,
            )
        )
        self._reaper: Reaper | None = None
        self._dir_lock = DataDirLock(settings.data_dir)
        self._events: BlockEvents | None = None

    def set_events(self, events: BlockEvents | None) -> None:
        """Tells ``events`` of every block published and every lease granted from now."""
        with self._lock:
            self._events = events
            self._catalog.on_publish = events.stored if events is not None else None

    def watch_holdings(self, events: HoldingsEvents | None) -> list[tuple[BlockRecord, bytes]]:
        """Tells ``events`` of every block gained and lost from now on, and returns
        what the store holds at that moment: every block with its token ids (empty
        where its writer gave none), parents before their children. The two are
        taken under one lock, so nothing is missed or told twice."""
        with self._lock:
            self._catalog.holdings_events = events
            if events is None:
                return []
            held = _chain_order(self._catalog.blocks)
            # One read transaction of the tokens table; under the lock, so the
            # snapshot and the first event cannot cross (start-up and resyncs only).
            tokens = self._idx().tokens_of([r.key for r in held])
        return list(zip(held, tokens, strict=True))

    def set_hook(self, point: str, fn: Callable[[], None] | None) -> None:
        """Test seam: runs ``fn`` at a named point, outside the store lock.

        Points: ``commit.verified`` (a write's bytes were checked, not yet
        published), ``read.loaded`` (Get read the bytes, not yet verified),
        ``lease.granted`` (a lease was recorded, locations not yet returned).
        Concurrency tests put barriers here instead of sleeping.
        """
        if fn is None:
            self._hooks.pop(point, None)
        else:
            self._hooks[point] = fn

    def _hook(self, point: str) -> None:
        fn = self._hooks.get(point)
        if fn is not None:
            fn()

    # ------------------------------------------------------------------ lifecycle

    def open(self, start_reaper: bool = True) -> None:
        """Locks the data directory, opens files and index, reconciles them, starts
        the expiry thread.

        Raises:
            DataDirLockedError: another daemon or store holds the directory (before
                anything in it was opened or changed).
        """
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self._dir_lock.acquire()
        try:
            self._open_locked(start_reaper)
        except BaseException:
            self.close()
            raise

    def _open_locked(self, start_reaper: bool) -> None:
        data_dir = self.settings.data_dir
        had_data = (data_dir / "segments").exists() and any((data_dir / "segments").iterdir())
        # The index opens first and the segments leave it room to grow: LMDB maps
        # its lock file, so on a disk the segments had filled the daemon died of
        # SIGBUS at start, and with no room left every commit failed
        # (test_disk_full.py).
        self._index = BlockIndex(
            data_dir / "index", self.settings.lmdb_map_bytes, self.settings.durable
        )
        self._index.check_geometry(self.settings.segment_bytes)
        self.clear_stale_readers()
        usable = self._segments.open_all(reserve_bytes=_index_reserve(self.settings))
        self._catalog.alloc = ExtentAllocator(self.settings.segment_bytes, usable)
        self._reconcile()
        if had_data and self.settings.quarantine_s > 0:
            self._catalog.quarantine_until = self._clock.monotonic() + self.settings.quarantine_s
        self.metrics.watch_store(self.gauges)
        if start_reaper:
            jobs = [
                (self.settings.stats_flush_s, self.flush_stats),
                (self.settings.reader_check_s, self.clear_stale_readers),
            ]
            self._reaper = Reaper(self.expire, jobs, self._clock)
        log.info(
            "store open: %d blocks, %d/%d segments of %d bytes, policy %s",
            len(self._catalog.blocks),
            usable,
            self._segments.wanted,
            self.settings.segment_bytes,
            self.policy_name,
        )

    def _reconcile(self) -> None:
        full = self.settings.verify_on_start == "full"
        good, bad = reconcile(self._idx().load(), self._segments, self._catalog.alloc, full)
        if bad:
            self._idx().delete_many(bad)
            self.metrics.checksum_failures.labels(where="start").inc(len(bad))
            self.metrics.evictions.labels(reason="corrupt").inc(len(bad))
        self._catalog.load(good)

    def close(self) -> None:
        """Flushes access statistics and closes files; idempotent."""
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        with self._lock:
            if self._index is not None:
                self._flush_stats()
                self._index.close()
                self._index = None
            self._writes.close()
            self._segments.close()
            self._dir_lock.release()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def capacity_bytes(self) -> int:
        return self._catalog.capacity_bytes

    @property
    def max_stored_bytes(self) -> int:
        return self.settings.segment_bytes - HEADER_BYTES

    def _idx(self) -> BlockIndex:
        if self._index is None:
            raise RuntimeError("store is not open")
        return self._index

    def _now_ms(self) -> int:
        return int(self._clock.wall() * 1000)

    # ------------------------------------------------------------------ reads

    def lookup(self, tenant: str, keys: Sequence[bytes], block_tokens: int = 0) -> int:
        """Number of leading keys stored for ``tenant``. No side effects on state."""
        hits = self.stored_prefix(tenant, keys)
        self.metrics.count_lookup("lookup", hits, len(keys), block_tokens)
        return hits

    def descendants(
        self, tenant: str, key: bytes, max_blocks: int, first_tokens: Sequence[int] = ()
    ) -> tuple[list[Descendant], bool]:
        """``tenant``'s blocks under ``key`` with their token ids (``Descending``):
        breadth first, without blocks stored with no token ids or what is under
        them. No side effects on state."""
        tid = tenant_bytes(tenant)
        out: list[Descendant] = []
        firsts = {t.to_bytes(4, "little") for t in first_tokens}
        with self._lock:
            if self._catalog.owned(key, tid) is None:
                return out, False
            level = [key]
            while level:
                recs = [c for parent in level for c in self._catalog.children_of(parent, tid)]
                # One read transaction of the tokens table per level, under the lock
                # like the walk (a block removed in between would have none).
                tokens = self._idx().tokens_of([r.key for r in recs])
                level = []
                for rec, ids in zip(recs, tokens, strict=True):
                    if not ids or (firsts and rec.parent == key and ids[:4] not in firsts):
                        continue
                    if len(out) == max_blocks:
                        return out, True
                    out.append(Descendant(rec.key, rec.parent, ids))
                    level.append(rec.key)
        return out, False

    def stored_prefix(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Number of leading keys stored for ``tenant``: no side effects, not counted."""
        tid = tenant_bytes(tenant)
        with self._lock:
            for n, key in enumerate(keys):
                if self._catalog.owned(key, tid) is None:
                    return n
        return len(keys)

    def lease(
        self, tenant: str, keys: Sequence[bytes], ttl_s: float | None = None, block_tokens: int = 0
    ) -> LeaseGrant:
        """Pins the leading stored blocks (counted as hits) and returns their locations."""
        tid = tenant_bytes(tenant)
        ttl = self._ttl(ttl_s)
        lease_id = ""
        with self._lock:
            grants = self._leasable(tid, keys)
            if grants:
                extents = [(r.segment, r.offset) for r, _, _ in grants]
                lease_id = self._leases.grant(extents, self._clock.monotonic() + ttl)
                # Deepest first: parents end up fresher.
                self._catalog.hit([rec for rec, _, _ in reversed(grants)], self._now_ms())
        if grants:
            self._hook("lease.granted")
            events = self._events
            if events is not None:
                events.hit([rec for rec, _, _ in grants])
        self.metrics.count_lookup("lease", len(grants), len(keys), block_tokens)
        expires_ms = int((self._clock.wall() + ttl) * 1000) if grants else 0
        return LeaseGrant(lease_id, grants, expires_ms)

    def _leasable(self, tid: bytes, keys: Sequence[bytes]) -> list[tuple[BlockRecord, str, int]]:
        """Locations of the leading stored blocks inside their files (lock held)."""
        grants: list[tuple[BlockRecord, str, int]] = []
        sizes: dict[int, int] = {}
        for key in keys:
            rec = self._catalog.owned(key, tid)
            if rec is None:
                break
            if rec.segment not in sizes:
                sizes[rec.segment] = self._segments.file_size(rec.segment)
            if rec.offset + rec.extent_bytes > sizes[rec.segment]:
                self._catalog.drop_corrupt([rec], where="read")
                break
            name = self._segments.relative_name(rec.segment)
            grants.append((rec, name, rec.offset + HEADER_BYTES))
        return grants

    def extend(self, lease_id: str, ttl_s: float | None = None) -> int:
        """Extends a live lease; returns its new expiry (unix ms), 0 if it is gone."""
        ttl = self._ttl(ttl_s)
        with self._lock:
            if not self._leases.extend(lease_id, self._clock.monotonic() + ttl):
                return 0
        return int((self._clock.wall() + ttl) * 1000)

    def release(self, lease_id: str, corrupt_keys: Sequence[bytes] = ()) -> bool:
        """Ends a lease; re-verifies blocks the reader reported as corrupt."""
        with self._lock:
            suspects = [r for k in corrupt_keys if (r := self._catalog.blocks.get(k)) is not None]
            ended = self._leases.end(lease_id)
        bad = [rec for rec in suspects if not self._payload_ok(rec)]
        if bad:
            with self._lock:
                live = [r for r in bad if self._catalog.blocks.get(r.key) is r]
                self._catalog.drop_corrupt(live, where="read")
        return ended

    def read(self, tenant: str, key: bytes) -> tuple[BlockRecord, bytes] | None:
        """A verified copy of one block's stored bytes (for streaming Get), or a miss."""
        return self._read(tenant, key, count=True)

    def peek(self, tenant: str, key: bytes) -> tuple[BlockRecord, bytes] | None:
        """As ``read``, but neither an access (eviction order) nor counted in metrics:
        the shared tier's writer copies blocks out with it."""
        return self._read(tenant, key, count=False)

    def _read(self, tenant: str, key: bytes, count: bool) -> tuple[BlockRecord, bytes] | None:
        tid = tenant_bytes(tenant)
        with self._lock:
            rec = self._catalog.owned(key, tid)
            if rec is None:
                if count:
                    self.metrics.count_lookup("get", 0, 1, 0)
                return None
            ext = (rec.segment, rec.offset)
            self._leases.pin([ext])
        try:
            try:
                data = self._segments.pread(
                    rec.segment, rec.offset + HEADER_BYTES, rec.stored_bytes
                )
            except ValueError:
                data = b""
            self._hook("read.loaded")
            ok = len(data) == rec.stored_bytes and checksum(data) == rec.checksum
        finally:
            with self._lock:
                self._leases.unpin([ext])
        with self._lock:
            if not ok:
                if self._catalog.blocks.get(key) is rec:
                    self._catalog.drop_corrupt([rec], where="read")
                if count:
                    self.metrics.count_lookup("get", 0, 1, 0)
                return None
            if count and key in self._catalog.blocks:
                self._catalog.hit([rec], self._now_ms())
        if count:
            self.metrics.count_lookup("get", 1, 1, 0)
        return rec, data

    def _payload_ok(self, rec: BlockRecord) -> bool:
        try:
            data = self._segments.pread(rec.segment, rec.offset + HEADER_BYTES, rec.stored_bytes)
        except (OSError, ValueError):
            return False
        return checksum(data) == rec.checksum

    def _ttl(self, ttl_s: float | None) -> float:
        if not ttl_s or ttl_s <= 0:
            return self.settings.lease_ttl_s
        return min(ttl_s, self.settings.max_lease_ttl_s)

    # ------------------------------------------------------------------ writes

    def allocate(
        self, tenant: str, specs: Sequence[BlockSpec], ttl_s: float | None = None
    ) -> list[SlotGrant]:
        """Reserves space for the leading blocks that fit (see :class:`Writes`)."""
        return self._writes.allocate(tenant, specs, ttl_s)

    def commit(self, writes: Sequence[tuple[str, int | None]]) -> list[CommitResult]:
        """Verifies, makes durable and publishes reserved blocks."""
        return self._writes.commit(writes)

    def abort(self, write_ids: Iterable[str]) -> int:
        """Drops reservations; their space is free again at once."""
        return self._writes.abort(write_ids)

    def put(self, tenant: str, spec: BlockSpec, data: bytes, client_sum: int) -> tuple[bool, bool]:
        """Stores one block from bytes received over the wire: (stored, existed)."""
        return self._writes.put(tenant, spec, data, client_sum)

    # ------------------------------------------------------------------ signals

    def signal(self, tenant: str, keys: Sequence[bytes], kind: str, ttl_s: float) -> int:
        """Passes a serving-path signal on ``tenant``'s stored chain to the policy
        (``Signalling``); returns blocks marked, 0 for a policy without signals."""
        tid = tenant_bytes(tenant)
        with self._lock:
            return self._catalog.signal(keys, tid, kind, ttl_s)

    # ------------------------------------------------------------------ removal

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Removes blocks of ``tenant`` (and their descendants)."""
        tid = tenant_bytes(tenant)
        with self._lock:
            victims = [r for k in keys if (r := self._catalog.owned(k, tid)) is not None]
            return self._catalog.discard(victims, "delete")

    def clear_tenant(self, tenant: str) -> int:
        """Removes every block of ``tenant``."""
        tid = tenant_bytes(tenant)
        with self._lock:
            victims = [rec for rec in self._catalog.blocks.values() if rec.tenant == tid]
            return self._catalog.discard(victims, "tenant_clear")

    # ------------------------------------------------------------------ upkeep

    def expire(self) -> tuple[int, int]:
        """Ends expired leases and reservations: (leases, reservations)."""
        now = self._clock.monotonic()
        with self._lock:
            return self._leases.expire(now), self._writes.reservations.expire(now)

    def _flush_stats(self) -> None:
        dirty = self._catalog.dirty_stats
        if not dirty or self._index is None:
            return
        blocks = self._catalog.blocks
        rows = [(k, blocks[k].last_access_ms, blocks[k].hits) for k in dirty if k in blocks]
        dirty.clear()
        self._index.write_stats(rows)

    def clear_stale_readers(self) -> int:
        """Frees the index's reader slots of reader processes that are gone (a model
        server killed while it held one): each would otherwise keep a slot of the
        lock file's table for good, and one killed inside a read transaction would
        pin the pages it saw, so the index would only grow. Returns how many."""
        index = self._index
        if index is None:
            return 0
        cleared = index.clear_stale_readers()
        if cleared:
            self.metrics.stale_readers.inc(cleared)
            log.info("cleared %d reader slots of processes that are gone", cleared)
        return cleared

    def flush_stats(self) -> None:
        """Writes pending access statistics to the index."""
        with self._lock:
            self._flush_stats()

    # ------------------------------------------------------------------ reporting

    def gauges(self) -> StoreGauges:
        """Totals for the metrics collector and Stats."""
        with self._lock:
            catalog = self._catalog
            cap = catalog.capacity_bytes
            return StoreGauges(
                blocks=len(catalog.blocks),
                used_bytes=cap - catalog.alloc.free_bytes,
                capacity_bytes=cap,
                free_bytes=catalog.alloc.free_bytes,
                segments=catalog.alloc.segments,
                active_leases=len(self._leases),
                pending_writes=len(self._writes.reservations),
                stored_raw_bytes=catalog.stored_raw,
                stored_payload_bytes=catalog.stored_payload,
                tenants=catalog.usage.tenants,
            )

    def change_id(self) -> int:
        """The index's last write transaction (``Listing``): equal means unchanged."""
        return self._idx().last_change()

    def scan_keys(self) -> AbstractContextManager[tuple[int, Iterator[bytes]]]:
        """Every key in the index, read without the store lock (``Listing``)."""
        return self._idx().scan_keys()

    def keys(self) -> list[bytes]:
        """Every stored key (for tests and tools)."""
        with self._lock:
            return list(self._catalog.blocks)

    def record(self, key: bytes) -> BlockRecord | None:
        """The record of a stored key (for tests and tools)."""
        with self._lock:
            return self._catalog.blocks.get(key)
