"""Zero-copy loads: leased blocks as numpy views on the mapped segment files.

Contract:
    * Views stay valid until ``LoadedBlocks.release()``: the lease is extended in
      the background for as long as it is held (:mod:`.keeper`), however long the
      work on the blocks takes. ``LoadedBlocks.lapsed()`` says whether it ran out
      all the same (a daemon that could not be reached in time): then the views may
      show other bytes, and what was computed from them must be redone.
    * With ``verify=True`` every loaded block is checked against its checksum; a
      mismatch truncates the result at that block (prefix semantics), is reported
      to the daemon (which drops the block) and is never returned.
    * With ``verify="background"`` raw blocks are returned at once and checked on
      the loader's verifier thread while the caller computes; the caller must ask
      ``LoadedBlocks.verified()`` (how many leading blocks matched) before anything
      derived from them leaves the process, and redo what used a block past that
      count. A mismatch is reported to the daemon as above. Compressed blocks are
      checked before they are decoded, as with ``verify=True``.
    * Without the shared volume, blocks are streamed (Get) and copied.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import numpy as np

from dscache.v1 import kvcache_pb2 as pb
from dscache_sidecar.client.keeper import Held, LeaseKeeper
from dscache_sidecar.client.rpc import Connection
from dscache_sidecar.codec import Codec, decode
from dscache_sidecar.errors import SidecarError, wrap_rpc_error
from dscache_sidecar.mapped import MappedSegments
from dscache_sidecar.segments import checksum

log = logging.getLogger(__name__)

#: How loads check checksums: before returning, on the verifier thread, or not.
Verify = bool | Literal["background"]


@dataclass
class LoadedBlocks:
    """Leased blocks in chain order; arrays are valid until ``release()``."""

    keys: list[bytes]
    arrays: list[np.ndarray]
    lease_id: str = ""
    _release: Any = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)
    _checking: Future[int] | None = field(default=None, repr=False)
    _held: Held | None = field(default=None, repr=False)
    #: Seconds the Lease call and the mapping took (filled in by the caller that timed them).
    lease_s: float = 0.0
    map_s: float = 0.0

    def __len__(self) -> int:
        return len(self.arrays)

    def verified(self, timeout_s: float | None = None) -> int:
        """How many leading blocks passed their checksum (all, unless checked in the
        background: then this waits for the check).

        Raises:
            TimeoutError: the background check did not end in ``timeout_s``.
        """
        if self._checking is None:
            return len(self.arrays)
        return self._checking.result(timeout_s)

    def held_until(self) -> float:
        """Monotonic time up to which the blocks are known to be leased (infinite for
        copies, which need no lease); moves on while the keeper extends the lease."""
        return self._held.until if self._held is not None else math.inf

    def lapsed(self) -> bool:
        """Whether the lease ran out while held: the views may have shown other bytes."""
        return self._held is not None and self._held.lapsed

    def release(self) -> None:
        """Ends the lease; best effort (a dead daemon's leases expire anyway)."""
        if self._released:
            return
        self._released = True
        if self.lease_id and self._release is not None:
            try:
                self._release(self.lease_id)
            except Exception as exc:  # release must never fail a request
                log.debug("release of lease failed: %s", exc)

    def __enter__(self) -> LoadedBlocks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass(frozen=True)
class _Check:
    """A raw block whose checksum the verifier thread checks: its index in the load,
    its bytes, the checksum it must have, and where it lives."""

    index: int
    payload: memoryview
    expected: int
    segment: str
    offset: int


def _decode_location(
    segments: MappedSegments, loc: pb.BlockLocation, verify: Verify, sizes: dict[str, int]
) -> tuple[np.ndarray | None, memoryview | None]:
    """The block's array (a view for raw blocks), None when its checksum fails; and,
    with ``verify="background"``, the raw payload still to be checked."""
    info = loc.info
    payload = segments.view(loc.segment, loc.offset, info.stored_bytes, sizes)
    later = verify == "background" and Codec(info.codec) is Codec.RAW
    if verify and not later and checksum(payload) != info.checksum:
        return None, None
    arr = decode(payload, Codec(info.codec), info.dtype, tuple(info.shape))
    return arr, payload if later else None


class BlockLoader:
    """Maps leased blocks (or streams them) and checks their checksums.

    Args:
        conn: the connection to the daemon (Release, Get).
        segments: the mapped segment files; None without the shared volume.
    """

    def __init__(self, conn: Connection, segments: MappedSegments | None) -> None:
        self._conn = conn
        self._segments = segments
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-verify")
        self.keeper = LeaseKeeper(conn)

    def map_lease(
        self, resp: pb.LeaseResponse, verify: Verify, ttl_s: float = 0.0, asked_at: float = 0.0
    ) -> LoadedBlocks:
        """The leased blocks as arrays on the mapped segments; the lease (asked for
        ``ttl_s`` at monotonic ``asked_at``; 0: as granted, now) is kept until
        ``release``."""
        assert self._segments is not None
        out = LoadedBlocks([], [], resp.lease_id, self.release)
        if resp.lease_id:
            out._held = self.keeper.hold(
                resp.lease_id, ttl_s, asked_at or time.monotonic(), resp.expires_unix_ms
            )
        corrupt: list[bytes] = []
        sizes: dict[str, int] = {}
        deferred: list[_Check] = []
        try:
            for loc in resp.blocks:
                try:
                    arr, unchecked = _decode_location(self._segments, loc, verify, sizes)
                except (SidecarError, ValueError) as exc:
                    log.warning("cached block unreadable, treated as a miss: %s", exc)
                    arr, unchecked = None, None
                if arr is None:
                    corrupt.append(bytes(loc.key))
                    break
                if unchecked is not None:
                    deferred.append(
                        _Check(
                            len(out.arrays), unchecked, loc.info.checksum, loc.segment, loc.offset
                        )
                    )
                out.keys.append(bytes(loc.key))
                out.arrays.append(arr)
        except BaseException:
            out.release()
            raise
        if corrupt:
            self.report_corrupt(corrupt)
        if deferred:
            out._checking = self._verifier.submit(self._check_background, out, deferred)
        return out

    def _check_background(self, loaded: LoadedBlocks, checks: list[_Check]) -> int:
        """The verifier thread's job: how many leading blocks of ``loaded`` match.

        ``checks`` are the raw blocks in chain order (compressed ones were checked
        before decoding); the first mismatch is reported to the daemon. Every block
        is first read ahead at once, so pages evicted since they were mapped come in
        while the caller computes, not on the caller's first touch.
        """
        assert self._segments is not None
        for c in checks:
            self._segments.prefetch(c.segment, c.offset, len(c.payload))
        for c in checks:
            if checksum(c.payload) != c.expected:
                self.report_corrupt([loaded.keys[c.index]])
                return c.index
        return len(loaded.arrays)

    def report_corrupt(self, keys: list[bytes]) -> None:
        """Tells the daemon these blocks failed their checksum (it drops them)."""
        try:
            self._conn.stub.Release(
                pb.ReleaseRequest(corrupt_keys=keys), timeout=self._conn.timeout_s
            )
        except grpc.RpcError as exc:
            log.debug("could not report a corrupt block: %s", exc)

    def release(self, lease_id: str) -> None:
        """Ends a lease (raises on a failed call; ``LoadedBlocks.release`` swallows)."""
        self.keeper.drop(lease_id)
        self._conn.stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=self._conn.timeout_s)

    def stream(self, tenant: str, keys: Sequence[bytes], verify: bool) -> LoadedBlocks:
        """The leading stored blocks one Get at a time (no shared volume)."""
        out = LoadedBlocks([], [])
        for key in keys:
            arr = self.get(tenant, key, verify)
            if arr is None:
                break
            out.keys.append(key)
            out.arrays.append(arr)
        return out

    def get(self, tenant: str, key: bytes, verify: bool) -> np.ndarray | None:
        """One block's array over streaming Get (a copy), or None on a miss."""
        try:
            chunks = self._conn.stub.Get(
                pb.GetRequest(tenant=tenant, key=key), timeout=self._conn.long_timeout_s
            )
            first: pb.GetChunk | None = None
            buf = bytearray()
            for chunk in chunks:
                if first is None:
                    first = chunk
                    if not chunk.found:
                        return None
                buf += chunk.data
        except grpc.RpcError as exc:
            raise wrap_rpc_error(exc) from exc
        if first is None:
            return None
        info = first.info
        if verify and checksum(bytes(buf)) != info.checksum:
            return None
        return decode(bytes(buf), Codec(info.codec), info.dtype, tuple(info.shape)).copy()

    def close(self) -> None:
        self.keeper.close()
        self._verifier.shutdown(wait=False)
