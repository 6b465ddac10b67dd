"""The KV block store: segments + LMDB index + eviction, safe under concurrency.

Contract:
    * ``lookup`` has no side effects; ``lease`` pins blocks and counts as an access.
    * A block is visible only after its payload is on disk (fsync'd when
      ``durable``), its checksum computed from the bytes on disk, its header written,
      and its index record committed, in that order.
    * A block whose bytes or header do not verify is never returned: it becomes a
      miss, is removed from the index and counted.
    * A leased extent is never reused: eviction removes the block from the index at
      once, but its space is freed only when the last lease on it ends.
    * After a restart, space is not reused for ``restart_quarantine_s``: readers of
      the previous process may still map it.
    * Evicting a block also evicts its cached descendants (they can never hit
      without it); hits touch the chain deepest-first so parents stay fresher.
    * A store that cannot make room raises ``StoreFullError``; reads go on.

Thread safety: every public method may be called from any thread. State changes
happen under one lock; hashing of payloads happens outside it.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import lmdb

from dscache_sidecar.codec import DTYPE_CODES, DTYPE_NAMES, NUMPY_DTYPES, Codec
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.eviction import DEFAULT_POLICY, EvictionPolicy, Resizable, make_policy
from dscache_sidecar.index import BlockIndex, BlockRecord
from dscache_sidecar.metrics import SidecarMetrics, StoreGauges
from dscache_sidecar.segments import (
    HEADER_BYTES,
    BlockHeader,
    ExtentAllocator,
    SegmentFiles,
    StoreFullError,
    checksum,
    extent_bytes,
)

log = logging.getLogger(__name__)

KEY_BYTES = 32
_HEX_TENANT = re.compile(r"^[0-9a-f]{32}$")

__all__ = [
    "BlockSpec",
    "CommitResult",
    "KVStore",
    "LeaseGrant",
    "SlotGrant",
    "StoreFullError",
    "tenant_bytes",
]


def _index_reserve(settings: SidecarSettings) -> int:
    """Free disk space segment preallocation leaves for the index to grow into:
    about 1 KiB per 4 KiB-extent block at most, at least 256 KiB, at most 64 MiB."""
    return min(64 * 1024**2, max(256 * 1024, settings.capacity_bytes // 64))


def tenant_bytes(tenant: str) -> bytes:
    """The 16-byte tenant id stored per block.

    A contract tenant label (32 hex chars) maps to its bytes; any other string is
    hashed, so every tenant string maps to one stable id.
    """
    if _HEX_TENANT.match(tenant):
        return bytes.fromhex(tenant)
    return hashlib.sha256(b"dscache/tenant-id/v1\x00" + tenant.encode()).digest()[:16]


class CommitResult(IntEnum):
    """Same numbers as ``dscache.v1.CommitResult``."""

    OK = 0
    CHECKSUM_MISMATCH = 1
    EXPIRED = 2
    DUPLICATE = 3


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

    def validate(self, max_stored: int) -> None:
        """ValueError with a message a client author can act on."""
        if len(self.key) != KEY_BYTES:
            raise ValueError("key must be 32 bytes")
        if self.parent and len(self.parent) != KEY_BYTES:
            raise ValueError("parent must be empty or 32 bytes")
        if self.parent == self.key:
            raise ValueError("a block cannot be its own parent")
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.codec not in (Codec.RAW, Codec.ZSTD_SHUFFLE):
            raise ValueError(f"unknown codec {self.codec}")
        if not 1 <= len(self.shape) <= 6 or any(d <= 0 for d in self.shape):
            raise ValueError("shape needs 1 to 6 positive dimensions")
        n = 1
        for d in self.shape:
            n *= d
        if n * NUMPY_DTYPES[self.dtype].itemsize != self.raw_bytes:
            raise ValueError("raw_bytes does not equal prod(shape) * itemsize")
        if self.codec == Codec.RAW and self.stored_bytes != self.raw_bytes:
            raise ValueError("a raw block stores exactly raw_bytes")
        if not 0 < self.stored_bytes <= max_stored:
            raise ValueError(f"stored_bytes must be in (0, {max_stored}]")


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


@dataclass(slots=True)
class _Reservation:
    write_id: str
    tenant: bytes
    spec: BlockSpec
    segment: int
    offset: int  # extent start
    extent: int
    expires: float
    committing: bool = False


@dataclass(slots=True)
class _Lease:
    lease_id: str
    extents: list[tuple[int, int]]
    expires: float


@dataclass
class _Counters:
    evicted: int = 0
    checksum_failures: int = 0
    reconcile_dropped: int = 0


@dataclass
class _Verified:
    reservation: _Reservation
    result: CommitResult
    checksum: int = 0
    records: list[BlockRecord] = field(default_factory=list)


class KVStore:
    """The node-local block store. Build with ``KVStore(settings)``, then ``open()``."""

    def __init__(
        self,
        settings: SidecarSettings,
        metrics: SidecarMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._clock = clock
        self._lock = threading.RLock()
        self._blocks: dict[bytes, BlockRecord] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._pins: dict[tuple[int, int], int] = {}
        self._deferred: dict[tuple[int, int], int] = {}
        self._leases: dict[str, _Lease] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._dirty_stats: set[bytes] = set()
        self._counters = _Counters()
        self._stored_raw = 0
        self._stored_payload = 0
        self._quarantine_until = 0.0
        self._maps: dict[int, mmap.mmap] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        policy_name = settings.policy or DEFAULT_POLICY
        seg_count = max(1, settings.capacity_bytes // settings.segment_bytes)
        self._hint = max(16, settings.capacity_bytes // (1024 * 1024))
        self._policy: EvictionPolicy[Any] = make_policy(policy_name, self._hint)
        self.policy_name = policy_name
        self._segments = SegmentFiles(
            settings.data_dir / "segments", settings.segment_bytes, seg_count, settings.segment_init
        )
        self._index: BlockIndex | None = None
        self._alloc = ExtentAllocator(settings.segment_bytes, 0)
        self._hooks: dict[str, Callable[[], None]] = {}

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
        """Opens files and index, reconciles them, starts the expiry thread."""
        data_dir = self.settings.data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        had_data = (data_dir / "segments").exists() and any((data_dir / "segments").iterdir())
        # The index opens first and the segments leave it room to grow: LMDB maps
        # its lock file, so on a disk the segments had filled the daemon died of
        # SIGBUS at start, and with no room left every commit failed
        # (test_disk_full.py).
        self._index = BlockIndex(
            data_dir / "index", self.settings.lmdb_map_bytes, self.settings.durable
        )
        self._index.check_geometry(self.settings.segment_bytes)
        usable = self._segments.open_all(reserve_bytes=_index_reserve(self.settings))
        self._alloc = ExtentAllocator(self.settings.segment_bytes, usable)
        self._reconcile()
        if had_data and self.settings.quarantine_s > 0:
            self._quarantine_until = self._clock() + self.settings.quarantine_s
        self.metrics.watch_store(self.gauges)
        if start_reaper:
            self._reaper = threading.Thread(target=self._reap_loop, name="kv-reaper", daemon=True)
            self._reaper.start()
        log.info(
            "store open: %d blocks, %d/%d segments of %d bytes, policy %s",
            len(self._blocks),
            usable,
            self._segments.wanted,
            self.settings.segment_bytes,
            self.policy_name,
        )

    def close(self) -> None:
        """Flushes access statistics and closes files; idempotent."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
            self._reaper = None
        with self._lock:
            if self._index is not None:
                self._flush_stats()
                self._index.close()
                self._index = None
            for m in self._maps.values():
                m.close()
            self._maps.clear()
            self._segments.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.segments * self.settings.segment_bytes

    @property
    def max_stored_bytes(self) -> int:
        return self.settings.segment_bytes - HEADER_BYTES

    def _idx(self) -> BlockIndex:
        if self._index is None:
            raise RuntimeError("store is not open")
        return self._index

    # ------------------------------------------------------------------ reconcile

    def _reconcile(self) -> None:
        full = self.settings.verify_on_start == "full"
        good: list[BlockRecord] = []
        bad: list[BlockRecord] = []
        for rec in self._idx().load():
            reason = self._check_record(rec, full)
            if reason is None and not self._alloc.mark_used(
                rec.segment, rec.offset, rec.extent_bytes
            ):
                reason = "overlaps another block"
            if reason is None:
                good.append(rec)
            else:
                log.warning("dropping block %s at start: %s", rec.key.hex()[:16], reason)
                bad.append(rec)
        if bad:
            self._idx().delete_many(bad)
            self._counters.reconcile_dropped += len(bad)
            self._counters.checksum_failures += len(bad)
            self.metrics.checksum_failures.labels(where="start").inc(len(bad))
            self.metrics.evictions.labels(reason="corrupt").inc(len(bad))
        # Oldest access first, so recency order survives the restart.
        good.sort(key=lambda r: (r.last_access_ms, r.created_ms))
        for rec in good:
            self._blocks[rec.key] = rec
            self._stored_raw += rec.raw_bytes
            self._stored_payload += rec.stored_bytes
        for rec in good:
            if rec.parent and rec.parent in self._blocks:
                self._children.setdefault(rec.parent, set()).add(rec.key)
            self._policy.admit(rec.key, rec.extent_bytes)
            if rec.hits:
                self._policy.access(rec.key)

    def _check_record(self, rec: BlockRecord, full: bool) -> str | None:
        if rec.segment >= self._segments.count:
            return "segment file missing"
        if rec.offset + rec.extent_bytes > self._segments.file_size(rec.segment):
            return "segment truncated"
        try:
            hdr = BlockHeader.unpack(self._segments.pread(rec.segment, rec.offset, HEADER_BYTES))
        except ValueError as exc:
            return f"bad header ({exc})"
        if (
            hdr.key != rec.key
            or hdr.stored_bytes != rec.stored_bytes
            or hdr.checksum != rec.checksum
            or hdr.codec != rec.codec
        ):
            return "header does not match the index"
        if full:
            payload = self._segments.pread(rec.segment, rec.offset + HEADER_BYTES, rec.stored_bytes)
            if checksum(payload) != rec.checksum:
                return "payload checksum mismatch"
        return None

    # ------------------------------------------------------------------ reads

    def lookup(self, tenant: str, keys: Sequence[bytes], block_tokens: int = 0) -> int:
        """Number of leading keys stored for ``tenant``. No side effects on state."""
        tid = tenant_bytes(tenant)
        hits = 0
        with self._lock:
            for key in keys:
                rec = self._blocks.get(key)
                if rec is None or rec.tenant != tid:
                    break
                hits += 1
        self._count_lookup("lookup", hits, len(keys), block_tokens)
        return hits

    def lease(
        self,
        tenant: str,
        keys: Sequence[bytes],
        ttl_s: float | None = None,
        block_tokens: int = 0,
    ) -> LeaseGrant:
        """Pins the leading stored blocks and returns their locations."""
        tid = tenant_bytes(tenant)
        ttl = self._ttl(ttl_s)
        now = self._clock()
        grants: list[tuple[BlockRecord, str, int]] = []
        with self._lock:
            sizes: dict[int, int] = {}
            for key in keys:
                rec = self._blocks.get(key)
                if rec is None or rec.tenant != tid:
                    break
                if rec.segment not in sizes:
                    sizes[rec.segment] = self._segments.file_size(rec.segment)
                if rec.offset + rec.extent_bytes > sizes[rec.segment]:
                    self._drop_corrupt([rec], where="read")
                    break
                grants.append(
                    (rec, self._segments.relative_name(rec.segment), rec.offset + HEADER_BYTES)
                )
            lease_id = ""
            if grants:
                lease_id = secrets.token_hex(12)
                extents = [(r.segment, r.offset) for r, _, _ in grants]
                for ext in extents:
                    self._pins[ext] = self._pins.get(ext, 0) + 1
                self._leases[lease_id] = _Lease(lease_id, extents, now + ttl)
                now_ms = int(time.time() * 1000)
                for rec, _, _ in reversed(grants):  # deepest first: parents end up fresher
                    self._policy.access(rec.key)
                    rec.last_access_ms = now_ms
                    rec.hits += 1
                    self._dirty_stats.add(rec.key)
        if grants:
            self._hook("lease.granted")
        self._count_lookup("lease", len(grants), len(keys), block_tokens)
        expires_ms = int((time.time() + ttl) * 1000) if grants else 0
        return LeaseGrant(lease_id, grants, expires_ms)

    def extend(self, lease_id: str, ttl_s: float | None = None) -> int:
        """Extends a live lease; returns its new expiry (unix ms), 0 if it is gone."""
        ttl = self._ttl(ttl_s)
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return 0
            lease.expires = self._clock() + ttl
        return int((time.time() + ttl) * 1000)

    def release(self, lease_id: str, corrupt_keys: Sequence[bytes] = ()) -> bool:
        """Ends a lease; re-verifies blocks the reader reported as corrupt."""
        suspects: list[BlockRecord] = []
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            for key in corrupt_keys:
                rec = self._blocks.get(key)
                if rec is not None:
                    suspects.append(rec)
            if lease is not None:
                self._unpin(lease.extents)
        bad = [rec for rec in suspects if not self._payload_ok(rec)]
        if bad:
            with self._lock:
                self._drop_corrupt([r for r in bad if self._blocks.get(r.key) is r], where="read")
        return lease is not None

    def read(self, tenant: str, key: bytes) -> tuple[BlockRecord, bytes] | None:
        """A verified copy of one block's stored bytes (for streaming Get), or a miss."""
        tid = tenant_bytes(tenant)
        with self._lock:
            rec = self._blocks.get(key)
            if rec is None or rec.tenant != tid:
                self._count_lookup("get", 0, 1, 0)
                return None
            ext = (rec.segment, rec.offset)
            self._pins[ext] = self._pins.get(ext, 0) + 1
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
                self._unpin([ext])
        with self._lock:
            if not ok:
                if self._blocks.get(key) is rec:
                    self._drop_corrupt([rec], where="read")
                self._count_lookup("get", 0, 1, 0)
                return None
            if key in self._blocks:
                self._policy.access(key)
                rec.last_access_ms = int(time.time() * 1000)
                rec.hits += 1
                self._dirty_stats.add(key)
        self._count_lookup("get", 1, 1, 0)
        return rec, data

    # ------------------------------------------------------------------ writes

    def allocate(
        self, tenant: str, specs: Sequence[BlockSpec], ttl_s: float | None = None
    ) -> list[SlotGrant]:
        """Reserves space for the leading blocks that fit.

        Raises:
            ValueError: a spec is malformed.
            StoreFullError: not even the first new block fits.
        """
        for spec in specs:
            spec.validate(self.max_stored_bytes)
        tid = tenant_bytes(tenant)
        ttl = self.settings.reservation_ttl_s if not ttl_s else min(ttl_s, 600.0)
        grants: list[SlotGrant] = []
        removed: list[BlockRecord] = []
        with self._lock:
            try:
                for spec in specs:
                    if spec.key in self._blocks:
                        grants.append(SlotGrant(spec.key, "", "", 0, True))
                        continue
                    size = extent_bytes(spec.stored_bytes)
                    try:
                        seg, off = self._make_room(size, removed)
                    except StoreFullError:
                        if not any(not g.exists for g in grants):
                            raise
                        break
                    write_id = secrets.token_hex(12)
                    self._reservations[write_id] = _Reservation(
                        write_id, tid, spec, seg, off, size, self._clock() + ttl
                    )
                    grants.append(
                        SlotGrant(
                            spec.key,
                            write_id,
                            self._segments.relative_name(seg),
                            off + HEADER_BYTES,
                            False,
                        )
                    )
            finally:
                if removed:
                    self._delete_records(removed)
        return grants

    def commit(self, writes: Sequence[tuple[str, int | None]]) -> list[CommitResult]:
        """Verifies, makes durable and publishes reserved blocks.

        Args:
            writes: (write id, client checksum or None) pairs.
        """
        claimed: list[_Reservation | None] = []
        with self._lock:
            for write_id, _ in writes:
                res = self._reservations.get(write_id)
                if res is None or res.committing:
                    claimed.append(None)
                else:
                    res.committing = True
                    claimed.append(res)
        verified: list[_Verified | None] = []
        synced: set[int] = set()
        for (_, client_sum), res in zip(writes, claimed, strict=True):
            if res is None:
                verified.append(None)
                continue
            verified.append(self._verify_written(res, client_sum))
            synced.add(res.segment)
        if self.settings.durable:
            for seg in synced:
                self._segments.sync(seg)
        self._hook("commit.verified")
        results: list[CommitResult] = []
        publish: list[BlockRecord] = []
        with self._lock:
            for v in verified:
                if v is None:
                    results.append(CommitResult.EXPIRED)
                    continue
                res = v.reservation
                self._reservations.pop(res.write_id, None)
                result = v.result
                if result is CommitResult.OK and (
                    res.spec.key in self._blocks or any(r.key == res.spec.key for r in publish)
                ):
                    result = CommitResult.DUPLICATE
                if result is not CommitResult.OK:
                    self._alloc.free(res.segment, res.offset, res.extent)
                    if result is CommitResult.CHECKSUM_MISMATCH:
                        self.metrics.checksum_failures.labels(where="commit").inc()
                        self._counters.checksum_failures += 1
                    results.append(result)
                    continue
                publish.append(self._record_for(res, v.checksum))
                results.append(CommitResult.OK)
            if publish:
                try:
                    self._idx().put_many(publish)
                except lmdb.Error as exc:
                    # Disk (or map) full: nothing was published; give the space back.
                    for rec in publish:
                        self._alloc.free(rec.segment, rec.offset, rec.extent_bytes)
                    self.metrics.write_rejections.labels(reason="index_full").inc()
                    raise StoreFullError(f"cannot grow the index: {exc}") from exc
                # Deepest first, then the stored ancestors: parents stay fresher
                # than their children, so eviction takes children first.
                for rec in reversed(publish):
                    self._publish(rec)
                self._touch_ancestors(publish)
        return results

    def abort(self, write_ids: Iterable[str]) -> int:
        """Drops reservations; their space is free again at once."""
        n = 0
        with self._lock:
            for write_id in write_ids:
                res = self._reservations.get(write_id)
                if res is not None and not res.committing:
                    del self._reservations[write_id]
                    self._alloc.free(res.segment, res.offset, res.extent)
                    n += 1
        return n

    def put(self, tenant: str, spec: BlockSpec, data: bytes, client_sum: int) -> tuple[bool, bool]:
        """Stores one block from bytes received over the wire: (stored, existed)."""
        if len(data) != spec.stored_bytes:
            raise ValueError("received bytes do not match stored_bytes")
        if checksum(data) != client_sum:
            raise ValueError("received bytes do not match the checksum")
        grants = self.allocate(tenant, [spec])
        grant = grants[0]
        if grant.exists:
            return False, True
        with self._lock:
            res = self._reservations[grant.write_id]
        try:
            self._segments.pwrite(res.segment, res.offset + HEADER_BYTES, data)
        except OSError:
            self.abort([grant.write_id])
            raise
        result = self.commit([(grant.write_id, client_sum)])[0]
        return result is CommitResult.OK, result is CommitResult.DUPLICATE

    def _verify_written(self, res: _Reservation, client_sum: int | None) -> _Verified:
        seg, off = res.segment, res.offset + HEADER_BYTES
        if client_sum is not None and not self.settings.verify_commits:
            # The writer hashed the bytes it wrote; every reader verifies against it.
            return self._write_header(res, client_sum)
        try:
            view = self._map(seg)
            actual = checksum(memoryview(view)[off : off + res.spec.stored_bytes])
        except (OSError, ValueError) as exc:
            log.warning("commit of %s failed to read back: %s", res.spec.key.hex()[:16], exc)
            return _Verified(res, CommitResult.CHECKSUM_MISMATCH)
        if client_sum is not None and actual != client_sum:
            return _Verified(res, CommitResult.CHECKSUM_MISMATCH)
        return self._write_header(res, actual)

    def _write_header(self, res: _Reservation, actual: int) -> _Verified:
        header = BlockHeader(
            codec=res.spec.codec,
            dtype_code=DTYPE_CODES[res.spec.dtype],
            shape=res.spec.shape,
            stored_bytes=res.spec.stored_bytes,
            raw_bytes=res.spec.raw_bytes,
            checksum=actual,
            key=res.spec.key,
            tenant=res.tenant,
            created_ms=int(time.time() * 1000),
        )
        self._segments.pwrite(res.segment, res.offset, header.pack())
        return _Verified(res, CommitResult.OK, actual)

    def _map(self, seg: int) -> mmap.mmap:
        m = self._maps.get(seg)
        if m is None:
            with self._lock:
                m = self._maps.get(seg)
                if m is None:
                    m = mmap.mmap(
                        self._segments.fd(seg),
                        self.settings.segment_bytes,
                        prot=mmap.PROT_READ,
                        flags=mmap.MAP_SHARED,
                    )
                    self._maps[seg] = m
        size = self._segments.file_size(seg)
        if size < self.settings.segment_bytes:
            raise ValueError("segment truncated")
        return m

    def _record_for(self, res: _Reservation, csum: int) -> BlockRecord:
        now_ms = int(time.time() * 1000)
        return BlockRecord(
            key=res.spec.key,
            segment=res.segment,
            offset=res.offset,
            extent_bytes=res.extent,
            stored_bytes=res.spec.stored_bytes,
            raw_bytes=res.spec.raw_bytes,
            checksum=csum,
            codec=res.spec.codec,
            dtype_code=DTYPE_CODES[res.spec.dtype],
            shape=res.spec.shape,
            tenant=res.tenant,
            parent=res.spec.parent,
            created_ms=now_ms,
            last_access_ms=now_ms,
        )

    def _touch_ancestors(self, published: Sequence[BlockRecord]) -> None:
        new = {r.key for r in published}
        seen: set[bytes] = set()
        for rec in published:
            parent = rec.parent
            while parent and parent not in new and parent not in seen:
                seen.add(parent)
                if parent not in self._blocks:
                    break
                self._policy.access(parent)
                parent = self._blocks[parent].parent

    def _publish(self, rec: BlockRecord) -> None:
        self._blocks[rec.key] = rec
        if rec.parent:
            self._children.setdefault(rec.parent, set()).add(rec.key)
        self._policy.admit(rec.key, rec.extent_bytes)
        self._stored_raw += rec.raw_bytes
        self._stored_payload += rec.stored_bytes
        self.metrics.stored_blocks.inc()
        self.metrics.stored_bytes.inc(rec.stored_bytes)

    # ------------------------------------------------------------------ removal

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Removes blocks of ``tenant`` (and their descendants)."""
        tid = tenant_bytes(tenant)
        with self._lock:
            victims = [
                self._blocks[k] for k in keys if k in self._blocks and self._blocks[k].tenant == tid
            ]
            removed = self._remove_tree(victims, "delete")
            self._delete_records(removed)
        return len(removed)

    def clear_tenant(self, tenant: str) -> int:
        """Removes every block of ``tenant``."""
        tid = tenant_bytes(tenant)
        with self._lock:
            victims = [rec for rec in self._blocks.values() if rec.tenant == tid]
            removed = self._remove_tree(victims, "tenant_clear")
            self._delete_records(removed)
        return len(removed)

    def _drop_corrupt(self, recs: Sequence[BlockRecord], where: str) -> None:
        if not recs:
            return
        for rec in recs:
            log.warning("block %s failed verification (%s): dropped", rec.key.hex()[:16], where)
        # A truncated segment (someone cut the file) loses every block past its new
        # end; they go now, and the file is extended again. Without this, the space
        # stayed in the allocator, new blocks were published there and then dropped
        # at every read, for good (test_corruption.py).
        truncated = {
            r.segment
            for r in recs
            if self._segments.file_size(r.segment) < self.settings.segment_bytes
        }
        if truncated:
            sizes = {seg: self._segments.file_size(seg) for seg in truncated}
            seen = {r.key for r in recs}
            recs = list(recs) + [
                r
                for r in self._blocks.values()
                if r.segment in sizes
                and r.offset + r.extent_bytes > sizes[r.segment]
                and r.key not in seen
            ]
        self.metrics.checksum_failures.labels(where=where).inc(len(recs))
        self._counters.checksum_failures += len(recs)
        removed = self._remove_tree(list(recs), "corrupt")
        self._delete_records(removed)
        for seg in truncated:
            log.error("segment %d was truncated: its lost blocks were dropped", seg)
            try:
                os.posix_fallocate(self._segments.fd(seg), 0, self.settings.segment_bytes)
            except OSError as exc:
                log.error("could not extend truncated segment %d again: %s", seg, exc)

    def _remove_tree(self, roots: Sequence[BlockRecord], reason: str) -> list[BlockRecord]:
        """Removes blocks and their cached descendants from memory and the policy.

        Returns the removed records; the caller deletes them from the index.
        """
        removed: list[BlockRecord] = []
        stack = [r.key for r in roots]
        while stack:
            key = stack.pop()
            rec = self._blocks.pop(key, None)
            if rec is None:
                continue
            removed.append(rec)
            self._policy.remove(key)
            self._dirty_stats.discard(key)
            stack.extend(self._children.pop(key, ()))
            if rec.parent:
                siblings = self._children.get(rec.parent)
                if siblings is not None:
                    siblings.discard(key)
                    if not siblings:
                        del self._children[rec.parent]
            self._stored_raw -= rec.raw_bytes
            self._stored_payload -= rec.stored_bytes
            ext = (rec.segment, rec.offset)
            if self._pins.get(ext):
                self._deferred[ext] = rec.extent_bytes
            else:
                self._alloc.free(rec.segment, rec.offset, rec.extent_bytes)
        if removed:
            first = {r.key for r in roots}
            n_cascade = sum(1 for r in removed if r.key not in first)
            self.metrics.evictions.labels(reason=reason).inc(len(removed) - n_cascade)
            if n_cascade:
                self.metrics.evictions.labels(reason="cascade").inc(n_cascade)
            self._counters.evicted += len(removed)
        return removed

    def _delete_records(self, removed: list[BlockRecord]) -> None:
        """Drops records from the index. On a full disk the records stay behind;
        reconciliation discards them at the next start (their extents may have
        been reused, so their headers no longer match), so this never fails."""
        try:
            self._idx().delete_many(removed)
        except lmdb.Error as exc:
            log.error("could not delete %d index records (disk full?): %s", len(removed), exc)

    def _make_room(self, size: int, removed: list[BlockRecord]) -> tuple[int, int]:
        """An extent of ``size`` bytes, evicting by policy as needed (lock held)."""
        if size > self.settings.segment_bytes:
            self.metrics.write_rejections.labels(reason="too_large").inc()
            raise StoreFullError("block larger than a segment")
        if self._clock() < self._quarantine_until:
            self.metrics.write_rejections.labels(reason="quarantine").inc()
            raise StoreFullError(
                "space is quarantined after a restart (readers of the previous process "
                "may still map it); writes resume in "
                f"{self._quarantine_until - self._clock():.0f}s"
            )
        cap = self.capacity_bytes
        if cap == 0:
            self.metrics.write_rejections.labels(reason="disk_full").inc()
            raise StoreFullError("no segment space (disk full at start)")
        used = cap - self._alloc.free_bytes
        # Leased blocks are skipped by eviction and go back to the policy afterwards:
        # evicting one frees nothing until its lease ends, so a single write near
        # the watermark used to drop every leased (in use, hottest) block from the
        # index, and a failed write emptied it (test_concurrency.py, test_disk_full.py).
        leased: list[BlockRecord] = []
        try:
            if used + size > self.settings.high_watermark * cap:
                self._resize_policy(cap, size)
                target = self.settings.low_watermark * cap - size
                while cap - self._alloc.free_bytes > target:
                    if not self._evict_one(removed, leased):
                        break
            ext = self._alloc.allocate(size)
            while ext is None:
                if not self._evict_one(removed, leased):
                    self.metrics.write_rejections.labels(reason="full").inc()
                    raise StoreFullError("store is full of leased or reserved blocks")
                ext = self._alloc.allocate(size)
        finally:
            for rec in leased:
                if self._blocks.get(rec.key) is rec:
                    self._policy.admit(rec.key, rec.extent_bytes)
        return ext

    def _resize_policy(self, cap: int, size: int) -> None:
        """Tells a resizable policy how many blocks of the current size fit."""
        if not isinstance(self._policy, Resizable):
            return
        live = len(self._blocks)
        mean = ((cap - self._alloc.free_bytes) / live) if live else float(size)
        estimate = max(16, int(cap / max(mean, 1.0)))
        if not 0.8 * self._hint <= estimate <= 1.25 * self._hint:
            self._hint = estimate
            self._policy.resize(estimate)

    def _evict_one(self, removed: list[BlockRecord], leased: list[BlockRecord]) -> bool:
        while True:
            victim = self._policy.victim()
            if victim is None:
                return False
            rec = self._blocks.get(victim)
            if rec is None:
                return True
            if self._pins.get((rec.segment, rec.offset)):
                leased.append(rec)
                continue
            removed.extend(self._remove_tree([rec], "capacity"))
            return True

    def _unpin(self, extents: Iterable[tuple[int, int]]) -> None:
        for ext in extents:
            n = self._pins.get(ext, 0) - 1
            if n > 0:
                self._pins[ext] = n
                continue
            self._pins.pop(ext, None)
            length = self._deferred.pop(ext, None)
            if length is not None:
                self._alloc.free(ext[0], ext[1], length)

    def _payload_ok(self, rec: BlockRecord) -> bool:
        try:
            data = self._segments.pread(rec.segment, rec.offset + HEADER_BYTES, rec.stored_bytes)
        except (OSError, ValueError):
            return False
        return checksum(data) == rec.checksum

    # ------------------------------------------------------------------ upkeep

    def expire(self) -> tuple[int, int]:
        """Ends expired leases and reservations: (leases, reservations)."""
        now = self._clock()
        with self._lock:
            dead_leases = [lid for lid, lease in self._leases.items() if lease.expires <= now]
            for lid in dead_leases:
                self._unpin(self._leases.pop(lid).extents)
            dead_res = [
                wid
                for wid, res in self._reservations.items()
                if res.expires <= now and not res.committing
            ]
            for wid in dead_res:
                res = self._reservations.pop(wid)
                self._alloc.free(res.segment, res.offset, res.extent)
        return len(dead_leases), len(dead_res)

    def _flush_stats(self) -> None:
        if not self._dirty_stats or self._index is None:
            return
        rows = [
            (k, self._blocks[k].last_access_ms, self._blocks[k].hits)
            for k in self._dirty_stats
            if k in self._blocks
        ]
        self._dirty_stats.clear()
        self._index.write_stats(rows)

    def flush_stats(self) -> None:
        """Writes pending access statistics to the index."""
        with self._lock:
            self._flush_stats()

    def _reap_loop(self) -> None:
        last_flush = self._clock()
        while not self._stop.wait(0.5):
            try:
                self.expire()
                if self._clock() - last_flush >= self.settings.stats_flush_s:
                    self.flush_stats()
                    last_flush = self._clock()
            except Exception:  # the reaper must outlive any one failure
                log.exception("store upkeep failed")

    def _ttl(self, ttl_s: float | None) -> float:
        if not ttl_s or ttl_s <= 0:
            return self.settings.lease_ttl_s
        return min(ttl_s, self.settings.max_lease_ttl_s)

    def _count_lookup(self, op: str, hits: int, asked: int, block_tokens: int) -> None:
        m = self.metrics
        if asked == 0:
            return
        result = "hit" if hits == asked else ("partial" if hits else "miss")
        m.lookups.labels(op=op, result=result).inc()
        if hits:
            m.lookup_blocks.labels(op=op, result="hit").inc(hits)
        if asked - hits:
            m.lookup_blocks.labels(op=op, result="miss").inc(asked - hits)
        if block_tokens:
            if hits:
                m.lookup_tokens.labels(op=op, result="hit").inc(hits * block_tokens)
            if asked - hits:
                m.lookup_tokens.labels(op=op, result="miss").inc((asked - hits) * block_tokens)

    # ------------------------------------------------------------------ reporting

    def gauges(self) -> StoreGauges:
        """Totals for the metrics collector and Stats."""
        with self._lock:
            cap = self.capacity_bytes
            return StoreGauges(
                blocks=len(self._blocks),
                used_bytes=cap - self._alloc.free_bytes,
                capacity_bytes=cap,
                free_bytes=self._alloc.free_bytes,
                segments=self._alloc.segments,
                active_leases=len(self._leases),
                pending_writes=len(self._reservations),
                stored_raw_bytes=self._stored_raw,
                stored_payload_bytes=self._stored_payload,
            )

    @property
    def evicted_blocks(self) -> int:
        return self._counters.evicted

    @property
    def checksum_failures(self) -> int:
        return self._counters.checksum_failures

    @property
    def reconcile_dropped(self) -> int:
        return self._counters.reconcile_dropped

    def keys(self) -> list[bytes]:
        """Every stored key (for tests and tools)."""
        with self._lock:
            return list(self._blocks)

    def record(self, key: bytes) -> BlockRecord | None:
        with self._lock:
            return self._blocks.get(key)

    def segment_path(self, relative: str) -> str:
        return str(self.settings.data_dir / relative)

    @staticmethod
    def dtype_name(code: int) -> str:
        return DTYPE_NAMES[code]
