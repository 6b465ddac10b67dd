"""Per-tenant quotas: a tenant over its share loses its own least recently used blocks,
never another tenant's; with every block of its own leased its write is refused.

Real daemon in-process, real gRPC, real LMDB and segment files.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from dscache_sidecar.client import SidecarFullError
from sidecar_helpers import Sidecar, blocks_for, chain, prompt

KiB = 1024
CAPACITY = 1024 * KiB  # 4 segments of 256 KiB; a test block is a 4 KiB extent (plus header)


def _fill(sc: Sidecar, tenant: str, chains: int, blocks: int, seed0: int) -> list[list[bytes]]:
    ch = chain(tenant)
    out = []
    for seed in range(seed0, seed0 + chains):
        keys = ch.keys(prompt(blocks, seed))
        sc.c.store(ch.tenant, blocks_for(keys))
        out.append(keys)
    return out


def _held(sc: Sidecar, tenant: str, chains: list[list[bytes]]) -> int:
    ch = chain(tenant)
    return sum(sc.c.lookup(ch.tenant, keys) for keys in chains)


def test_a_tenant_over_its_quota_evicts_its_own_blocks_never_another_tenants(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(capacity_bytes=CAPACITY, tenant_quota=0.25)
    quiet = _fill(sc, "quiet", 5, 4, seed0=0)  # 20 blocks, well under its quota
    assert _held(sc, "quiet", quiet) == 20
    # A busy tenant writes far more than the whole store holds.
    busy = _fill(sc, "busy", 60, 4, seed0=1000)
    assert _held(sc, "quiet", quiet) == 20, "the busy tenant evicted another tenant's blocks"
    held = _held(sc, "busy", busy)
    assert 0 < held <= 256 * KiB // (4 * KiB), f"busy tenant holds {held} blocks over quota"
    # What it lost is its own oldest: its newest chain is whole, its first is gone.
    assert sc.c.lookup(chain("busy").tenant, busy[-1]) == 4
    assert sc.c.lookup(chain("busy").tenant, busy[0]) == 0
    assert sc.metric("dscache_sidecar_evictions_total", reason="quota") > 0
    assert sc.metric("dscache_sidecar_evictions_total", reason="capacity") == 0
    assert sc.metric("dscache_sidecar_tenants") == 2
    assert sc.c.stats().tenants == 2  # the Stats RPC says it too


def test_without_a_quota_a_busy_tenant_flushes_everyone(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    """The contrast that makes the quota test meaningful: the default (1.0) is no quota."""
    sc = make_sidecar(capacity_bytes=CAPACITY)
    quiet = _fill(sc, "quiet", 5, 4, seed0=0)
    _fill(sc, "busy", 60, 4, seed0=1000)
    assert _held(sc, "quiet", quiet) < 20
    assert sc.metric("dscache_sidecar_evictions_total", reason="quota") == 0


def test_a_tenant_at_its_quota_with_everything_leased_is_refused_others_still_write(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(capacity_bytes=CAPACITY, tenant_quota=0.25)
    busy = chain("busy")
    chains = _fill(sc, "busy", 20, 4, seed0=0)
    leases = [sc.c.load(busy.tenant, keys) for keys in chains if sc.c.lookup(busy.tenant, keys)]
    try:
        with pytest.raises(SidecarFullError, match="RESOURCE_EXHAUSTED"):
            for seed in range(500, 600):
                sc.c.store(busy.tenant, blocks_for(busy.keys(prompt(1, seed))))
        assert sc.metric("dscache_sidecar_write_rejections_total", reason="tenant_quota") >= 1
        # Another tenant is not held back by the busy one's leases.
        other = chain("other")
        keys = other.keys(prompt(4, 7))
        assert sc.c.store(other.tenant, blocks_for(keys)) == 4
        # Every leased block is still readable.
        assert all(len(lease.keys) == 4 for lease in leases)
    finally:
        for lease in leases:
            lease.release()
    # Released, the busy tenant writes again (evicting its own).
    assert sc.c.store(busy.tenant, blocks_for(busy.keys(prompt(4, 999)))) == 4


def test_a_block_larger_than_the_quota_is_refused_a_chain_over_it_partly_stored(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    tiny = make_sidecar(capacity_bytes=CAPACITY, tenant_quota=0.002)  # 2 KiB: under one block
    ch = chain("t")
    with pytest.raises(SidecarFullError, match="larger than a tenant's quota"):
        tiny.c.store(ch.tenant, blocks_for(ch.keys(prompt(1, 1))))
    small = make_sidecar(capacity_bytes=CAPACITY, tenant_quota=0.01)  # ~10 KiB: a block or two
    keys = ch.keys(prompt(8, 1))
    stored = small.c.store(ch.tenant, blocks_for(keys))
    assert 1 <= stored < 8
    assert small.c.lookup(ch.tenant, keys) == stored  # the leading blocks, a usable prefix
    assert small.metric("dscache_sidecar_write_rejections_total", reason="tenant_quota") >= 1


def test_usage_is_rebuilt_from_the_index_after_a_restart(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(capacity_bytes=CAPACITY, tenant_quota=0.25)
    quiet = _fill(sc, "quiet", 5, 4, seed0=0)
    busy = _fill(sc, "busy", 30, 4, seed0=1000)
    before = _held(sc, "busy", busy)
    sc.restart()
    assert _held(sc, "busy", busy) == before
    more = _fill(sc, "busy", 30, 4, seed0=5000)
    # After the restart the busy tenant still counts what it held: it stays within
    # its quota by evicting its own blocks, and the quiet tenant keeps all of its.
    assert _held(sc, "quiet", quiet) == 20
    assert _held(sc, "busy", busy + more) <= 256 * KiB // (4 * KiB)
