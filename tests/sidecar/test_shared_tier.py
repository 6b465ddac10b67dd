"""The shared tier on a real Redis Cluster (3 masters on loopback, Debian's redis-server).

Two in-process daemons with their own data directories play two pods on two nodes;
each has the same cluster behind it. What a user would notice: a session's prefix
follows it to the other pod, tenants never see each other's blocks, a corrupt
remote value is never served, and a dead or frozen cluster changes no answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
from dscache_sidecar.blockstore import tenant_bytes
from dscache_sidecar.sharedvalue import CorruptValueError
from dscache_tools.polling import wait_until
from dscache_tools.rediscluster import LocalRedisCluster
from needs import need_binary
from shared_helpers import UNSIGNED, pod, record, reuse, settle, tls_files
from sidecar_helpers import Sidecar, block_array, blocks_for, chain, prompt

from dscache.keys import tenant_salt


@pytest.mark.slow
def test_a_moved_session_finds_its_prefix_on_a_fresh_pod(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    a, b = pod(make_sidecar, shared), pod(make_sidecar, shared)
    ch = chain()
    keys = ch.keys(prompt(8, seed=1))
    # Turn 1 stores 6 blocks; turn 2 hits them and stores 2 more after them.
    assert a.c.store(ch.tenant, blocks_for(keys[:6])) == 6
    reuse(a, ch.tenant, keys[:6])
    assert a.c.store(ch.tenant, blocks_for(keys)[6:]) == 2
    settle(a)
    assert a.metric("dscache_sidecar_remote_blocks_total", op="push", result="ok") == 8

    # Turn 3 lands on pod b, whose disk has never seen this session.
    answer = b.c.find(ch.tenant, keys)
    assert (answer.found, answer.remote, answer.direct) == (8, 8, False)
    with b.c.load(ch.tenant, keys) as loaded:
        assert loaded.keys == keys
        assert loaded.verified(5.0) == 8
        for key, arr in zip(keys, loaded.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))
    # Promoted: the next turn on b is a local hit, and b writes nothing back.
    assert b.store.stored_prefix(ch.tenant, keys) == 8
    again = b.c.find(ch.tenant, keys)
    assert (again.found, again.remote) == (8, 0)
    reuse(b, ch.tenant, keys)
    settle(b)
    assert b.metric("dscache_sidecar_remote_blocks_total", op="push", result="ok") == 0
    assert b.metric("dscache_sidecar_remote_blocks_total", op="fetch", result="ok") == 8


@pytest.mark.slow
def test_a_new_pod_connects_at_start_so_its_first_lookup_pays_no_handshake(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    """A lookup runs under a short bound (0.25 s by default). When a pod's first one
    also had to read the slot map and open a socket to each node, it timed out on a
    loaded machine and a moved session recomputed its whole prefix (the Kubernetes
    e2e test saw 0 cached tokens). The sidecar now connects in the background at
    start: every node has its connection before any request."""
    a = pod(make_sidecar, shared, shared_write_policy="all")
    ch = chain()
    keys = ch.keys(prompt(4, seed=21))
    a.c.store(ch.tenant, blocks_for(keys))
    settle(a)
    watchers = [redis.Redis(host=shared.host, port=p) for p in shared.ports]

    def clients() -> list[int]:
        return [len(w.client_list()) for w in watchers]

    before = clients()
    b = pod(make_sidecar, shared)
    wait_until(
        "pod b's sidecar to connect to every node before any request",
        lambda: all(n > m for n, m in zip(clients(), before, strict=True)),
        20,
    )
    for kind in ("timeout", "connection", "other"):
        assert b.metric("dscache_sidecar_remote_errors_total", op="connect", kind=kind) == 0
    answer = b.c.find(ch.tenant, keys)
    assert (answer.found, answer.remote) == (4, 4)
    for w in watchers:
        w.close()


@pytest.mark.slow
def test_single_use_blocks_stay_on_their_node_unless_the_policy_is_all(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    reused = pod(make_sidecar, shared)
    every = pod(make_sidecar, shared, shared_write_policy="all")
    fresh = pod(make_sidecar, shared)
    ch = chain()
    once = ch.keys(prompt(4, seed=2))
    always = ch.keys(prompt(4, seed=3))
    reused.c.store(ch.tenant, blocks_for(once))
    every.c.store(ch.tenant, blocks_for(always))
    settle(reused, every)
    assert fresh.c.find(ch.tenant, once).found == 0
    assert fresh.c.find(ch.tenant, always).found == 4


@pytest.mark.slow
def test_tenants_are_isolated_in_the_shared_tier(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    a, b = pod(make_sidecar, shared), pod(make_sidecar, shared)
    owner = chain("tenant-a")
    keys = owner.keys(prompt(4, seed=4))
    a.c.store(owner.tenant, blocks_for(keys))
    reuse(a, owner.tenant, keys)
    settle(a)
    # Another tenant presenting the very same keys gets nothing, here or remote.
    other = chain("tenant-b").tenant
    assert b.c.find(other, keys).found == 0
    with b.c.load(other, keys) as loaded:
        assert loaded.keys == []
    assert b.store.stored_prefix(other, keys) == 0
    # ... and the remote names carry the tenant's id.
    rc = redis.RedisCluster(host="127.0.0.1", port=shared.ports[0])
    assert rc.exists(UNSIGNED.name(tenant_bytes(owner.tenant), keys[0])) == 1
    assert rc.exists(UNSIGNED.name(tenant_bytes(other), keys[0])) == 0
    assert b.c.find(owner.tenant, keys).found == 4


@pytest.mark.slow
def test_a_corrupt_remote_value_is_detected_dropped_and_never_served(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    a, b = pod(make_sidecar, shared, shared_write_policy="all"), pod(make_sidecar, shared)
    ch = chain()
    keys = ch.keys(prompt(6, seed=5))
    a.c.store(ch.tenant, blocks_for(keys))
    settle(a)
    rc = redis.RedisCluster(host="127.0.0.1", port=shared.ports[0])
    name = UNSIGNED.name(tenant_bytes(ch.tenant), keys[3])
    value = bytearray(rc.get(name) or b"")
    value[-100] ^= 0x40  # one flipped bit in the payload
    rc.set(name, bytes(value))

    assert b.c.find(ch.tenant, keys).found == 6  # present remotely: not yet read
    with b.c.load(ch.tenant, keys) as loaded:
        assert loaded.keys == keys[:3]  # the prefix before the corrupt block
        for key, arr in zip(loaded.keys, loaded.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))
    assert rc.exists(name) == 0  # dropped remotely
    assert b.metric("dscache_sidecar_checksum_failures_total", where="remote") == 1
    assert b.metric("dscache_sidecar_remote_blocks_total", op="fetch", result="corrupt") == 1
    assert b.c.find(ch.tenant, keys).found == 3


def test_remote_values_verify_tenant_key_layout_and_bytes() -> None:
    tenant = tenant_salt("t").hex()[:32]
    key, parent = b"k" * 32, b"p" * 32
    data = np.arange(64, dtype=np.float32).tobytes()
    value = UNSIGNED.pack(record(key, parent, tenant, data), data)
    tid = tenant_bytes(tenant)
    spec, csum, got = UNSIGNED.unpack(tid, key, value, 1 << 20)
    assert (spec.key, spec.parent, spec.shape, got) == (key, parent, (64,), data)
    assert csum == record(key, parent, tenant, data).checksum
    broken = {
        "another key": (tid, b"x" * 32, value),
        "another tenant": (tenant_bytes("someone-else"), key, value),
        "flipped byte": (tid, key, value[:-1] + bytes([value[-1] ^ 1])),
        "truncated": (tid, key, value[:-4]),
        "not ours": (tid, key, b"hello"),
        "garbled header": (tid, key, value[:5] + b"\xff\xff\x00\x00" + value[9:]),
    }
    for what, (t, k, v) in broken.items():
        with pytest.raises(CorruptValueError):
            UNSIGNED.unpack(t, k, v, 1 << 20)
            pytest.fail(what)


def test_a_frozen_cluster_is_a_miss_within_the_timeout(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    a = pod(make_sidecar, shared, shared_write_policy="all")
    b = pod(make_sidecar, shared, shared_timeout_s=0.2, shared_fetch_budget_s=0.5)
    ch = chain()
    keys = ch.keys(prompt(4, seed=6))
    a.c.store(ch.tenant, blocks_for(keys))
    settle(a)
    local = ch.keys(prompt(3, seed=7))
    b.c.store(ch.tenant, blocks_for(local))
    shared.pause()
    try:
        t0 = time.monotonic()
        assert b.c.find(ch.tenant, keys).found == 0
        with b.c.load(ch.tenant, keys) as loaded:
            assert loaded.keys == []
        elapsed = time.monotonic() - t0
        # Local blocks are served as ever, at no remote cost while the tier is skipped.
        with b.c.load(ch.tenant, local) as loaded:
            assert loaded.keys == local
        assert b.c.stats().shared_tier_up is False
        assert b.metric("dscache_sidecar_remote_up") == 0
    finally:
        shared.resume()
    # One timeout (and the connection's) at most, not one per block or per call.
    assert elapsed < 3.0
    assert b.metric("dscache_sidecar_remote_errors_total", op="lookup", kind="timeout") >= 1


@pytest.mark.slow
def test_a_read_before_the_first_connect_is_a_miss_and_skips_nothing(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    """A pod's first request comes while its background connect still waits on a
    frozen cluster: that read is a miss at once, not a failure (no error counted,
    the tier not skipped for 5 s), and ``remote_up`` says 0 until the tier answers.
    Once the cluster is back, the pod finds the blocks."""
    a = pod(make_sidecar, shared, shared_write_policy="all")
    ch = chain()
    keys = ch.keys(prompt(4, seed=31))
    a.c.store(ch.tenant, blocks_for(keys))
    settle(a)
    shared.pause()
    try:
        b = pod(make_sidecar, shared, connected=False)  # its connect now hangs (3 s bound)
        t0 = time.monotonic()
        assert b.c.find(ch.tenant, keys).found == 0
        assert time.monotonic() - t0 < 2.0  # it did not wait for the connect
        assert b.metric("dscache_sidecar_remote_up") == 0
        for kind in ("timeout", "connection", "other"):
            assert b.metric("dscache_sidecar_remote_errors_total", op="lookup", kind=kind) == 0
    finally:
        shared.resume()
    wait_until("pod b's tier to answer", lambda: b.metric("dscache_sidecar_remote_up") == 1, 30)
    assert b.c.find(ch.tenant, keys).found == 4


@pytest.mark.slow
def test_writes_never_wait_for_the_tier_and_overflow_is_counted(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    a = pod(make_sidecar, shared, shared_write_policy="all", shared_queue_blocks=2)
    ch = chain()
    shared.pause()
    try:
        keys = ch.keys(prompt(12, seed=8))
        t0 = time.monotonic()
        assert a.c.store(ch.tenant, blocks_for(keys)) == 12
        stored_s = time.monotonic() - t0
        settle(a)
    finally:
        shared.resume()
    drops = sum(
        a.metric("dscache_sidecar_remote_write_drops_total", reason=r)
        for r in ("queue_full", "down", "error")
    )
    assert drops == 12  # every write was dropped and counted, none waited
    assert a.metric("dscache_sidecar_remote_write_drops_total", reason="queue_full") >= 1
    assert stored_s < 5.0


@pytest.mark.slow
def test_a_killed_cluster_changes_no_answer(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    need_binary("redis-server", "redis-server")
    with LocalRedisCluster(tmp_path / "redis-killed") as doomed:
        a = pod(make_sidecar, doomed, shared_write_policy="all")
        b = pod(make_sidecar, doomed, shared_timeout_s=0.2, shared_retry_s=0.5)
        ch = chain()
        keys = ch.keys(prompt(5, seed=9))
        a.c.store(ch.tenant, blocks_for(keys))
        settle(a)
        with b.c.load(ch.tenant, keys[:2]) as loaded:  # two blocks promoted before the loss
            assert loaded.keys == keys[:2]
        doomed.kill()
        for _ in range(3):  # past the retry pause too: every call fails over again
            answer = b.c.find(ch.tenant, keys)
            assert answer.found == 2
            with b.c.load(ch.tenant, keys) as loaded:
                assert loaded.keys == keys[:2]
                for key, arr in zip(loaded.keys, loaded.arrays, strict=True):
                    np.testing.assert_array_equal(arr, block_array(key))
            time.sleep(0.6)
        more = ch.keys(prompt(3, seed=10))
        assert b.c.store(ch.tenant, blocks_for(more)) == 3  # writes go on locally
        assert b.c.find(ch.tenant, more).found == 3

        # With no request at all, the sidecar keeps trying to reconnect, once per
        # retry pause: a failed reconnect schedules the next one.
        def reconnects() -> float:
            return sum(
                b.metric("dscache_sidecar_remote_errors_total", op="connect", kind=kind)
                for kind in ("timeout", "connection", "other")
            )

        tries = reconnects()
        wait_until(
            "two more background reconnects, each failing", lambda: reconnects() >= tries + 2, 20
        )


@pytest.mark.slow
def test_a_password_protected_cluster_needs_the_right_password(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    need_binary("redis-server", "redis-server")
    with LocalRedisCluster(tmp_path / "redis-auth", password="s3cret") as locked:
        a = pod(make_sidecar, locked, shared_write_policy="all", shared_password="s3cret")
        right = pod(make_sidecar, locked, shared_password="s3cret")
        wrong = pod(
            make_sidecar, locked, connected=False, shared_password="guess", shared_timeout_s=0.5
        )
        ch = chain()
        keys = ch.keys(prompt(3, seed=11))
        a.c.store(ch.tenant, blocks_for(keys))
        settle(a)
        assert a.metric("dscache_sidecar_remote_blocks_total", op="push", result="ok") == 3
        assert right.c.find(ch.tenant, keys).found == 3
        # A wrong password is a miss, counted, never an error to the caller.
        assert wrong.c.find(ch.tenant, keys).found == 0
        # Counted where it failed: the connect at start, or a lookup made before it.
        errors = sum(
            wrong.metric("dscache_sidecar_remote_errors_total", op=op, kind=kind)
            for op in ("connect", "lookup")
            for kind in ("other", "connection")
        )
        assert errors >= 1
        assert wrong.metric("dscache_sidecar_remote_up") == 0


@pytest.mark.slow
def test_a_tls_cluster_is_used_only_with_a_ca_that_signed_it(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    need_binary("redis-server", "redis-server")
    tls = tls_files(tmp_path / "tls", "dscache test")
    stranger = tls_files(tmp_path / "other", "someone else")
    with LocalRedisCluster(tmp_path / "redis-tls", tls=tls) as secure:
        # A CA is all it takes: TLS is on by default when the settings name one.
        trusted = {"shared_tls_ca_file": tls.ca}
        a = pod(make_sidecar, secure, shared_write_policy="all", **trusted)
        b = pod(make_sidecar, secure, **trusted)
        fooled = pod(make_sidecar, secure, connected=False, shared_tls_ca_file=stranger.ca)
        plain = pod(make_sidecar, secure, connected=False)  # no CA, no TLS: plain TCP
        ch = chain()
        keys = ch.keys(prompt(3, seed=12))
        a.c.store(ch.tenant, blocks_for(keys))
        settle(a)
        assert a.metric("dscache_sidecar_remote_blocks_total", op="push", result="ok") == 3
        with b.c.load(ch.tenant, keys) as loaded:
            assert loaded.keys == keys  # verified the nodes' certificates, fetched over TLS
        # A certificate from another CA, or no TLS: a miss, never an error.
        for p in (fooled, plain):
            assert p.c.find(ch.tenant, keys).found == 0
            assert p.metric("dscache_sidecar_remote_up") == 0
