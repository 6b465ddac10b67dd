"""The ``dscache.v1.KVCache`` servicer: validates requests, maps them onto a store.

Contract:
    * The servicer depends on the :class:`~dscache_sidecar.blockstore.BlockStore`
      protocol only, never on a concrete store.
    * Validation lives here, semantics in the store: malformed input raises
      :class:`BadRequestError` (INVALID_ARGUMENT, mapped by the daemon's
      interceptor); an RPC whose capability (``Leasing``, ``Reserving``) the store
      lacks raises :class:`UnimplementedError` (UNIMPLEMENTED).
    * A miss is a normal response.
    * With a shared tier (:mod:`dscache_sidecar.shared`), Lookup also says how many
      of the following keys the tier holds, and a Lease with ``fetch_remote``
      promotes them first; the tier never turns a call into an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from dscache.v1 import kvcache_pb2 as pb
from dscache.v1 import kvcache_pb2_grpc as pb_grpc
from dscache_sidecar.blockstore import (
    BlockSpec,
    BlockStore,
    Descending,
    Leasing,
    Reserving,
    Signalling,
)
from dscache_sidecar.codec import DTYPE_NAMES, Codec
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.index import BlockRecord
from dscache_sidecar.metrics import SidecarMetrics
from dscache_sidecar.shared import SharedTier

_MAX_TENANT_CHARS = 256
_SIGNALS = {
    pb.SIGNAL_SESSION_ENDED: "ended",
    pb.SIGNAL_NEXT_TURN_EXPECTED: "expected",
    pb.SIGNAL_REQUEST_QUEUED: "queued",
}
#: How long a queued signal keeps a chain when the request names no TTL.
_QUEUED_TTL_S = 60.0
#: Descendants: blocks per answer when the caller names no bound, and at most.
_DESCENDANTS_DEFAULT = 256
_DESCENDANTS_MAX = 1024


class BadRequestError(ValueError):
    """Malformed input from the client (INVALID_ARGUMENT)."""


class UnimplementedError(NotImplementedError):
    """The store lacks the capability an RPC needs (UNIMPLEMENTED)."""


def _info(rec: BlockRecord) -> pb.BlockInfo:
    return pb.BlockInfo(
        dtype=DTYPE_NAMES[rec.dtype_code],
        shape=list(rec.shape),
        codec=rec.codec,  # type: ignore[arg-type]
        raw_bytes=rec.raw_bytes,
        stored_bytes=rec.stored_bytes,
        checksum=rec.checksum,
    )


class KVCacheService(pb_grpc.KVCacheServicer):
    """Maps RPCs onto the store; validation lives here, semantics in the store.

    Lease/Release need a :class:`Leasing` store, Allocate/Commit/Abort a
    :class:`Reserving` one; without the capability they answer UNIMPLEMENTED.
    Stats reads its counts from ``metrics``, their one source.
    """

    def __init__(
        self,
        store: BlockStore,
        settings: SidecarSettings,
        metrics: SidecarMetrics,
        shared: SharedTier | None = None,
    ) -> None:
        """``shared``: the shared tier behind ``store``, if any."""
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.shared = shared
        self._leasing = store if isinstance(store, Leasing) else None
        self._reserving = store if isinstance(store, Reserving) else None
        self._signalling = store if isinstance(store, Signalling) else None
        self._descending = store if isinstance(store, Descending) else None

    def _leases(self) -> Leasing:
        if self._leasing is None:
            raise UnimplementedError("this store does not lease blocks in place")
        return self._leasing

    def _reservations(self) -> Reserving:
        if self._reserving is None:
            raise UnimplementedError("this store does not reserve space for in-place writes")
        return self._reserving

    # -- validation helpers

    def _tenant(self, tenant: str) -> str:
        if len(tenant) > _MAX_TENANT_CHARS:
            raise BadRequestError(f"tenant longer than {_MAX_TENANT_CHARS} characters")
        return tenant

    def _keys(self, keys: Any) -> list[bytes]:
        if len(keys) > self.settings.max_keys_per_request:
            raise BadRequestError(f"more than {self.settings.max_keys_per_request} keys")
        out = [bytes(k) for k in keys]
        for k in out:
            if len(k) != 32:
                raise BadRequestError("every key must be 32 bytes")
        return out

    def _spec(self, block: pb.NewBlock) -> BlockSpec:
        info = block.info
        try:
            codec = Codec(info.codec)
        except ValueError as exc:
            raise BadRequestError(f"unknown codec {info.codec}") from exc
        spec = BlockSpec(
            key=bytes(block.key),
            parent=bytes(block.parent),
            codec=codec,
            dtype=info.dtype,
            shape=tuple(info.shape),
            raw_bytes=info.raw_bytes,
            stored_bytes=info.stored_bytes,
            tokens=np.asarray(block.token_ids, dtype="<u4").tobytes(),
        )
        try:
            spec.validate(self.store.max_stored_bytes)
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        return spec

    # -- RPCs

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        tenant, keys = self._tenant(request.tenant), self._keys(request.keys)
        hits = self.store.lookup(tenant, keys, request.block_tokens)
        remote = 0
        if self.shared is not None and hits < len(keys):
            remote = self.shared.lookup(tenant, keys[hits:])
        return pb.LookupResponse(hit_blocks=hits, remote_blocks=remote)

    def Lease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseResponse:
        ttl = request.ttl_ms / 1000.0 if request.ttl_ms else None
        if request.lease_id:
            expires = self._leases().extend(request.lease_id, ttl)
            return pb.LeaseResponse(
                lease_id=request.lease_id if expires else "", expires_unix_ms=expires
            )
        tenant, keys = self._tenant(request.tenant), self._keys(request.keys)
        leases = self._leases()
        promoted = 0
        if request.fetch_remote and self.shared is not None:
            promoted = self.shared.promote(tenant, keys)
        grant = leases.lease(tenant, keys, ttl, request.block_tokens)
        return pb.LeaseResponse(
            lease_id=grant.lease_id,
            promoted_blocks=promoted,
            blocks=[
                pb.BlockLocation(key=rec.key, segment=seg, offset=off, info=_info(rec))
                for rec, seg, off in grant.blocks
            ],
            expires_unix_ms=grant.expires_unix_ms,
        )

    def Release(
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseResponse:
        released = self._leases().release(request.lease_id, self._keys(request.corrupt_keys))
        return pb.ReleaseResponse(released=released)

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        if len(request.blocks) > self.settings.max_keys_per_request:
            raise BadRequestError("too many blocks")
        specs = [self._spec(b) for b in request.blocks]
        ttl = request.ttl_ms / 1000.0 if request.ttl_ms else None
        grants = self._reservations().allocate(self._tenant(request.tenant), specs, ttl)
        return pb.AllocateResponse(
            slots=[
                pb.Slot(
                    key=g.key,
                    write_id=g.write_id,
                    segment=g.segment,
                    offset=g.offset,
                    exists=g.exists,
                )
                for g in grants
            ]
        )

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        writes = [
            (w.write_id, w.checksum if w.HasField("checksum") else None) for w in request.writes
        ]
        results = self._reservations().commit(writes)
        return pb.CommitResponse(results=[int(r) for r in results])  # type: ignore[misc]

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        aborted = self._reservations().abort(list(request.write_ids))
        return pb.AbortResponse(aborted=aborted)

    def Put(
        self, request_iterator: Iterator[pb.PutChunk], context: grpc.ServicerContext
    ) -> pb.PutResponse:
        header: pb.PutHeader | None = None
        spec: BlockSpec | None = None
        buf = bytearray()
        for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    raise BadRequestError("the first chunk must carry the header")
                header = chunk.header
                spec = self._spec(header.block)
            elif chunk.HasField("header"):
                raise BadRequestError("only the first chunk may carry a header")
            buf += chunk.data
            if spec is not None and len(buf) > spec.stored_bytes:
                raise BadRequestError("more bytes than stored_bytes")
        if header is None or spec is None:
            raise BadRequestError("empty Put stream")
        try:
            stored, existed = self.store.put(
                self._tenant(header.tenant), spec, bytes(buf), header.block.info.checksum
            )
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        return pb.PutResponse(stored=stored, existed=existed)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        key = self._keys([request.key])[0]
        found = self.store.read(self._tenant(request.tenant), key)
        if found is None:
            yield pb.GetChunk(found=False)
            return
        rec, data = found
        step = self.settings.stream_chunk_bytes
        yield pb.GetChunk(found=True, info=_info(rec), data=data[:step])
        for start in range(step, len(data), step):
            yield pb.GetChunk(data=data[start : start + step])

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        n = self.store.delete(self._tenant(request.tenant), self._keys(request.keys))
        return pb.DeleteResponse(deleted=n)

    def ClearTenant(
        self, request: pb.ClearTenantRequest, context: grpc.ServicerContext
    ) -> pb.ClearTenantResponse:
        return pb.ClearTenantResponse(deleted=self.store.clear_tenant(self._tenant(request.tenant)))

    def Signal(self, request: pb.SignalRequest, context: grpc.ServicerContext) -> pb.SignalResponse:
        kind = _SIGNALS.get(request.kind)
        if kind is None:
            raise BadRequestError(f"unknown signal kind {request.kind}")
        tenant, keys = self._tenant(request.tenant), self._keys(request.keys)
        ttl_s = request.ttl_ms / 1000 if request.ttl_ms else _QUEUED_TTL_S
        marked = self._signalling.signal(tenant, keys, kind, ttl_s) if self._signalling else 0
        self.metrics.signals.labels(kind=kind, result="marked" if marked else "unmarked").inc()
        return pb.SignalResponse(marked_blocks=marked)

    def Descendants(
        self, request: pb.DescendantsRequest, context: grpc.ServicerContext
    ) -> pb.DescendantsResponse:
        if self._descending is None:
            raise UnimplementedError("this store does not keep the blocks' token ids")
        tenant, (key,) = self._tenant(request.tenant), self._keys([request.key])
        bound = min(request.max_blocks or _DESCENDANTS_DEFAULT, _DESCENDANTS_MAX)
        firsts = list(request.first_tokens)
        if len(firsts) > self.settings.max_keys_per_request:
            raise BadRequestError(f"more than {self.settings.max_keys_per_request} first tokens")
        blocks, truncated = self._descending.descendants(tenant, key, bound, firsts)
        return pb.DescendantsResponse(
            blocks=[pb.Descendant(key=b.key, parent=b.parent, token_ids=b.tokens) for b in blocks],
            truncated=truncated,
        )

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        # Every gauge but free_bytes is a Stats field of the same name.
        gauges = dataclasses.asdict(self.store.gauges())
        del gauges["free_bytes"]
        shared = self.shared.status() if self.shared is not None else None
        return pb.StatsResponse(
            shared_tier=shared.engine if shared else "",
            shared_tier_up=shared.up if shared else False,
            shared_queue_blocks=shared.queued if shared else 0,
            policy=self.store.policy_name,
            evicted_blocks=self.metrics.evicted_blocks(),
            checksum_failures=self.metrics.checksum_failure_count(),
            **gauges,
        )
