"""The client of the sidecar, with zero-copy reads through mmap.

One facade, :class:`SidecarClient`, over four parts: the gRPC connection
(:mod:`.rpc`), lookups on the daemon's index read in this process (:mod:`.lookup`),
zero-copy loads (:mod:`.loads`) and writes (:mod:`.stores`).

Contract:
    * With ``data_dir`` (the shared cache volume as mounted in this process), reads
      lease blocks and return numpy views on a read-only mapping of the segment
      files: no copy for raw blocks. Writes reserve space (Allocate), write payloads
      in place with ``pwrite``, and publish them (Commit). Without ``data_dir``, the
      client streams bytes with Put/Get instead.
    * Checksums are checked before returning, in the background, or not (``Verify``,
      see :mod:`.loads`); a mismatch is a shorter prefix, never corrupt KV.
    * A mapped lease is extended in the background until it is released, however
      long its blocks are in use (:mod:`.keeper`); ``LoadedBlocks.lapsed()`` says
      whether it ran out all the same.
    * ``lookup`` reads the daemon's LMDB index read-only in this process when
      ``data_dir`` is given: no round trip; while the index cannot be opened it asks
      the daemon over gRPC instead (:mod:`.lookup`).
    * When the daemon has a shared tier (its Stats say so; asked once, then every
      ``SHARED_RECHECK_S``), a lookup that the local index cannot answer in full
      asks the daemon (one ``Lookup``: local, then remote blocks), and leases ask
      it to promote the remote ones first (``fetch_remote``), under the long
      deadline: the daemon bounds the fetch by its own budget.
    * Every failure of the cache surfaces as ``SidecarError`` (or a subclass):
      callers treat it as a miss and recompute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import lmdb
import numpy as np

from dscache.v1 import kvcache_pb2 as pb
from dscache_sidecar.blockstore import Descendant
from dscache_sidecar.client.loads import BlockLoader, LoadedBlocks, Verify
from dscache_sidecar.client.lookup import DirectIndex, LookupAnswer, tenant_id
from dscache_sidecar.client.rpc import Connection, call
from dscache_sidecar.client.stores import BlockData, BlockWriter
from dscache_sidecar.codec import RAW, SAMPLED, Codec, CodecPolicy, Encoding
from dscache_sidecar.errors import (
    SidecarError,
    SidecarFullError,
    SidecarRejectedError,
    SidecarUnavailableError,
)
from dscache_sidecar.mapped import MappedSegments
from dscache_sidecar.segments import checksum_hasher

log = logging.getLogger(__name__)

_SIGNAL_KINDS = {
    "ended": pb.SIGNAL_SESSION_ENDED,
    "expected": pb.SIGNAL_NEXT_TURN_EXPECTED,
    "queued": pb.SIGNAL_REQUEST_QUEUED,
}

__all__ = [
    "BlockData",
    "Codec",
    "Descendant",
    "Encoding",
    "RAW",
    "SAMPLED",
    "Verify",
    "LoadedBlocks",
    "LookupAnswer",
    "SidecarClient",
    "SidecarError",
    "SidecarFullError",
    "SidecarRejectedError",
    "SidecarUnavailableError",
    "checksum_hasher",
]

#: Seconds between two asks whether the daemon has a shared tier.
SHARED_RECHECK_S = 30.0
#: Seconds before a daemon that did not answer that question is asked again.
SHARED_UNANSWERED_RECHECK_S = 2.0
#: Leases granted and not yet mapped remembered at most (their TTL and when asked).
_ASKED_KEPT = 1024


class SidecarClient:
    """Blocking client. Thread safe; one per process is plenty.

    Args:
        socket_path: the daemon's unix socket.
        target: a gRPC target instead (e.g. ``127.0.0.1:50051``).
        data_dir: the cache volume as mounted here; enables zero-copy reads and
            in-place writes.
        timeout_s: deadline of each lookup/lease call; writes get 20x that.
        codec: how new blocks are encoded (default: zstd only where it pays).
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        target: str | None = None,
        data_dir: str | None = None,
        timeout_s: float = 0.5,
        codec: CodecPolicy | None = None,
    ) -> None:
        if (socket_path is None) == (target is None):
            raise ValueError("give exactly one of socket_path or target")
        self._conn = Connection(f"unix:{socket_path}" if socket_path else str(target), timeout_s)
        self._segments = MappedSegments(Path(data_dir)) if data_dir else None
        self._index = DirectIndex(Path(data_dir) / "index") if data_dir else None
        self._loader = BlockLoader(self._conn, self._segments)
        self._writer = BlockWriter(
            self._conn, self._segments, codec if codec is not None else CodecPolicy()
        )
        self._shared: bool | None = None  # the daemon has a shared tier (None: not asked)
        self._signals = True  # False once the daemon answered Signal with UNIMPLEMENTED
        self._descends = True  # False once it answered Descendants with UNIMPLEMENTED
        self._shared_asked = 0.0
        # lease id -> (TTL asked, monotonic time asked), until the grant is mapped
        self._asked: dict[str, tuple[float, float]] = {}

    @property
    def target(self) -> str:
        """The daemon's gRPC target."""
        return self._conn.target

    @property
    def timeout_s(self) -> float:
        """Deadline of each lookup/lease call."""
        return self._conn.timeout_s

    @property
    def codec(self) -> CodecPolicy:
        """How new blocks are encoded."""
        return self._writer.codec

    # -- reads

    def lookup(self, tenant: str, keys: Sequence[bytes], block_tokens: int = 0) -> int:
        """Number of leading keys stored; no side effects."""
        return self.find(tenant, keys, block_tokens).found

    def find(self, tenant: str, keys: Sequence[bytes], block_tokens: int = 0) -> LookupAnswer:
        """Number of leading keys stored, from the index when it is readable here, else
        over gRPC (``Lookup``); no side effects either way."""
        if not keys:
            return LookupAnswer(0, direct=True)
        reader = self._index.get() if self._index is not None else None
        if reader is not None:
            try:
                found = reader.leading(tenant_id(tenant), keys)
            except lmdb.Error as exc:
                assert self._index is not None
                self._index.failed(exc)
            else:
                if found == len(keys) or not self.has_shared_tier():
                    return LookupAnswer(found, direct=True)
        self._conn.ready()
        request = pb.LookupRequest(tenant=tenant, keys=list(keys), block_tokens=block_tokens)
        resp = call(self._conn.stub.Lookup, request, self._conn.timeout_s)
        remote = int(resp.remote_blocks)
        return LookupAnswer(int(resp.hit_blocks) + remote, direct=False, remote=remote)

    def has_shared_tier(self) -> bool:
        """Whether the daemon has a shared tier (asked once per ``SHARED_RECHECK_S``;
        a daemon that does not answer counts as without one and is asked again after
        ``SHARED_UNANSWERED_RECHECK_S``: a model server that starts before its
        sidecar must not skip the tier for the next ``SHARED_RECHECK_S``)."""
        now = time.monotonic()
        if self._shared is None or now - self._shared_asked > SHARED_RECHECK_S:
            self._shared_asked = now
            try:
                self._conn.ready()
                self._shared = bool(self.stats().shared_tier)
            except SidecarError as exc:
                log.debug("could not ask the daemon about its shared tier: %s", exc)
                self._shared = False
                self._shared_asked = now - SHARED_RECHECK_S + SHARED_UNANSWERED_RECHECK_S
        return self._shared

    def load(
        self,
        tenant: str,
        keys: Sequence[bytes],
        *,
        ttl_s: float = 30.0,
        verify: Verify = True,
        block_tokens: int = 0,
    ) -> LoadedBlocks:
        """Leases and maps the leading stored blocks (streams them without data_dir).

        ``verify``: True checks every checksum before returning, ``"background"``
        checks raw blocks on the verifier thread (see ``LoadedBlocks.verified``),
        False trusts the bytes.
        """
        grant = self.lease(tenant, keys, ttl_s=ttl_s, block_tokens=block_tokens)
        return self.map_lease(grant, verify=verify, tenant=tenant, keys=keys)

    def lease(
        self, tenant: str, keys: Sequence[bytes], *, ttl_s: float = 30.0, block_tokens: int = 0
    ) -> pb.LeaseResponse | None:
        """Leases the leading stored blocks (one RPC); None without the shared volume."""
        if not keys:
            return pb.LeaseResponse()
        self._conn.ready()
        if self._segments is None:
            return None
        fetch = self.has_shared_tier()
        request = pb.LeaseRequest(
            tenant=tenant,
            keys=list(keys),
            ttl_ms=int(ttl_s * 1000),
            block_tokens=block_tokens,
            fetch_remote=fetch,
        )
        timeout = self._conn.long_timeout_s if fetch else self._conn.timeout_s
        asked_at = time.monotonic()
        resp: pb.LeaseResponse = call(self._conn.stub.Lease, request, timeout)
        if resp.lease_id:
            self._asked[resp.lease_id] = (ttl_s, asked_at)
            while len(self._asked) > _ASKED_KEPT:  # grants never mapped (a caller's error)
                self._asked.pop(next(iter(self._asked)))
        return resp

    def map_lease(
        self,
        resp: pb.LeaseResponse | None,
        *,
        verify: Verify = True,
        tenant: str = "",
        keys: Sequence[bytes] = (),
    ) -> LoadedBlocks:
        """The leased blocks as arrays on the mapped segments (``lease``'s answer);
        without the shared volume (None) they are streamed (``tenant``, ``keys``)."""
        if resp is None:
            return self._loader.stream(tenant, keys, bool(verify))
        ttl_s, asked_at = self._asked.pop(resp.lease_id, (0.0, 0.0))
        return self._loader.map_lease(resp, verify, ttl_s, asked_at)

    def release(self, lease_id: str) -> None:
        """Ends a lease by id (``LoadedBlocks.release`` does this for its own)."""
        self._loader.release(lease_id)

    def report_corrupt(self, keys: Sequence[bytes]) -> None:
        """Tells the daemon these blocks failed their checksum (it drops them), for a
        caller that checked mapped blocks itself; best effort."""
        self._loader.report_corrupt(list(keys))

    def get(self, tenant: str, key: bytes, *, verify: bool = True) -> np.ndarray | None:
        """One block's array over streaming Get (a copy), or None on a miss."""
        return self._loader.get(tenant, key, verify)

    # -- writes

    def store(self, tenant: str, blocks: Sequence[BlockData], encoding: Encoding = SAMPLED) -> int:
        """Stores blocks encoded as ``encoding``; returns how many were newly stored.

        The default samples each block: zstd where it shrinks enough, raw otherwise.
        A lossy codec (int8) only under keys whose fingerprint names it.
        """
        return self._writer.store(tenant, blocks, encoding)

    # -- admin

    def signal(self, tenant: str, keys: Sequence[bytes], kind: str, ttl_ms: int = 0) -> int:
        """Tells the eviction policy about a chain (``Signal``): ``kind`` is ``ended``
        (the session is over), ``expected`` (its next turn will come) or ``queued``
        (a request for it waits; kept ``ttl_ms``, 0 = the daemon's 60 s).

        Best effort: returns the blocks marked, 0 when the daemon is older than the
        RPC (UNIMPLEMENTED, remembered: no more calls) or its policy takes no
        signals. Other failures raise ``SidecarError`` as every call does.

        Raises:
            ValueError: on an unknown ``kind``.
        """
        code = _SIGNAL_KINDS.get(kind)
        if code is None:
            raise ValueError(f"unknown signal {kind!r}; known: {', '.join(_SIGNAL_KINDS)}")
        if not keys or not self._signals:
            return 0
        request = pb.SignalRequest(tenant=tenant, keys=list(keys), kind=code, ttl_ms=ttl_ms)
        try:
            return int(call(self._conn.stub.Signal, request, self._conn.timeout_s).marked_blocks)
        except SidecarError as exc:
            if str(exc).startswith("UNIMPLEMENTED"):
                self._signals = False
                return 0
            raise

    def descendants(
        self, tenant: str, key: bytes, max_blocks: int = 256, first_tokens: Sequence[int] = ()
    ) -> tuple[list[Descendant], bool]:
        """``tenant``'s stored blocks under ``key`` with the token ids they were
        stored with, breadth first (``Descendants``; with ``first_tokens``, only the
        blocks directly under ``key`` that start with one of them); and whether the
        daemon's bound left some out. Nothing (and no more calls) when the daemon is older than
        the RPC or its store keeps no token ids; other failures raise
        ``SidecarError`` as every call does."""
        if not self._descends:
            return [], False
        request = pb.DescendantsRequest(
            tenant=tenant, key=key, max_blocks=max_blocks, first_tokens=list(first_tokens)
        )
        try:
            answer = call(self._conn.stub.Descendants, request, self._conn.timeout_s)
        except SidecarError as exc:
            if str(exc).startswith("UNIMPLEMENTED"):
                self._descends = False
                return [], False
            raise
        blocks = [Descendant(b.key, b.parent, b.token_ids) for b in answer.blocks]
        return blocks, bool(answer.truncated)

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Removes blocks (and their cached descendants); returns how many."""
        request = pb.DeleteRequest(tenant=tenant, keys=list(keys))
        return int(call(self._conn.stub.Delete, request, self._conn.long_timeout_s).deleted)

    def clear_tenant(self, tenant: str) -> int:
        """Removes every block of ``tenant``; returns how many."""
        request = pb.ClearTenantRequest(tenant=tenant)
        return int(call(self._conn.stub.ClearTenant, request, self._conn.long_timeout_s).deleted)

    def stats(self) -> pb.StatsResponse:
        """The daemon's totals (blocks, bytes, leases, evictions, checksum failures)."""
        resp: pb.StatsResponse = call(
            self._conn.stub.Stats, pb.StatsRequest(), self._conn.timeout_s * 4
        )
        return resp

    def healthy(self) -> bool:
        """True when the daemon answers its health check as SERVING."""
        return self._conn.healthy()

    def close(self) -> None:
        self._writer.close()
        self._loader.close()
        if self._index is not None:
            self._index.close()
        self._conn.close()
        if self._segments is not None:
            self._segments.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
