"""Writes: blocks encoded by the codec policy, written in place, then published.

Contract:
    * With the shared volume, a store reserves space (Allocate), writes each payload
      in place with ``pwrite`` while a second thread checksums it, and publishes
      (Commit) with the checksum of what was meant to be written; a failed write
      aborts every reservation of the call. Without the volume, blocks are streamed
      (Put) instead.
    * Returns how many blocks were newly stored; blocks already stored count 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from dscache.v1 import kvcache_pb2 as pb
from dscache_sidecar.client.rpc import Connection, call
from dscache_sidecar.codec import Codec, CodecPolicy, Encoding, dtype_name
from dscache_sidecar.errors import SidecarError
from dscache_sidecar.mapped import MappedSegments
from dscache_sidecar.segments import checksum

_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class BlockData:
    """One block to store: its key, its parent's key (b"" for block 0), its array.

    ``dtype`` overrides the contract dtype name (needed for bfloat16, which numpy
    carries as uint16). ``token_ids`` are the block's own tokens: optional, the
    daemon only names the block by them in its KV events.
    """

    key: bytes
    parent: bytes
    array: np.ndarray
    dtype: str | None = None
    token_ids: Sequence[int] = ()


def _new_block(b: BlockData, codec: Codec, stored: bytes | memoryview) -> pb.NewBlock:
    arr = b.array
    return pb.NewBlock(
        key=b.key,
        parent=b.parent,
        token_ids=b.token_ids,
        info=pb.BlockInfo(
            dtype=b.dtype or dtype_name(arr),
            shape=list(arr.shape),
            codec=int(codec),  # type: ignore[arg-type]
            raw_bytes=arr.nbytes,
            stored_bytes=len(memoryview(stored).cast("B")),
        ),
    )


class BlockWriter:
    """Encodes and stores blocks.

    Args:
        conn: the connection to the daemon (Allocate, Commit, Abort, Put).
        segments: the mapped segment files; None without the shared volume.
        codec: how new blocks are encoded.
    """

    def __init__(
        self, conn: Connection, segments: MappedSegments | None, codec: CodecPolicy
    ) -> None:
        self._conn = conn
        self._segments = segments
        self.codec = codec
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-hash")

    def store(
        self,
        tenant: str,
        blocks: Sequence[BlockData],
        encoding: Encoding,
    ) -> int:
        """Stores blocks (see ``SidecarClient.store``); returns how many were new."""
        if not blocks:
            return 0
        self._conn.ready()
        encoded = [self._encode(b, encoding) for b in blocks]
        if self._segments is None:
            return sum(
                self._put(tenant, b, codec, data)
                for b, (codec, data) in zip(blocks, encoded, strict=True)
            )
        stub, long_s = self._conn.stub, self._conn.long_timeout_s
        request = pb.AllocateRequest(
            tenant=tenant,
            blocks=[_new_block(b, c, d) for b, (c, d) in zip(blocks, encoded, strict=True)],
        )
        resp = call(stub.Allocate, request, long_s)
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
                stub.Abort(pb.AbortRequest(write_ids=ids), timeout=self._conn.timeout_s)
            raise SidecarError(f"writing a block failed: {exc}") from exc
        if not writes:
            return 0
        result = call(stub.Commit, pb.CommitRequest(writes=writes), long_s)
        return sum(1 for r in result.results if r == pb.COMMIT_OK)

    def _encode(self, b: BlockData, encoding: Encoding) -> tuple[Codec, bytes | memoryview]:
        codec = encoding.codec if encoding.codec is not None else self.codec.choose(b.array)
        return codec, self.codec.encode(b.array, codec, dtype=b.dtype, level=encoding.level)

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

        resp = call(self._conn.stub.Put, chunks(), self._conn.long_timeout_s)
        return 1 if resp.stored else 0

    def close(self) -> None:
        self._hasher.shutdown(wait=False)
