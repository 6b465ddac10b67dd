"""The chain policy in the live store: real gRPC, LMDB and segment files, signals from a client.

Every test here starts an in-process sidecar, so each is marked slow.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from sidecar_helpers import Sidecar, blocks_for, chain, prompt

from dscache.v1 import kvcache_pb2 as pb
from dscache.v1 import kvcache_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

#: 16 blocks of 4 KiB (8 KiB extents) fit: two 64 KiB segments.
SMALL = {
    "capacity_bytes": 128 * 1024,
    "segment_bytes": 64 * 1024,
    "high_watermark": 1.0,
    "low_watermark": 1.0,
}


def stored_chain(sc: Sidecar, seed: int, n: int = 4) -> list[bytes]:
    ch = chain()
    keys = ch.keys(prompt(n, seed=seed))
    assert sc.c.store(ch.tenant, blocks_for(keys)) == n
    return keys


def assert_whole_prefixes(sc: Sidecar) -> None:
    store = sc.store
    for key in store.keys():
        rec = store.record(key)
        assert rec is not None
        assert not rec.parent or store.record(rec.parent) is not None, "a child outlived its parent"


def test_signals_from_a_client_decide_what_the_store_evicts(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(policy="chain", **SMALL)
    tenant = chain().tenant
    assert sc.c.stats().policy == "chain"
    a, b, c, d = (stored_chain(sc, seed) for seed in (1, 2, 3, 4))  # full: 16 blocks
    # b's session ended (the client said so); a's next request is queued.
    assert sc.c.signal(tenant, b, "ended") == 4
    assert sc.c.signal(tenant, a, "queued", ttl_ms=60_000) == 4
    e = stored_chain(sc, 5)  # room for 4: b goes, whole
    assert sc.c.lookup(tenant, b) == 0
    for keys in (a, c, d, e):
        assert sc.c.lookup(tenant, keys) == 4
    stored_chain(sc, 6)  # room for 4 more: never the queued chain
    assert sc.c.lookup(tenant, a) == 4
    assert sum(sc.c.lookup(tenant, k) for k in (c, d, e)) == 8
    assert_whole_prefixes(sc)
    assert sc.metric("dscache_sidecar_signals_total", kind="ended", result="marked") == 1
    assert sc.metric("dscache_sidecar_evictions_total", reason="capacity") >= 8


def test_chain_store_keeps_whole_prefixes_under_pressure(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(policy="chain", **SMALL)
    ch = chain()
    # Conversations: each turn extends the previous prompt; many more than fit.
    for conv in range(6):
        tokens = prompt(2, seed=200 + conv)
        for turn in range(3):
            tokens = tokens + prompt(1, seed=1000 * conv + turn)
            keys = ch.keys(tokens)
            sc.c.load(ch.tenant, keys).release()
            sc.c.store(ch.tenant, blocks_for(keys))
    assert_whole_prefixes(sc)
    assert sc.c.stats().used_bytes <= SMALL["capacity_bytes"]


def test_signals_reach_a_store_without_signal_support_harmlessly(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(policy="lru", **SMALL)
    tenant = chain().tenant
    keys = stored_chain(sc, 7)
    assert sc.c.signal(tenant, keys, "ended") == 0  # lru takes no signals
    assert sc.metric("dscache_sidecar_signals_total", kind="ended", result="unmarked") == 1
    assert sc.c.lookup(tenant, keys) == 4
    with pytest.raises(ValueError, match="unknown signal"):
        sc.c.signal(tenant, keys, "bye")
    assert sc.running is not None
    with grpc.insecure_channel(f"unix:{sc.running.socket_path}") as channel:
        stub = pb_grpc.KVCacheStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Signal(pb.SignalRequest(tenant=tenant, keys=keys), timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.Signal(
                pb.SignalRequest(tenant=tenant, keys=[b"short"], kind=pb.SIGNAL_SESSION_ENDED),
                timeout=10,
            )
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
