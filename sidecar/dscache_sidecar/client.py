"""The client of the sidecar, with zero-copy reads through mmap.

Contract:
    * With ``data_dir`` (the shared cache volume as mounted in this process), reads
      lease blocks and return numpy views on a read-only mapping of the segment
      files: no copy for raw blocks. Writes reserve space (Allocate), write payloads
      in place with ``pwrite``, and publish them (Commit). Without ``data_dir``, the
      client streams bytes with Put/Get instead.
    * Views stay valid until ``LoadedBlocks.release()`` (or the lease TTL): keep the
      lease while you use them; copy what must outlive it.
    * With ``verify=True`` every loaded block is checked against its checksum; a
      mismatch truncates the result at that block (prefix semantics), is reported
      to the daemon (which drops the block) and is never returned.
    * With ``verify="background"`` raw blocks are returned at once and checked on
      the client's verifier thread while the caller computes; the caller must ask
      ``LoadedBlocks.verified()`` (how many leading blocks matched) before anything
      derived from them leaves the process, and redo what used a block past that
      count. A mismatch is reported to the daemon as above. Compressed blocks are
      checked before they are decoded, as with ``verify=True``.
    * ``lookup`` reads the daemon's LMDB index read-only in this process
      (:class:`~dscache_sidecar.index.IndexReader`) when ``data_dir`` is given: no
      round trip. While the index cannot be opened (the daemon has not created it
      yet; the daemon runs in this very process; another PID namespace holds this
      process id's lock slot) it asks the daemon over gRPC instead, and tries the
      index again after ``DIRECT_RETRY_S``.
    * When the daemon has a shared tier (its Stats say so; asked once, then every
      ``SHARED_RECHECK_S``), a lookup that the local index cannot answer in full
      asks the daemon (one ``Lookup``: local, then remote blocks), and leases ask
      it to promote the remote ones first (``fetch_remote``), under the long
      deadline: the daemon bounds the fetch by its own budget.
    * Every failure of the cache surfaces as ``SidecarError`` (or a subclass):
      callers treat it as a miss and recompute.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import lmdb
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dscache.v1 import kvcache_pb2 as pb
from dscache.v1 import kvcache_pb2_grpc as pb_grpc
from dscache_sidecar.blockstore import tenant_bytes
from dscache_sidecar.codec import Codec, CodecPolicy, decode, dtype_name
from dscache_sidecar.errors import (
    SidecarError,
    SidecarFullError,
    SidecarRejectedError,
    SidecarUnavailableError,
    wrap_rpc_error,
)
from dscache_sidecar.index import IndexReader
from dscache_sidecar.mapped import MappedSegments
from dscache_sidecar.segments import checksum

log = logging.getLogger(__name__)

__all__ = [
    "BlockData",
    "Codec",
    "Verify",
    "LoadedBlocks",
    "LookupAnswer",
    "SidecarClient",
    "SidecarError",
    "SidecarFullError",
    "SidecarRejectedError",
    "SidecarUnavailableError",
]

_CHUNK = 1024 * 1024
#: Seconds before a client that could not open the index read-only tries again.
DIRECT_RETRY_S = 5.0
#: Seconds between checks that the index on disk is still the one opened.
_REPLACED_CHECK_S = 1.0
#: Seconds between two asks whether the daemon has a shared tier.
SHARED_RECHECK_S = 30.0
#: How loads check checksums: before returning, on the verifier thread, or not.
Verify = bool | Literal["background"]
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
]


def _call(method: Callable[..., Any], request: Any, timeout_s: float) -> Any:
    """One unary (or client-streaming) RPC; gRPC failures become ``SidecarError``."""
    try:
        return method(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        raise wrap_rpc_error(exc) from exc


@dataclass(frozen=True)
class BlockData:
    """One block to store: its key, its parent's key (b"" for block 0), its array.

    ``dtype`` overrides the contract dtype name (needed for bfloat16, which numpy
    carries as uint16).
    """

    key: bytes
    parent: bytes
    array: np.ndarray
    dtype: str | None = None


@dataclass
class LoadedBlocks:
    """Leased blocks in chain order; arrays are valid until ``release()``."""

    keys: list[bytes]
    arrays: list[np.ndarray]
    lease_id: str = ""
    _release: Any = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)
    _checking: Future[int] | None = field(default=None, repr=False)
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


@dataclass(frozen=True)
class LookupAnswer:
    """How many leading blocks are stored, and whether the index said so (no RPC);
    ``remote`` of the ``found`` blocks are in the shared tier (the last ones)."""

    found: int
    direct: bool
    remote: int = 0


class _DirectIndex:
    """The client's read-only handle on the daemon's index, opened lazily.

    ``get()`` gives None while the index cannot be opened, and tries again after
    ``DIRECT_RETRY_S``; a handle whose file was replaced (a new data directory) is
    dropped and opened anew.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._reader: IndexReader | None = None
        self._next_try = 0.0
        self._next_check = 0.0
        self._told = False  # the fallback was logged
        self._lock = threading.Lock()

    def get(self) -> IndexReader | None:
        now = time.monotonic()
        reader = self._reader
        if reader is not None and now < self._next_check:
            return reader
        with self._lock:
            if self._reader is not None:
                self._next_check = now + _REPLACED_CHECK_S
                if not self._reader.replaced():
                    return self._reader
                self._drop()
            if now < self._next_try:
                return None
            try:
                self._reader = IndexReader(self._path)
            except (OSError, lmdb.Error) as exc:
                self._next_try = now + DIRECT_RETRY_S
                # Once at info (a pod without a shared PID namespace stays this way);
                # the retries every few seconds at debug.
                level = logging.DEBUG if self._told else logging.INFO
                self._told = True
                log.log(level, "lookups go over gRPC: the index is not readable here (%s)", exc)
                return None
            if self._told:
                log.info("lookups read the index directly again")
                self._told = False
            self._next_check = now + _REPLACED_CHECK_S
            return self._reader

    def failed(self, exc: Exception) -> None:
        """Drops the handle after a read failed; the next ``get`` waits out the retry."""
        log.info("direct index read failed, back to gRPC lookups for a while: %s", exc)
        with self._lock:
            self._drop()
            self._next_try = time.monotonic() + DIRECT_RETRY_S

    def _drop(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(Exception):
                reader.close()

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._next_try = float("inf")


@functools.lru_cache(maxsize=4096)
def _tenant_id(tenant: str) -> bytes:
    return tenant_bytes(tenant)


def _new_block(b: BlockData, codec: Codec, stored: bytes | memoryview) -> pb.NewBlock:
    arr = b.array
    return pb.NewBlock(
        key=b.key,
        parent=b.parent,
        info=pb.BlockInfo(
            dtype=b.dtype or dtype_name(arr),
            shape=list(arr.shape),
            codec=int(codec),  # type: ignore[arg-type]
            raw_bytes=arr.nbytes,
            stored_bytes=len(memoryview(stored).cast("B")),
        ),
    )


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
        self.target = f"unix:{socket_path}" if socket_path else str(target)
        self.timeout_s = timeout_s
        self.codec = codec if codec is not None else CodecPolicy()
        self._channel = grpc.insecure_channel(self.target, options=_OPTIONS)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._segments = MappedSegments(Path(data_dir)) if data_dir else None
        self._index = _DirectIndex(Path(data_dir) / "index") if data_dir else None
        self._connected = False
        self._long_timeout_s = timeout_s * 20
        self._shared: bool | None = None  # the daemon has a shared tier (None: not asked)
        self._shared_asked = 0.0
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-hash")
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-verify")

    def _ready(self) -> None:
        """Connects with one health check under a longer deadline, once.

        Connection setup is not a lookup's cost: without this, the first call of a
        new client spends its whole (short) deadline connecting on a busy machine.
        A daemon that is down fails at once (the socket refuses), not after a wait.
        No connectivity subscription: its polling thread outlives ``close()``.
        """
        if self._connected:
            return
        try:
            self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=max(2.0, 4 * self.timeout_s)
            )
        except grpc.RpcError as exc:
            raise wrap_rpc_error(exc) from exc
        self._connected = True

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
                found = reader.leading(_tenant_id(tenant), keys)
            except lmdb.Error as exc:
                assert self._index is not None
                self._index.failed(exc)
            else:
                if found == len(keys) or not self.has_shared_tier():
                    return LookupAnswer(found, direct=True)
        self._ready()
        request = pb.LookupRequest(tenant=tenant, keys=list(keys), block_tokens=block_tokens)
        resp = _call(self._stub.Lookup, request, self.timeout_s)
        remote = int(resp.remote_blocks)
        return LookupAnswer(int(resp.hit_blocks) + remote, direct=False, remote=remote)

    def has_shared_tier(self) -> bool:
        """Whether the daemon has a shared tier (asked once per ``SHARED_RECHECK_S``;
        a daemon that does not answer counts as without one)."""
        now = time.monotonic()
        if self._shared is None or now - self._shared_asked > SHARED_RECHECK_S:
            self._shared_asked = now
            try:
                self._ready()
                self._shared = bool(self.stats().shared_tier)
            except SidecarError as exc:
                log.debug("could not ask the daemon about its shared tier: %s", exc)
                self._shared = False
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
        self._ready()
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
        timeout = self._long_timeout_s if fetch else self.timeout_s
        resp: pb.LeaseResponse = _call(self._stub.Lease, request, timeout)
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
            return self._load_streaming(tenant, keys, bool(verify))
        assert self._segments is not None
        out = LoadedBlocks([], [], resp.lease_id, self._release)
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
            self._report_corrupt(corrupt)
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
                self._report_corrupt([loaded.keys[c.index]])
                return c.index
        return len(loaded.arrays)

    def _report_corrupt(self, keys: list[bytes]) -> None:
        try:
            self._stub.Release(pb.ReleaseRequest(corrupt_keys=keys), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            log.debug("could not report a corrupt block: %s", exc)

    def _release(self, lease_id: str) -> None:
        self._stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=self.timeout_s)

    def _load_streaming(self, tenant: str, keys: Sequence[bytes], verify: bool) -> LoadedBlocks:
        out = LoadedBlocks([], [])
        for key in keys:
            arr = self.get(tenant, key, verify=verify)
            if arr is None:
                break
            out.keys.append(key)
            out.arrays.append(arr)
        return out

    def get(self, tenant: str, key: bytes, *, verify: bool = True) -> np.ndarray | None:
        """One block's array over streaming Get (a copy), or None on a miss."""
        try:
            chunks = self._stub.Get(
                pb.GetRequest(tenant=tenant, key=key), timeout=self._long_timeout_s
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

    # -- writes

    def store(
        self,
        tenant: str,
        blocks: Sequence[BlockData],
        *,
        compress: bool | None = None,
        codec: Codec | None = None,
        level: int | None = None,
    ) -> int:
        """Stores blocks; returns how many were newly stored.

        Args:
            compress: True forces zstd, False forces raw, None lets the codec
                policy sample each block.
            codec: this codec for every block (overrides ``compress``); a lossy
                one (int8) only under keys whose fingerprint names it.
            level: zstd level (None: the policy's, adapted to its speed budget).
        """
        if not blocks:
            return 0
        self._ready()
        encoded = [self._encode(b, compress, codec, level) for b in blocks]
        if self._segments is None:
            return sum(
                self._put(tenant, b, codec, data)
                for b, (codec, data) in zip(blocks, encoded, strict=True)
            )
        request = pb.AllocateRequest(
            tenant=tenant,
            blocks=[_new_block(b, c, d) for b, (c, d) in zip(blocks, encoded, strict=True)],
        )
        resp = _call(self._stub.Allocate, request, self._long_timeout_s)
        writes: list[pb.Written] = []
        # Hash on a second thread while this one writes: pwrite releases the GIL,
        # so the checksum costs (almost) nothing on top of the write.
        todo = [(slot, data) for slot, (_, data) in zip(resp.slots, encoded, strict=False)]
        sums = [self._hasher.submit(checksum, data) for slot, data in todo if not slot.exists]
        sums.reverse()
        try:
            for slot, data in todo:
                if slot.exists:
                    continue
                self._segments.write(slot.segment, slot.offset, data)
                # Send what we meant to write: without it the daemon checksums whatever
                # is on disk, so a late write by a writer whose reservation of the same
                # extent expired (or a writer of a previous daemon) would be published
                # under our key with a matching checksum (test_concurrency.py).
                writes.append(pb.Written(write_id=slot.write_id, checksum=sums.pop().result()))
        except (OSError, SidecarError) as exc:
            ids = [s.write_id for s in resp.slots if not s.exists]
            with contextlib.suppress(grpc.RpcError):
                self._stub.Abort(pb.AbortRequest(write_ids=ids), timeout=self.timeout_s)
            raise SidecarError(f"writing a block failed: {exc}") from exc
        if not writes:
            return 0
        result = _call(self._stub.Commit, pb.CommitRequest(writes=writes), self._long_timeout_s)
        return sum(1 for r in result.results if r == pb.COMMIT_OK)

    def _encode(
        self, b: BlockData, compress: bool | None, codec: Codec | None, level: int | None
    ) -> tuple[Codec, bytes | memoryview]:
        if codec is None:
            if compress is None:
                codec = self.codec.choose(b.array)
            else:
                codec = Codec.ZSTD_SHUFFLE if compress else Codec.RAW
        return codec, self.codec.encode(b.array, codec, dtype=b.dtype, level=level)

    def _put(self, tenant: str, b: BlockData, codec: Codec, data: bytes | memoryview) -> int:
        block = _new_block(b, codec, data)
        block.info.checksum = checksum(data)
        view = memoryview(data).cast("B")

        def chunks() -> Iterator[pb.PutChunk]:
            yield pb.PutChunk(
                header=pb.PutHeader(tenant=tenant, block=block), data=bytes(view[:_CHUNK])
            )
            for start in range(_CHUNK, len(view), _CHUNK):
                yield pb.PutChunk(data=bytes(view[start : start + _CHUNK]))

        resp = _call(self._stub.Put, chunks(), self._long_timeout_s)
        return 1 if resp.stored else 0

    # -- admin

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Removes blocks (and their cached descendants); returns how many."""
        request = pb.DeleteRequest(tenant=tenant, keys=list(keys))
        return int(_call(self._stub.Delete, request, self._long_timeout_s).deleted)

    def clear_tenant(self, tenant: str) -> int:
        """Removes every block of ``tenant``; returns how many."""
        request = pb.ClearTenantRequest(tenant=tenant)
        return int(_call(self._stub.ClearTenant, request, self._long_timeout_s).deleted)

    def stats(self) -> pb.StatsResponse:
        """The daemon's totals (blocks, bytes, leases, evictions, checksum failures)."""
        resp: pb.StatsResponse = _call(self._stub.Stats, pb.StatsRequest(), self.timeout_s * 4)
        return resp

    def healthy(self) -> bool:
        """True when the daemon answers its health check as SERVING."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        self._hasher.shutdown(wait=False)
        self._verifier.shutdown(wait=False)
        if self._index is not None:
            self._index.close()
        self._channel.close()
        if self._segments is not None:
            self._segments.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
