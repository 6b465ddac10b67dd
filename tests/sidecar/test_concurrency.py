"""Concurrency: eviction vs lease/read, put-vs-put of one key, Get vs Delete, a stampede.

Races are forced with the store's hooks (``store.set_hook``) and barriers, never
with sleeps. Blocks are 4 KiB (an 8 KiB extent); stores of 256 KiB hold 32 extents.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from dscache_sidecar.client import BlockData, SidecarClient, SidecarFullError
from sidecar_helpers import BLOCK_SHAPE, Sidecar, block_array, blocks_for, chain, prompt

from dscache.v1 import kvcache_pb2 as pb
from dscache.v1 import kvcache_pb2_grpc as pb_grpc

SMALL = {"capacity_bytes": 256 * 1024, "segment_bytes": 128 * 1024}
EXTENT = 8192
WAIT_S = 20  # upper bound on any barrier wait, so a bug hangs nothing


def extents(sc: Sidecar, keys: list[bytes]) -> set[tuple[int, int]]:
    recs = [sc.store.record(k) for k in keys]
    return {(r.segment, r.offset) for r in recs if r is not None}


def live_extents(sc: Sidecar) -> set[tuple[int, int]]:
    return extents(sc, sc.store.keys())


def assert_no_leaked_space(sc: Sidecar) -> None:
    """With no lease or reservation open, used space is exactly the live blocks' extents."""
    st = sc.c.stats()
    assert st.active_leases == 0 and st.pending_writes == 0
    live = sum(sc.store.record(k).extent_bytes for k in sc.store.keys())
    assert st.used_bytes == live, f"{st.used_bytes - live} bytes leaked"


@pytest.fixture
def sc(make_sidecar: Callable[..., Sidecar]) -> Sidecar:
    """A sidecar of 32 extents, with the default policy."""
    return make_sidecar(**SMALL)


def run_threads(target: Callable[[int], None], n: int, join_s: float = WAIT_S) -> None:
    """Runs ``target(0..n-1)`` on ``n`` threads at once and waits for them."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)


def fill_with_new_chains(sc: Sidecar, first_seed: int, n_chains: int) -> None:
    tenant = chain().tenant
    for seed in range(first_seed, first_seed + n_chains):
        keys = chain().keys(prompt(4, seed))
        assert sc.c.store(tenant, blocks_for(keys)) == 4


@pytest.mark.slow  # pushes 300 chains through a real sidecar: 3 s here
def test_leased_blocks_are_not_evicted_and_their_space_is_reused_after_release(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    # LRU, so "ages out after release" is exact (S3-FIFO may rightly keep hot blocks).
    sc = make_sidecar(policy="lru", **SMALL)
    ch = chain()
    hot = ch.keys(prompt(4, 1))
    sc.c.store(ch.tenant, blocks_for(hot))
    hot_extents = extents(sc, hot)
    loaded = sc.c.load(ch.tenant, hot)
    assert len(loaded) == 4
    # Writers push 4x the capacity through the store while the lease is held.
    fill_with_new_chains(sc, 100, 32)
    assert sc.c.stats().evicted_blocks >= 100
    assert sc.c.lookup(ch.tenant, hot) == 4, "a leased block was evicted"
    for key, arr in zip(hot, loaded.arrays, strict=True):
        np.testing.assert_array_equal(arr, block_array(key))
    assert not hot_extents & extents(sc, [k for k in sc.store.keys() if k not in hot])
    loaded.release()
    # Released, the blocks age out like any other and their extents are reused.
    fill_with_new_chains(sc, 200, 16)
    assert sc.c.lookup(ch.tenant, hot) == 0
    assert hot_extents & live_extents(sc), "space of released blocks was never reused"
    assert_no_leaked_space(sc)


def test_deleted_leased_block_keeps_its_bytes_until_release(sc: Sidecar) -> None:
    ch = chain()
    hot = ch.keys(prompt(4, 1))
    sc.c.store(ch.tenant, blocks_for(hot))
    hot_extents = extents(sc, hot)
    loaded = sc.c.load(ch.tenant, hot)
    assert sc.c.delete(ch.tenant, hot[:1]) == 4  # the root and its descendants
    assert sc.c.lookup(ch.tenant, hot) == 0
    fill_with_new_chains(sc, 100, 32)
    # The reader's views still show the right bytes: the extents were not reused.
    for key, arr in zip(hot, loaded.arrays, strict=True):
        np.testing.assert_array_equal(arr, block_array(key))
    assert not hot_extents & live_extents(sc)
    used_before = sc.c.stats().used_bytes
    loaded.release()
    assert sc.c.stats().used_bytes == used_before - 4 * EXTENT
    fill_with_new_chains(sc, 200, 16)
    assert hot_extents & live_extents(sc)
    assert_no_leaked_space(sc)


def test_two_writers_of_one_key_at_once_exactly_one_commit_wins(sc: Sidecar) -> None:
    ch = chain()
    key = ch.keys(prompt(1, 7))[0]
    versions = [block_array(key), -block_array(key)]
    both_verified = threading.Barrier(2, timeout=WAIT_S)
    sc.store.set_hook("commit.verified", both_verified.wait)
    results: list[Any] = [None, None]

    def write(i: int) -> None:
        with SidecarClient(sc.running.socket_path, data_dir=str(sc.data_dir)) as c:
            results[i] = c.store(ch.tenant, [BlockData(key, b"", versions[i])])

    run_threads(write, 2)
    sc.store.set_hook("commit.verified", None)
    assert sorted(results) == [0, 1], results
    winner = versions[results.index(1)]
    with sc.c.load(ch.tenant, [key]) as got:
        np.testing.assert_array_equal(got.arrays[0], winner)
    np.testing.assert_array_equal(sc.c.get(ch.tenant, key), winner)
    st = sc.c.stats()
    assert (st.blocks, st.used_bytes) == (1, EXTENT), "the losing writer's space leaked"
    assert_no_leaked_space(sc)


def test_get_racing_delete_and_rewrite_returns_consistent_bytes(sc: Sidecar) -> None:
    ch = chain()
    key = ch.keys(prompt(1, 3))[0]
    old, new = block_array(key), block_array(key) * 2
    sc.c.store(ch.tenant, [BlockData(key, b"", old)])
    loaded, proceed = threading.Event(), threading.Event()

    def pause() -> None:
        loaded.set()
        assert proceed.wait(WAIT_S)

    sc.store.set_hook("read.loaded", pause)
    streaming = SidecarClient(sc.running.socket_path, timeout_s=5)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(streaming.get(ch.tenant, key)))
    reader.start()
    try:
        assert loaded.wait(WAIT_S)
        sc.store.set_hook("read.loaded", None)
        assert sc.c.delete(ch.tenant, [key]) == 1
        assert sc.c.store(ch.tenant, [BlockData(key, b"", new)]) == 1
        fill_with_new_chains(sc, 100, 16)
    finally:
        proceed.set()
        reader.join(WAIT_S)
    # The in-flight Get returns the bytes it read (the old block, whole), never a mix.
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], old)
    after = streaming.get(ch.tenant, key)
    assert after is None or np.array_equal(after, new)
    streaming.close()
    assert_no_leaked_space(sc)


def test_late_write_of_an_expired_reservation_is_never_served(sc: Sidecar) -> None:
    """A writer whose reservation ran out writes late, into an extent that now
    belongs to another writer: that block must not be published with those bytes."""
    ch = chain()
    stale_key, key = ch.keys(prompt(2, 5))
    stale = block_array(stale_key)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(f"unix:{sc.running.socket_path}"))
    info = pb.BlockInfo(
        dtype="float32",
        shape=list(BLOCK_SHAPE),
        codec=pb.CODEC_RAW,
        raw_bytes=stale.nbytes,
        stored_bytes=stale.nbytes,
    )
    req = pb.AllocateRequest(tenant=ch.tenant, blocks=[pb.NewBlock(key=stale_key, info=info)])
    req.ttl_ms = 1
    slot = stub.Allocate(req).slots[0]
    deadline = time.monotonic() + WAIT_S
    while sc.store.expire()[1] == 0:  # the reservation runs out (1 ms)
        assert time.monotonic() < deadline

    assert sc.c._segments is not None
    segments = sc.c._segments
    real_write = segments.write

    def write_then_stale_write(name: str, offset: int, data: Any) -> None:
        real_write(name, offset, data)
        assert (name, offset) == (slot.segment, slot.offset)  # the freed extent, reused
        real_write(slot.segment, slot.offset, stale.tobytes())

    segments.write = write_then_stale_write  # type: ignore[method-assign]
    try:
        sc.c.store(ch.tenant, [BlockData(key, b"", block_array(key))])
    finally:
        segments.write = real_write  # type: ignore[method-assign]
    # Whether the commit was refused (verify_commits) or published with the writer's
    # checksum, no reader gets the stale bytes: the block is a miss and is dropped.
    with sc.c.load(ch.tenant, [key]) as got:
        assert got.arrays == []
    assert sc.c.get(ch.tenant, key) is None
    assert sc.c.lookup(ch.tenant, [key]) == 0
    assert sc.c.store(ch.tenant, [BlockData(key, b"", block_array(key))]) == 1
    with sc.c.load(ch.tenant, [key]) as got:
        np.testing.assert_array_equal(got.arrays[0], block_array(key))
    assert_no_leaked_space(sc)


@pytest.mark.slow
def test_many_threads_lookup_load_store_get_at_once(sc: Sidecar) -> None:
    ch = chain()
    chains = [ch.keys(prompt(4, seed)) for seed in range(24)]  # 96 blocks, 32 fit
    stop = time.monotonic() + 3.0
    errors: list[BaseException] = []
    counts = {"loaded": 0, "got": 0, "stored": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        streaming = seed == 3  # one of the four streams over Get instead of mapping
        rnd = random.Random(seed)
        client = SidecarClient(
            sc.running.socket_path, data_dir=None if streaming else str(sc.data_dir), timeout_s=5
        )
        try:
            while time.monotonic() < stop:
                keys = rnd.choice(chains)
                n = rnd.randint(1, 4)
                try:
                    stored = client.store(ch.tenant, blocks_for(keys[:n]))
                except SidecarFullError:  # every extent leased or reserved: a normal answer
                    stored = 0
                hits = client.lookup(ch.tenant, keys)
                assert 0 <= hits <= 4
                with client.load(ch.tenant, keys) as got:
                    for key, arr in zip(got.keys, got.arrays, strict=True):
                        np.testing.assert_array_equal(arr, block_array(key))
                    assert got.keys == keys[: len(got)]
                with lock:
                    counts["stored"] += stored
                    counts["loaded" if not streaming else "got"] += len(got)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    run_threads(worker, 4, join_s=30)
    assert not errors, errors[0]
    assert counts["loaded"] > 50 and counts["got"] > 10 and counts["stored"] > 50, counts
    assert sc.c.stats().evicted_blocks > 0
    assert sc.metric("dscache_sidecar_rpc_errors_total", op="Commit", code="INTERNAL") == 0
    assert sc.c.stats().checksum_failures == 0
    assert_no_leaked_space(sc)
