"""The sidecar over real gRPC with real LMDB and segment files: what a client sees."""

from __future__ import annotations

import os
import stat
import urllib.request
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from dscache_sidecar.client import (
    BlockData,
    Codec,
    Encoding,
    SidecarClient,
    SidecarFullError,
    SidecarRejectedError,
)
from dscache_sidecar.codec import int8_stored_bytes
from dscache_sidecar.segments import extent_bytes
from sidecar_helpers import (
    BLOCK_SHAPE,
    Sidecar,
    block_array,
    blocks_for,
    chain,
    prompt,
    store_chain,
)

from dscache.v1 import kvcache_pb2 as pb
from dscache.v1 import kvcache_pb2_grpc as pb_grpc


def test_store_lookup_load_round_trip_is_zero_copy(sidecar: Sidecar) -> None:
    ch = chain()
    keys = ch.keys(prompt(6, seed=1))
    assert sidecar.c.store(ch.tenant, blocks_for(keys)) == 6
    assert sidecar.c.lookup(ch.tenant, keys) == 6
    assert sidecar.c.lookup(ch.tenant, keys[:3] + [b"\x01" * 32] + keys[4:]) == 3
    with sidecar.c.load(ch.tenant, keys, block_tokens=16) as loaded:
        assert loaded.keys == keys
        for key, arr in zip(keys, loaded.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))
            assert not arr.flags.writeable  # a read-only view on the mapping
            assert not arr.flags.owndata
    # storing again is a no-op: the keys exist
    assert sidecar.c.store(ch.tenant, blocks_for(keys)) == 0
    assert sidecar.metric("dscache_sidecar_lookup_tokens_total", op="lease", result="hit") == 96


def test_streaming_put_and_get_for_clients_without_the_volume(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sidecar = make_sidecar(capacity_bytes=8 * 1024 * 1024, segment_bytes=4 * 1024 * 1024)
    assert sidecar.running is not None
    remote = SidecarClient(sidecar.running.socket_path)  # no data_dir: Put/Get
    try:
        ch = chain()
        keys = ch.keys(prompt(3, seed=2))
        big = [BlockData(k, b"", block_array(k, (4, 64, 1024))) for k in keys[:1]]  # 1 MiB > chunk
        assert remote.store(ch.tenant, big) == 1
        assert remote.store(ch.tenant, blocks_for(keys)[1:]) == 2
        np.testing.assert_array_equal(
            remote.get(ch.tenant, keys[0]), block_array(keys[0], (4, 64, 1024))
        )
        with remote.load(ch.tenant, keys) as loaded:
            assert len(loaded) == 3
            np.testing.assert_array_equal(loaded.arrays[2], block_array(keys[2]))
        assert remote.get(ch.tenant, b"\x02" * 32) is None  # a miss is a normal answer
    finally:
        remote.close()


def test_compressed_blocks_are_decoded_by_the_reader(sidecar: Sidecar) -> None:
    ch = chain()
    keys = ch.keys(prompt(2, seed=3))
    smooth = [
        np.repeat(np.linspace(0, 1, 64, dtype=np.float32), 512).reshape(2, 2, 2, 16, 256)
        for _ in keys
    ]
    blocks = [
        BlockData(k, keys[i - 1] if i else b"", a)
        for i, (k, a) in enumerate(zip(keys, smooth, strict=True))
    ]
    assert sidecar.c.store(ch.tenant, blocks, Encoding(Codec.ZSTD_SHUFFLE)) == 2
    st = sidecar.c.stats()
    assert st.stored_payload_bytes < st.stored_raw_bytes / 4
    with sidecar.c.load(ch.tenant, keys) as loaded:
        for arr, want in zip(loaded.arrays, smooth, strict=True):
            np.testing.assert_array_equal(arr, want)


def test_lookup_has_no_side_effects_but_lease_counts_as_use(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    # a 4 KiB block + its 128 B header takes an 8 KiB extent: room for exactly 8 blocks
    sc = make_sidecar(
        capacity_bytes=64 * 1024,
        segment_bytes=64 * 1024,
        policy="lru",
        high_watermark=1.0,
        low_watermark=1.0,
    )
    ch = chain()
    old = ch.keys(prompt(4, seed=10))
    sc.c.store(ch.tenant, blocks_for(old))
    hot = ch.keys(prompt(4, seed=11))
    sc.c.store(ch.tenant, blocks_for(hot))
    # Lookups of `old` must not refresh it: it stays the least recently used
    for _ in range(5):
        assert sc.c.lookup(ch.tenant, old) == 4
    new = ch.keys(prompt(4, seed=12))
    sc.c.store(ch.tenant, blocks_for(new))
    assert sc.c.lookup(ch.tenant, old) == 0, "lookup refreshed LRU order"
    assert sc.c.lookup(ch.tenant, hot) == 4
    # now lease `hot` so it becomes recent; the next writer evicts `new` instead
    sc.c.load(ch.tenant, hot).release()
    sc.c.store(ch.tenant, blocks_for(ch.keys(prompt(4, seed=13))))
    assert sc.c.lookup(ch.tenant, hot) == 4
    assert sc.c.lookup(ch.tenant, new) == 0
    assert sc.metric("dscache_sidecar_evictions_total", reason="capacity") >= 8


def test_eviction_takes_children_before_or_with_their_parents(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(capacity_bytes=64 * 1024 * 2, segment_bytes=64 * 1024 * 2, policy="lru")
    ch = chain()
    for seed in range(40):  # far more than fits
        keys = ch.keys(prompt(5, seed=100 + seed))
        sc.c.store(ch.tenant, blocks_for(keys))
        sc.c.load(ch.tenant, keys).release()
    store = sc.store
    for key in store.keys():
        rec = store.record(key)
        assert rec is not None
        assert not rec.parent or store.record(rec.parent) is not None, "orphan child kept"
    used = sc.c.stats().used_bytes
    assert used <= 64 * 1024 * 2


def test_tenant_isolation_and_clear_tenant(sidecar: Sidecar) -> None:
    a, b = chain("bank-a"), chain("bank-b")
    toks = prompt(4, seed=5)
    ka, kb = a.keys(toks), b.keys(toks)
    sidecar.c.store(a.tenant, blocks_for(ka))
    assert sidecar.c.lookup(b.tenant, kb) == 0
    # even with A's keys in hand, B's tenant sees nothing
    assert sidecar.c.lookup(b.tenant, ka) == 0
    assert len(sidecar.c.load(b.tenant, ka)) == 0
    assert sidecar.c.get(b.tenant, ka[0]) is None
    assert sidecar.c.delete(b.tenant, ka) == 0
    sidecar.c.store(b.tenant, blocks_for(kb))
    assert sidecar.c.clear_tenant(a.tenant) == 4
    assert sidecar.c.lookup(a.tenant, ka) == 0
    assert sidecar.c.lookup(b.tenant, kb) == 4
    assert sidecar.metric("dscache_sidecar_evictions_total", reason="tenant_clear") == 4


def test_delete_removes_descendants_too(sidecar: Sidecar) -> None:
    tenant, keys = store_chain(sidecar.c, 5, seed=6)
    assert sidecar.c.delete(tenant, [keys[2]]) == 3
    assert sidecar.c.lookup(tenant, keys) == 2
    assert sidecar.metric("dscache_sidecar_evictions_total", reason="cascade") == 2


def with_tokens(keys: list[bytes], tokens: list[int], bt: int) -> list[BlockData]:
    return [
        BlockData(k, keys[i - 1] if i else b"", block_array(k), None, tokens[i * bt : (i + 1) * bt])
        for i, k in enumerate(keys)
    ]


def test_descendants_list_a_tenants_blocks_with_their_tokens_across_a_restart(
    sidecar: Sidecar,
) -> None:
    """What a server that did not write a conversation needs to follow its stored
    tokenization: the blocks under a block, with their token ids, breadth first;
    another tenant sees nothing, and blocks stored without ids are left out."""
    ch = chain()
    bt = ch.block_tokens
    trunk = prompt(2, seed=21)
    left, right = trunk + prompt(2, seed=22), trunk + prompt(1, seed=23)
    keys_l, keys_r = ch.keys(left), ch.keys(right)
    assert sidecar.c.store(ch.tenant, with_tokens(keys_l, left, bt)) == 4
    assert sidecar.c.store(ch.tenant, with_tokens(keys_r, right, bt)) == 1
    silent = trunk + prompt(1, seed=24)  # stored without its token ids
    keys_s = ch.keys(silent)
    assert sidecar.c.store(ch.tenant, blocks_for(keys_s)[2:]) == 1
    sidecar.restart()  # the ids live in the index: they survive the daemon

    blocks, cut = sidecar.c.descendants(ch.tenant, keys_l[1])
    assert not cut
    assert {b.key for b in blocks} == {keys_l[2], keys_l[3], keys_r[2]}
    assert blocks[-1].key == keys_l[3] and blocks[-1].parent == keys_l[2]  # parents first
    for b in blocks:
        i = (keys_l + keys_r).index(b.key)
        ids = (left if i < 4 else right)[(i % 4) * bt : (i % 4 + 1) * bt]
        assert np.frombuffer(b.tokens, dtype="<u4").tolist() == ids
    first, cut = sidecar.c.descendants(ch.tenant, keys_l[1], max_blocks=2)
    assert cut and [b.key for b in first] == [b.key for b in blocks[:2]]
    # Told which first tokens can follow, only those blocks under the key (and below).
    mine, _ = sidecar.c.descendants(ch.tenant, keys_l[1], first_tokens=[left[2 * bt], 7])
    assert [b.key for b in mine] == keys_l[2:]
    assert sidecar.c.descendants(ch.tenant, keys_l[3]) == ([], False)  # a leaf
    other = chain("tenant-b")
    assert sidecar.c.descendants(other.tenant, keys_l[1]) == ([], False)
    assert sidecar.c.descendants(ch.tenant, b"\x07" * 32) == ([], False)
    with pytest.raises(SidecarRejectedError):
        sidecar.c.descendants(ch.tenant, b"short")


def test_index_survives_a_restart(sidecar: Sidecar) -> None:
    tenant, keys = store_chain(sidecar.c, 6, seed=7)
    sidecar.restart()
    assert sidecar.c.lookup(tenant, keys) == 6
    with sidecar.c.load(tenant, keys) as loaded:
        for key, arr in zip(keys, loaded.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))
    assert sidecar.metric("dscache_sidecar_checksum_failures_total", where="start") == 0


def test_an_index_from_before_loses_its_dead_tenants_table_and_keeps_its_blocks(
    sidecar: Sidecar,
) -> None:
    """Earlier releases kept a ``tenants`` table (written on every commit and delete,
    read by nothing); an index that has one opens with every block and without it."""
    import lmdb

    tenant, keys = store_chain(sidecar.c, 4, seed=8)
    sidecar.stop()
    env = lmdb.open(str(sidecar.data_dir / "index"), max_dbs=8, subdir=True)
    old = env.open_db(b"tenants", dupsort=True)
    with env.begin(write=True) as txn:
        for key in keys:
            txn.put(b"t" * 16, key, db=old, dupdata=True)
    env.close()
    sidecar.start()
    assert sidecar.c.lookup(tenant, keys) == 4
    sidecar.stop()
    env = lmdb.open(str(sidecar.data_dir / "index"), max_dbs=8, subdir=True, readonly=True)
    with pytest.raises(lmdb.NotFoundError):
        env.open_db(b"tenants", create=False)
    env.close()
    sidecar.start()


def test_restart_quarantine_keeps_old_space_from_reuse(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(restart_quarantine_s=60)
    ch = chain()
    sc.c.store(ch.tenant, blocks_for(ch.keys(prompt(2, seed=8))))
    sc.restart()
    with pytest.raises(SidecarFullError, match="quarantine"):
        sc.c.store(ch.tenant, blocks_for(ch.keys(prompt(2, seed=9))))
    assert sc.c.lookup(ch.tenant, ch.keys(prompt(2, seed=8))) == 2  # reads go on


def test_unix_socket_is_private_and_health_is_served(sidecar: Sidecar) -> None:
    assert sidecar.running is not None
    mode = stat.S_IMODE(os.stat(sidecar.running.socket_path).st_mode)
    assert mode == 0o600
    assert sidecar.c.healthy()


def _stub(sidecar: Sidecar) -> pb_grpc.KVCacheStub:
    assert sidecar.running is not None
    return pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix:{sidecar.running.socket_path}"))


def _one_block(
    dtype: str,
    shape: list[int],
    raw: int,
    stored: int,
    key: bytes = b"k" * 32,
    tenant: str = "t",
    codec: int = pb.CODEC_RAW,
) -> pb.AllocateRequest:
    """An Allocate request for one block."""
    info = pb.BlockInfo(
        dtype=dtype,
        shape=shape,
        raw_bytes=raw,
        stored_bytes=stored,
        codec=codec,  # type: ignore[arg-type]
    )
    return pb.AllocateRequest(tenant=tenant, blocks=[pb.NewBlock(key=key, info=info)])


def _reserve(stub: pb_grpc.KVCacheStub, tenant: str, key: bytes) -> pb.Slot:
    """Reserves space for the test block of ``key``; returns its slot."""
    n = block_array(key).nbytes
    return stub.Allocate(_one_block("float32", list(BLOCK_SHAPE), n, n, key, tenant)).slots[0]


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.Lookup(pb.LookupRequest(tenant="t", keys=[b"short"])),
        lambda s: s.Lease(pb.LeaseRequest(tenant="t" * 1000, keys=[])),
        # raw bytes that do not match stored_bytes, an unknown dtype, a block too large
        lambda s: s.Allocate(_one_block("float32", [4], 16, 99)),
        lambda s: s.Allocate(_one_block("complex", [4], 16, 16)),
        lambda s: s.Allocate(_one_block("float32", [1 << 30], 1 << 32, 1 << 32)),
        # int8 blocks: stored bytes other than one per element + a scale per row;
        # an integer block (the codec quantizes floats only)
        lambda s: s.Allocate(_one_block("float32", [4, 8], 128, 32, codec=pb.CODEC_INT8_ROWS)),
        lambda s: s.Allocate(_one_block("uint8", [4, 8], 32, 40, codec=pb.CODEC_INT8_ROWS)),
        lambda s: s.Put(iter([pb.PutChunk(data=b"no header")])),
    ],
)
def test_malformed_requests_are_invalid_argument_and_the_daemon_keeps_serving(
    sidecar: Sidecar, call: Callable[[pb_grpc.KVCacheStub], object]
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call(_stub(sidecar))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    store_chain(sidecar.c, 1, seed=20)  # the daemon still serves writes
    assert sidecar.running is not None
    errors = [
        sample.value
        for metric in sidecar.running.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "dscache_sidecar_rpc_errors_total"
        and sample.labels["code"] == "INVALID_ARGUMENT"
    ]
    assert sum(errors) == 1


def test_unknown_write_ids_expire_and_abort_frees_space(sidecar: Sidecar) -> None:
    stub = _stub(sidecar)
    res = stub.Commit(pb.CommitRequest(writes=[pb.Written(write_id="nope")]))
    assert list(res.results) == [pb.COMMIT_EXPIRED]
    ch = chain()
    key = ch.keys(prompt(1, seed=21))[0]
    slot = _reserve(stub, ch.tenant, key)
    assert sidecar.c.stats().pending_writes == 1
    assert stub.Abort(pb.AbortRequest(write_ids=[slot.write_id])).aborted == 1
    st = sidecar.c.stats()
    assert st.pending_writes == 0 and st.used_bytes == 0


def test_a_wrong_client_checksum_is_rejected_at_commit(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sidecar = make_sidecar(verify_commits=True)
    stub = _stub(sidecar)
    ch = chain()
    key = ch.keys(prompt(1, seed=22))[0]
    arr = block_array(key)
    slot = _reserve(stub, ch.tenant, key)
    with open(sidecar.data_dir / slot.segment, "r+b") as f:
        f.seek(slot.offset)
        f.write(arr.tobytes())
    res = stub.Commit(pb.CommitRequest(writes=[pb.Written(write_id=slot.write_id, checksum=12345)]))
    assert list(res.results) == [pb.COMMIT_CHECKSUM_MISMATCH]
    assert sidecar.c.lookup(ch.tenant, [key]) == 0
    assert sidecar.metric("dscache_sidecar_checksum_failures_total", where="commit") == 1


def test_metrics_endpoint_serves_prometheus_text(sidecar: Sidecar) -> None:
    tenant, keys = store_chain(sidecar.c, 3, seed=23)
    sidecar.c.lookup(tenant, keys)
    assert sidecar.running is not None
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{sidecar.running.metrics_port}/metrics")
        .read()
        .decode()
    )
    assert 'dscache_sidecar_lookup_blocks_total{op="lookup",result="hit"} 3.0' in body
    assert "dscache_sidecar_blocks 3.0" in body
    assert "dscache_sidecar_rpc_duration_seconds_bucket" in body
    assert "dscache_sidecar_compression_ratio" in body


@pytest.mark.parametrize("volume", [True, False], ids=["allocate-commit", "put-get"])
def test_int8_blocks_store_a_quarter_and_load_dequantized(sidecar: Sidecar, volume: bool) -> None:
    assert sidecar.running is not None
    client = sidecar.c if volume else SidecarClient(sidecar.running.socket_path)
    try:
        ch = chain()
        keys = ch.keys(prompt(3, seed=31))
        shape = (2, 2, 2, 64, 64)  # 64 KiB of float32 per block
        blocks = blocks_for(keys, shape)
        assert client.store(ch.tenant, blocks, Encoding(Codec.INT8_ROWS)) == 3
        with client.load(ch.tenant, keys, block_tokens=16) as loaded:
            assert len(loaded.arrays) == 3
            for b, arr in zip(blocks, loaded.arrays, strict=True):
                assert arr.dtype == np.float32 and arr.shape == shape
                step = np.abs(b.array).max(axis=-1, keepdims=True) / 127
                assert (np.abs(arr - b.array) <= step * 0.51 + 1e-6).all()
                assert not np.array_equal(arr, b.array)  # lossy: not the exact bytes
        # On disk: int8 values + float16 row scales, not the float32 bytes.
        assert client.stats().used_bytes == 3 * extent_bytes(int8_stored_bytes(shape))
        assert 3 * extent_bytes(int8_stored_bytes(shape)) < 0.35 * 3 * blocks[0].array.nbytes
    finally:
        if client is not sidecar.c:
            client.close()
