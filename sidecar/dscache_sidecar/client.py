"""Sync and async clients of the sidecar, with zero-copy reads through mmap.

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
    * Every failure of the cache surfaces as ``SidecarError`` (or a subclass):
      callers treat it as a miss and recompute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import grpc.aio
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dscache.v1 import kvcache_pb2 as pb
from dscache.v1 import kvcache_pb2_grpc as pb_grpc
from dscache_sidecar.codec import Codec, CodecPolicy, decode, dtype_name
from dscache_sidecar.segments import checksum

log = logging.getLogger(__name__)

_CHUNK = 1024 * 1024
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
]


class SidecarError(Exception):
    """Any failure of the cache; callers fall back to recompute."""


class SidecarUnavailableError(SidecarError):
    """The daemon did not answer (down, restarting, or slower than the timeout)."""


class SidecarFullError(SidecarError):
    """The store could not make room (RESOURCE_EXHAUSTED)."""


class SidecarRejectedError(SidecarError):
    """The daemon rejected the request as malformed (INVALID_ARGUMENT)."""


def _wrap(exc: grpc.RpcError) -> SidecarError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    msg = f"{code.name if code else 'ERROR'}: {detail}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return SidecarUnavailableError(msg)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return SidecarFullError(msg)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return SidecarRejectedError(msg)
    return SidecarError(msg)


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

    def __len__(self) -> int:
        return len(self.arrays)

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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class _Segments:
    """Read-only mappings and write descriptors of segment files, opened once.

    Paths are resolved (and checked to stay inside the data directory) once per
    segment; the size check that guards against SIGBUS on a truncated file is one
    ``fstat`` of a kept descriptor per segment per load.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._root = data_dir.resolve()
        self._paths: dict[str, Path] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._ro_fds: dict[str, int] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, name: str) -> Path:
        path = self._paths.get(name)
        if path is None:
            path = (self.data_dir / name).resolve()
            if self._root not in path.parents:
                raise SidecarError(f"segment {name!r} is outside the data directory")
            self._paths[name] = path
        return path

    def _reader(self, name: str) -> tuple[int, mmap.mmap | None]:
        fd = self._ro_fds.get(name)
        if fd is None:
            fd = os.open(self._path(name), os.O_RDONLY)
            self._ro_fds[name] = fd
        return fd, self._maps.get(name)

    def size(self, name: str) -> int:
        """Current size of a segment file."""
        with self._lock:
            fd, _ = self._reader(name)
        try:
            return os.fstat(fd).st_size
        except OSError as exc:
            raise SidecarError(f"segment {name} unreadable: {exc}") from exc

    def view(
        self, name: str, offset: int, length: int, sizes: dict[str, int] | None = None
    ) -> memoryview:
        """A zero-copy view of ``length`` bytes at ``offset``; SidecarError if out of file.

        ``sizes`` caches file sizes for the duration of one load.
        """
        with self._lock:
            fd, m = self._reader(name)
            if m is not None and offset + length > len(m):
                # Mapped while the file was shorter (truncated, since extended again by
                # the daemon): map it anew, or the block stays unreadable for good.
                self._maps.pop(name)
                m = None
            if m is None:
                m = mmap.mmap(
                    fd,
                    os.fstat(fd).st_size,
                    prot=mmap.PROT_READ,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                )
                self._maps[name] = m
        # A truncated file would turn a read into SIGBUS: check before touching.
        if sizes is None:
            sizes = {}
        if name not in sizes:
            sizes[name] = self.size(name)
        if offset + length > min(sizes[name], len(m)):
            raise SidecarError(f"segment {name} is shorter than the block (truncated?)")
        return memoryview(m)[offset : offset + length]

    def write(self, name: str, offset: int, data: bytes | memoryview) -> None:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = os.open(self._path(name), os.O_WRONLY)
                self._fds[name] = fd
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                # Views still alive keep the mapping; it goes with them.
                with contextlib.suppress(BufferError):
                    m.close()
            self._maps.clear()
            for fd in (*self._fds.values(), *self._ro_fds.values()):
                os.close(fd)
            self._fds.clear()
            self._ro_fds.clear()


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
    segments: _Segments, loc: pb.BlockLocation, verify: bool, sizes: dict[str, int]
) -> np.ndarray | None:
    info = loc.info
    payload = segments.view(loc.segment, loc.offset, info.stored_bytes, sizes)
    if verify and checksum(payload) != info.checksum:
        return None
    arr = decode(payload, Codec(info.codec), info.dtype, tuple(info.shape))
    return arr


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
        self._segments = _Segments(Path(data_dir)) if data_dir else None
        self._connected = False
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-hash")

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
            raise _wrap(exc) from exc
        self._connected = True

    # -- reads

    def lookup(self, tenant: str, keys: Sequence[bytes], block_tokens: int = 0) -> int:
        """Number of leading keys stored; no side effects."""
        if not keys:
            return 0
        self._ready()
        try:
            resp = self._stub.Lookup(
                pb.LookupRequest(tenant=tenant, keys=list(keys), block_tokens=block_tokens),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        return int(resp.hit_blocks)

    def load(
        self,
        tenant: str,
        keys: Sequence[bytes],
        *,
        ttl_s: float = 30.0,
        verify: bool = True,
        block_tokens: int = 0,
    ) -> LoadedBlocks:
        """Leases and maps the leading stored blocks (streams them without data_dir)."""
        if not keys:
            return LoadedBlocks([], [])
        self._ready()
        if self._segments is None:
            return self._load_streaming(tenant, keys, verify)
        try:
            resp = self._stub.Lease(
                pb.LeaseRequest(
                    tenant=tenant,
                    keys=list(keys),
                    ttl_ms=int(ttl_s * 1000),
                    block_tokens=block_tokens,
                ),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        out = LoadedBlocks([], [], resp.lease_id, self._release)
        corrupt: list[bytes] = []
        sizes: dict[str, int] = {}
        try:
            for loc in resp.blocks:
                try:
                    arr = _decode_location(self._segments, loc, verify, sizes)
                except (SidecarError, ValueError) as exc:
                    log.warning("cached block unreadable, treated as a miss: %s", exc)
                    arr = None
                if arr is None:
                    corrupt.append(bytes(loc.key))
                    break
                out.keys.append(bytes(loc.key))
                out.arrays.append(arr)
        except BaseException:
            out.release()
            raise
        if corrupt:
            self._report_corrupt(corrupt)
        return out

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
                pb.GetRequest(tenant=tenant, key=key), timeout=self.timeout_s * 20
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
            raise _wrap(exc) from exc
        if first is None:
            return None
        info = first.info
        if verify and checksum(bytes(buf)) != info.checksum:
            return None
        return decode(bytes(buf), Codec(info.codec), info.dtype, tuple(info.shape)).copy()

    # -- writes

    def store(
        self, tenant: str, blocks: Sequence[BlockData], *, compress: bool | None = None
    ) -> int:
        """Stores blocks; returns how many were newly stored.

        Args:
            compress: True forces zstd, False forces raw, None lets the codec
                policy sample each block.
        """
        if not blocks:
            return 0
        self._ready()
        encoded = [self._encode(b, compress) for b in blocks]
        if self._segments is None:
            return sum(
                self._put(tenant, b, codec, data)
                for b, (codec, data) in zip(blocks, encoded, strict=True)
            )
        request = pb.AllocateRequest(
            tenant=tenant,
            blocks=[_new_block(b, c, d) for b, (c, d) in zip(blocks, encoded, strict=True)],
        )
        try:
            resp = self._stub.Allocate(request, timeout=self.timeout_s * 20)
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
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
        try:
            result = self._stub.Commit(pb.CommitRequest(writes=writes), timeout=self.timeout_s * 20)
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        return sum(1 for r in result.results if r == pb.COMMIT_OK)

    def _encode(self, b: BlockData, compress: bool | None) -> tuple[Codec, bytes | memoryview]:
        if compress is None:
            codec = self.codec.choose(b.array)
        else:
            codec = Codec.ZSTD_SHUFFLE if compress else Codec.RAW
        return codec, self.codec.encode(b.array, codec)

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

        try:
            resp = self._stub.Put(chunks(), timeout=self.timeout_s * 20)
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        return 1 if resp.stored else 0

    # -- admin

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        try:
            resp = self._stub.Delete(
                pb.DeleteRequest(tenant=tenant, keys=list(keys)), timeout=self.timeout_s * 20
            )
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        return int(resp.deleted)

    def clear_tenant(self, tenant: str) -> int:
        try:
            resp = self._stub.ClearTenant(
                pb.ClearTenantRequest(tenant=tenant), timeout=self.timeout_s * 20
            )
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        return int(resp.deleted)

    def stats(self) -> pb.StatsResponse:
        try:
            return self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s * 4)
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc

    def healthy(self) -> bool:
        """True when the daemon answers its health check as SERVING."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        self._hasher.shutdown(wait=False)
        self._channel.close()
        if self._segments is not None:
            self._segments.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSidecarClient:
    """asyncio client with the same methods and semantics as ``SidecarClient``.

    File I/O and hashing run in a worker thread so the event loop stays free.
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
        self._channel = grpc.aio.insecure_channel(self.target, options=_OPTIONS)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._segments = _Segments(Path(data_dir)) if data_dir else None
        # Streaming fallback and admin calls reuse the blocking client's logic.
        self._sync = SidecarClient(
            target=self.target.removeprefix("unix:") if not socket_path else None,
            socket_path=socket_path,
            data_dir=data_dir,
            timeout_s=timeout_s,
            codec=self.codec,
        )

    async def lookup(self, tenant: str, keys: Sequence[bytes], block_tokens: int = 0) -> int:
        if not keys:
            return 0
        try:
            resp = await self._stub.Lookup(
                pb.LookupRequest(tenant=tenant, keys=list(keys), block_tokens=block_tokens),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        return int(resp.hit_blocks)

    async def load(
        self,
        tenant: str,
        keys: Sequence[bytes],
        *,
        ttl_s: float = 30.0,
        verify: bool = True,
        block_tokens: int = 0,
    ) -> LoadedBlocks:
        if not keys:
            return LoadedBlocks([], [])
        if self._segments is None:
            return await asyncio.to_thread(self._sync._load_streaming, tenant, keys, verify)
        try:
            resp = await self._stub.Lease(
                pb.LeaseRequest(
                    tenant=tenant,
                    keys=list(keys),
                    ttl_ms=int(ttl_s * 1000),
                    block_tokens=block_tokens,
                ),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            raise _wrap(exc) from exc
        segments = self._segments

        def decode_all() -> tuple[list[bytes], list[np.ndarray], list[bytes]]:
            keys_out: list[bytes] = []
            arrays: list[np.ndarray] = []
            sizes: dict[str, int] = {}
            for loc in resp.blocks:
                try:
                    arr = _decode_location(segments, loc, verify, sizes)
                except (SidecarError, ValueError) as exc:
                    log.warning("cached block unreadable, treated as a miss: %s", exc)
                    arr = None
                if arr is None:
                    return keys_out, arrays, [bytes(loc.key)]
                keys_out.append(bytes(loc.key))
                arrays.append(arr)
            return keys_out, arrays, []

        keys_out, arrays, corrupt = await asyncio.to_thread(decode_all)
        if corrupt:
            await asyncio.to_thread(self._sync._report_corrupt, corrupt)
        return LoadedBlocks(keys_out, arrays, resp.lease_id, self._sync._release)

    async def store(
        self, tenant: str, blocks: Sequence[BlockData], *, compress: bool | None = None
    ) -> int:
        return await asyncio.to_thread(self._sync.store, tenant, blocks, compress=compress)

    async def get(self, tenant: str, key: bytes, *, verify: bool = True) -> np.ndarray | None:
        return await asyncio.to_thread(self._sync.get, tenant, key, verify=verify)

    async def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        return await asyncio.to_thread(self._sync.delete, tenant, keys)

    async def clear_tenant(self, tenant: str) -> int:
        return await asyncio.to_thread(self._sync.clear_tenant, tenant)

    async def stats(self) -> pb.StatsResponse:
        return await asyncio.to_thread(self._sync.stats)

    async def healthy(self) -> bool:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self._channel.close(None)
        self._sync.close()
