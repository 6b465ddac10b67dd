"""Reconciliation at start: which index records still describe good blocks.

Contract:
    * A record is kept only if its segment exists and is long enough, its header
      parses and matches the record (key, size, checksum, codec), its extent does
      not overlap a record already kept, and, with ``full``, its payload matches
      its checksum.
    * Every kept record's extent is marked used in the allocator; dropped records
      are returned for the caller to delete and count, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dscache_sidecar.index import BlockRecord
from dscache_sidecar.segments import (
    HEADER_BYTES,
    BlockHeader,
    ExtentAllocator,
    SegmentFiles,
    checksum,
)

log = logging.getLogger(__name__)


def check_record(segments: SegmentFiles, rec: BlockRecord, full: bool) -> str | None:
    """Why ``rec`` no longer describes a good block, or None if it does."""
    if rec.segment >= segments.count:
        return "segment file missing"
    if rec.offset + rec.extent_bytes > segments.file_size(rec.segment):
        return "segment truncated"
    try:
        hdr = BlockHeader.unpack(segments.pread(rec.segment, rec.offset, HEADER_BYTES))
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
        payload = segments.pread(rec.segment, rec.offset + HEADER_BYTES, rec.stored_bytes)
        if checksum(payload) != rec.checksum:
            return "payload checksum mismatch"
    return None


def reconcile(
    records: Iterable[BlockRecord],
    segments: SegmentFiles,
    alloc: ExtentAllocator,
    full: bool,
) -> tuple[list[BlockRecord], list[BlockRecord]]:
    """Splits the index's records into (good, bad).

    Good records come least recently used first, so recency order survives a
    restart: a block's last use is its last hit or, never hit, its creation (a
    block read once long ago is older than one written since, never read);
    their extents are marked used in ``alloc``.
    """
    good: list[BlockRecord] = []
    bad: list[BlockRecord] = []
    for rec in records:
        reason = check_record(segments, rec, full)
        if reason is None and not alloc.mark_used(rec.segment, rec.offset, rec.extent_bytes):
            reason = "overlaps another block"
        if reason is None:
            good.append(rec)
        else:
            log.warning("dropping block %s at start: %s", rec.key.hex()[:16], reason)
            bad.append(rec)
    good.sort(key=lambda r: (max(r.last_access_ms, r.created_ms), r.created_ms))
    return good, bad
