"""Who may put a block into another pod's KV: signed values, per-namespace names and
users, and shapes that cannot make a decoder allocate more than a block.

On the session's real Redis Cluster (3 masters on loopback). What a user would notice:
a value written by anyone without the namespace's key never reaches a pod's KV (a
miss, counted as ``forged``), a namespace's Redis user reaches its own prefix only,
and a forged shape is refused before anything is decoded.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
import zstandard
from dscache_sidecar.blockstore import tenant_bytes
from dscache_sidecar.codec import Codec, decode
from dscache_sidecar.sharedvalue import CorruptValueError, ForgedValueError, ValueFormat
from dscache_tools.rediscluster import LocalRedisCluster
from shared_helpers import UNSIGNED, pod, record, settle
from sidecar_helpers import Sidecar, block_array, blocks_for, chain, prompt

KEY = "namespace-a signing key: 32 random bytes in real life"
SIGNED = ValueFormat(signing_key=KEY.encode())
REMOTE = "dscache_sidecar_remote_blocks_total"


def _cluster_client(c: LocalRedisCluster) -> redis.RedisCluster:
    return redis.RedisCluster(host="127.0.0.1", port=c.ports[0])


@pytest.mark.slow
def test_a_value_forged_without_the_namespace_key_is_a_counted_miss(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    writer = pod(make_sidecar, shared, shared_write_policy="all", shared_signing_key=KEY)
    reader = pod(make_sidecar, shared, shared_signing_key=KEY)
    ch = chain()
    keys = ch.keys(prompt(5, seed=21))
    writer.c.store(ch.tenant, blocks_for(keys))
    settle(writer)
    rc = _cluster_client(shared)
    tid = tenant_bytes(ch.tenant)
    assert rc.exists(SIGNED.name(tid, keys[0])) == 1  # written signed, under v2 names
    assert rc.exists(UNSIGNED.name(tid, keys[0])) == 0

    # Whoever can write to the cluster but lacks the key replaces block 2 with KV of
    # their choosing: a well-formed value (right tenant, key, layout and checksum),
    # signed with a key of their own; and block 3 with the unsigned format.
    evil = np.full(block_array(keys[2]).shape, 7.0, dtype=np.float32).tobytes()
    forger = ValueFormat(signing_key=b"a guess")
    rc.set(
        SIGNED.name(tid, keys[2]),
        forger.pack(record(keys[2], keys[1], ch.tenant, evil), evil),
    )
    rc.set(
        SIGNED.name(tid, keys[3]),
        UNSIGNED.pack(record(keys[3], keys[2], ch.tenant, evil), evil),
    )

    with reader.c.load(ch.tenant, keys) as loaded:
        assert loaded.keys == keys[:2]  # the prefix before the forged block, nothing after
        for key, arr in zip(loaded.keys, loaded.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))
    assert reader.metric(REMOTE, op="fetch", result="forged") == 1
    assert reader.metric(REMOTE, op="fetch", result="ok") == 2
    assert rc.exists(SIGNED.name(tid, keys[2])) == 0  # dropped remotely
    assert reader.store.stored_prefix(ch.tenant, keys) == 2
    with reader.c.load(ch.tenant, keys[3:4]) as alone:  # the unsigned one, asked alone
        assert alone.keys == []
    assert reader.metric(REMOTE, op="fetch", result="forged") == 2


@pytest.mark.slow
def test_signed_and_unsigned_pods_never_read_each_others_values(
    make_sidecar: Callable[..., Sidecar], shared: LocalRedisCluster
) -> None:
    signed = pod(make_sidecar, shared, shared_write_policy="all", shared_signing_key=KEY)
    unsigned = pod(make_sidecar, shared, shared_write_policy="all")
    rotated = pod(
        make_sidecar,
        shared,
        shared_signing_key="the next key",
        shared_signing_key_previous=KEY,
    )
    ch = chain()
    mine, theirs = ch.keys(prompt(3, seed=22)), ch.keys(prompt(3, seed=23))
    signed.c.store(ch.tenant, blocks_for(mine))
    unsigned.c.store(ch.tenant, blocks_for(theirs))
    settle(signed, unsigned)
    assert signed.c.find(ch.tenant, theirs).found == 0
    assert unsigned.c.find(ch.tenant, mine).found == 0
    # A key being rotated out still verifies what it signed.
    with rotated.c.load(ch.tenant, mine) as loaded:
        assert loaded.keys == mine
    assert rotated.metric(REMOTE, op="fetch", result="forged") == 0


@pytest.fixture
def acl_users(shared: LocalRedisCluster) -> Iterator[dict[str, str]]:
    """One Redis ACL user per namespace on every node, confined to its own prefix."""
    users = {"team-a": "pass-a", "team-b": "pass-b"}
    nodes = [redis.Redis(host="127.0.0.1", port=p) for p in shared.ports]
    for node in nodes:
        for user, password in users.items():
            node.acl_setuser(
                user,
                enabled=True,
                passwords=[f"+{password}"],
                keys=[f"{user}:*"],
                commands=["+@all", "-@dangerous"],
            )
    yield users
    for node in nodes:
        node.acl_deluser(*users)


@pytest.mark.slow
def test_a_namespace_user_reaches_its_own_prefix_only(
    make_sidecar: Callable[..., Sidecar],
    shared: LocalRedisCluster,
    acl_users: dict[str, str],
) -> None:
    def member(team: str, prefix: str, **kw: object) -> Sidecar:
        login = {"shared_username": team, "shared_password": acl_users[team]}
        return pod(make_sidecar, shared, shared_key_prefix=prefix, **login, **kw)

    a = member("team-a", "team-a", shared_write_policy="all", shared_signing_key=KEY)
    a2 = member("team-a", "team-a", shared_signing_key=KEY)
    # team-b's user, pointed at team-a's prefix (and even holding team-a's key).
    intruder = member("team-b", "team-a", shared_signing_key=KEY, shared_timeout_s=0.5)
    ch = chain()
    keys = ch.keys(prompt(3, seed=24))
    a.c.store(ch.tenant, blocks_for(keys))
    settle(a)
    assert a.metric(REMOTE, op="push", result="ok") == 3
    names = [n for port in shared.ports for n in redis.Redis(port=port).keys("*")]
    assert names and all(n.startswith(b"team-a:v2:") for n in names)
    with a2.c.load(ch.tenant, keys) as loaded:
        assert loaded.keys == keys
    # The ACL refuses the other namespace's user: a miss and a counted error.
    assert intruder.c.find(ch.tenant, keys).found == 0
    assert intruder.metric("dscache_sidecar_remote_errors_total", op="lookup", kind="other") == 1


def test_a_forged_shape_is_refused_before_anything_is_decoded() -> None:
    tenant = chain().tenant
    key, parent = b"k" * 32, b"p" * 32
    frame = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    # A zstd value whose layout says it decodes to 64 GiB, checksum and all right.
    bomb = record(
        key,
        parent,
        tenant,
        frame,
        codec=int(Codec.ZSTD_SHUFFLE),
        shape=(1 << 16, 1 << 18),
        raw_bytes=(1 << 16) * (1 << 18) * 4,
    )
    for fmt in (UNSIGNED, SIGNED):
        with pytest.raises(CorruptValueError, match="raw_bytes must be at most"):
            fmt.unpack(tenant_bytes(tenant), key, fmt.pack(bomb, frame), 1 << 20)
    with pytest.raises(ForgedValueError):
        SIGNED.unpack(tenant_bytes(tenant), key, UNSIGNED.pack(bomb, frame), 1 << 20)


def test_a_zstd_frame_is_never_decoded_past_the_blocks_shape() -> None:
    # The frame's header says 64 MiB; the block's shape 4 KiB. The decoder must refuse
    # it without producing the 64 MiB first (python-zstandard trusts the header).
    frame = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="zstd frame"):
            decode(frame, Codec.ZSTD_SHUFFLE, "float32", (1024,))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    # A frame without a content size is bounded by the shape as well.
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 20))
    with pytest.raises(ValueError, match="within 4096 bytes"):
        decode(unsized, Codec.ZSTD_SHUFFLE, "float32", (1024,))
