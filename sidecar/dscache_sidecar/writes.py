"""The write path: reserve space, let the writer fill it, verify, publish.

Contract:
    * A block is visible only after its payload is on disk (fsync'd when
      ``durable``), its checksum known (the writer's, or computed from the bytes
      on disk when the writer sent none or ``verify_commits`` is set), its header
      written, and its index record committed, in that order.
    * Bytes are hashed outside the store lock; only bookkeeping happens under it.
    * A commit whose reservation expired (or is being committed by another call)
      is ``EXPIRED``; a key published meanwhile is ``DUPLICATE`` and its space is
      freed; a checksum that does not match is ``CHECKSUM_MISMATCH``.
    * An index that cannot grow (disk or map full) publishes nothing, frees the
      space and raises :class:`StoreFullError`. So does a segment write that
      meets a full disk (``ENOSPC``; preallocated segments make that rare, but a
      thin-provisioned volume or an injected fault, :mod:`dscache_sidecar.faults`,
      can): a commit that cannot write a header publishes none of its blocks.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import lmdb

from dscache_sidecar.blockstore import (
    BlockSpec,
    Clock,
    CommitResult,
    SlotGrant,
    StoreFullError,
    tenant_bytes,
)
from dscache_sidecar.catalog import Catalog
from dscache_sidecar.codec import DTYPE_CODES
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.index import BlockIndex, BlockRecord
from dscache_sidecar.reservations import Reservation, ReservationTable
from dscache_sidecar.segments import (
    DISK_FULL_ERRNOS,
    HEADER_BYTES,
    BlockHeader,
    SegmentFiles,
    checksum,
    extent_bytes,
)

log = logging.getLogger(__name__)

#: Longest reservation a writer may ask for, seconds.
MAX_RESERVATION_S = 600.0


@dataclass
class _Verified:
    reservation: Reservation
    result: CommitResult
    checksum: int = 0


@dataclass
class WriteContext:
    """What the write path shares with the store (the lock guards ``catalog``)."""

    settings: SidecarSettings
    segments: SegmentFiles
    catalog: Catalog
    index: Callable[[], BlockIndex]
    lock: threading.RLock
    clock: Clock
    hook: Callable[[str], None]


class Writes:
    """Allocate, commit, abort and put, over the store's shared state."""

    def __init__(self, ctx: WriteContext) -> None:
        self._ctx = ctx
        self._catalog = ctx.catalog
        self._lock = ctx.lock
        self.reservations = ReservationTable(ctx.catalog.free)
        self._maps: dict[int, mmap.mmap] = {}

    def close(self) -> None:
        """Unmaps segments mapped for read-back (store lock held)."""
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def allocate(
        self, tenant: str, specs: Sequence[BlockSpec], ttl_s: float | None = None
    ) -> list[SlotGrant]:
        """Reserves space for the leading blocks that fit.

        Raises:
            ValueError: a spec is malformed.
            StoreFullError: not even the first new block fits.
        """
        settings = self._ctx.settings
        for spec in specs:
            spec.validate(settings.segment_bytes - HEADER_BYTES)
        tid = tenant_bytes(tenant)
        ttl = settings.reservation_ttl_s if not ttl_s else min(ttl_s, MAX_RESERVATION_S)
        grants: list[SlotGrant] = []
        removed: list[BlockRecord] = []
        with self._lock:
            try:
                for spec in specs:
                    if spec.key in self._catalog.blocks:
                        grants.append(SlotGrant(spec.key, "", "", 0, True))
                        continue
                    size = extent_bytes(spec.stored_bytes)
                    try:
                        ext = self._catalog.make_room(
                            size, removed, tid, self.reservations.reserved_by(tid)
                        )
                    except StoreFullError:
                        if not any(not g.exists for g in grants):
                            raise
                        break
                    expires = self._ctx.clock.monotonic() + ttl
                    res = self.reservations.add(tid, spec, ext, size, expires)
                    name = self._ctx.segments.relative_name(res.segment)
                    grants.append(
                        SlotGrant(spec.key, res.write_id, name, res.offset + HEADER_BYTES, False)
                    )
            finally:
                if removed:
                    self._catalog.forget(removed)
        return grants

    def commit(self, writes: Sequence[tuple[str, int | None]]) -> list[CommitResult]:
        """Verifies, makes durable and publishes reserved blocks.

        Args:
            writes: (write id, client checksum or None) pairs.
        """
        with self._lock:
            claimed = [self.reservations.claim(write_id) for write_id, _ in writes]
        verified: list[_Verified | None] = []
        synced: set[int] = set()
        try:
            for (_, client_sum), res in zip(writes, claimed, strict=True):
                if res is None:
                    verified.append(None)
                    continue
                verified.append(self._verify_written(res, client_sum))
                synced.add(res.segment)
        except OSError as exc:
            self._unclaim(claimed)
            if exc.errno not in DISK_FULL_ERRNOS:
                raise
            raise self._disk_full(exc) from exc
        if self._ctx.settings.durable:
            for seg in synced:
                self._ctx.segments.sync(seg)
        self._ctx.hook("commit.verified")
        with self._lock:
            return self._publish_verified(verified)

    def _unclaim(self, claimed: Sequence[Reservation | None]) -> None:
        """Frees the space of claimed reservations whose commit failed (nothing published)."""
        with self._lock:
            for res in claimed:
                if res is not None:
                    self.reservations.finish(res.write_id)
                    self._catalog.free(res.segment, res.offset, res.extent)

    def _disk_full(self, exc: OSError) -> StoreFullError:
        """The :class:`StoreFullError` for a segment write that met a full disk (counted)."""
        self._catalog.metrics.write_rejections.labels(reason="disk_full").inc()
        return StoreFullError(f"cannot write block data: {exc.strerror or exc}")

    def _publish_verified(self, verified: list[_Verified | None]) -> list[CommitResult]:
        """Publishes the verified writes (lock held); frees the space of the rest."""
        catalog = self._catalog
        results: list[CommitResult] = []
        publish: list[BlockRecord] = []
        tokens: list[bytes] = []
        for v in verified:
            if v is None:
                results.append(CommitResult.EXPIRED)
                continue
            res = v.reservation
            self.reservations.finish(res.write_id)
            result = v.result
            if result is CommitResult.OK and (
                res.spec.key in catalog.blocks or any(r.key == res.spec.key for r in publish)
            ):
                result = CommitResult.DUPLICATE
            if result is not CommitResult.OK:
                catalog.free(res.segment, res.offset, res.extent)
                if result is CommitResult.CHECKSUM_MISMATCH:
                    catalog.metrics.checksum_failures.labels(where="commit").inc()
                results.append(result)
                continue
            publish.append(self._record_for(res, v.checksum))
            tokens.append(res.spec.tokens)
            results.append(CommitResult.OK)
        if publish:
            try:
                self._ctx.index().put_many(publish, tokens)
            except lmdb.Error as exc:
                # Disk (or map) full: nothing was published; give the space back.
                for rec in publish:
                    catalog.free(rec.segment, rec.offset, rec.extent_bytes)
                catalog.metrics.write_rejections.labels(reason="index_full").inc()
                raise StoreFullError(f"cannot grow the index: {exc}") from exc
            # Deepest first, then the stored ancestors: parents stay fresher
            # than their children, so eviction takes children first.
            for rec in reversed(publish):
                catalog.publish(rec)
            catalog.touch_ancestors(publish)
            catalog.announce(publish, tokens)
        return results

    def abort(self, write_ids: Iterable[str]) -> int:
        """Drops reservations; their space is free again at once."""
        with self._lock:
            return self.reservations.abort(write_ids)

    def put(self, tenant: str, spec: BlockSpec, data: bytes, client_sum: int) -> tuple[bool, bool]:
        """Stores one block from bytes received over the wire: (stored, existed)."""
        if len(data) != spec.stored_bytes:
            raise ValueError("received bytes do not match stored_bytes")
        if checksum(data) != client_sum:
            raise ValueError("received bytes do not match the checksum")
        grant = self.allocate(tenant, [spec])[0]
        if grant.exists:
            return False, True
        with self._lock:
            res = self.reservations.get(grant.write_id)
        assert res is not None  # a fresh reservation outlives this call's TTL
        try:
            self._ctx.segments.pwrite(res.segment, res.offset + HEADER_BYTES, data)
        except OSError as exc:
            self.abort([grant.write_id])
            if exc.errno not in DISK_FULL_ERRNOS:
                raise
            raise self._disk_full(exc) from exc
        result = self.commit([(grant.write_id, client_sum)])[0]
        return result is CommitResult.OK, result is CommitResult.DUPLICATE

    def _verify_written(self, res: Reservation, client_sum: int | None) -> _Verified:
        seg, off = res.segment, res.offset + HEADER_BYTES
        if client_sum is not None and not self._ctx.settings.verify_commits:
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

    def _write_header(self, res: Reservation, actual: int) -> _Verified:
        header = BlockHeader(
            codec=res.spec.codec,
            dtype_code=DTYPE_CODES[res.spec.dtype],
            shape=res.spec.shape,
            stored_bytes=res.spec.stored_bytes,
            raw_bytes=res.spec.raw_bytes,
            checksum=actual,
            key=res.spec.key,
            tenant=res.tenant,
            created_ms=int(self._ctx.clock.wall() * 1000),
        )
        self._ctx.segments.pwrite(res.segment, res.offset, header.pack())
        return _Verified(res, CommitResult.OK, actual)

    def _map(self, seg: int) -> mmap.mmap:
        segment_bytes = self._ctx.settings.segment_bytes
        m = self._maps.get(seg)
        if m is None:
            with self._lock:
                m = self._maps.get(seg)
                if m is None:
                    m = mmap.mmap(
                        self._ctx.segments.fd(seg),
                        segment_bytes,
                        prot=mmap.PROT_READ,
                        flags=mmap.MAP_SHARED,
                    )
                    self._maps[seg] = m
        if self._ctx.segments.file_size(seg) < segment_bytes:
            raise ValueError("segment truncated")
        return m

    def _record_for(self, res: Reservation, csum: int) -> BlockRecord:
        now_ms = int(self._ctx.clock.wall() * 1000)
        spec = res.spec
        return BlockRecord(
            key=spec.key,
            segment=res.segment,
            offset=res.offset,
            extent_bytes=res.extent,
            stored_bytes=spec.stored_bytes,
            raw_bytes=spec.raw_bytes,
            checksum=csum,
            codec=spec.codec,
            dtype_code=DTYPE_CODES[spec.dtype],
            shape=spec.shape,
            tenant=res.tenant,
            parent=spec.parent,
            created_ms=now_ms,
            last_access_ms=now_ms,
        )
