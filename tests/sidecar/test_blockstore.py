"""The store through its interfaces: the injected clock, and capabilities a store lacks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dscache_sidecar.blockstore import BlockSpec, BlockStore, Leasing, Reserving
from dscache_sidecar.codec import Codec
from dscache_sidecar.metrics import SidecarMetrics
from dscache_sidecar.segments import checksum, checksum_hasher
from dscache_sidecar.service import KVCacheService, UnimplementedError
from dscache_sidecar.store import KVStore
from sidecar_helpers import settings

from dscache.v1 import kvcache_pb2 as pb

KEY = bytes(range(32))


class FakeClock:
    """Monotonic and wall time that move only when the test says so."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.unix = 1_700_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.unix


def put_one(store: KVStore) -> None:
    data = np.arange(4, dtype=np.float32).tobytes()
    spec = BlockSpec(KEY, b"", Codec.RAW, "float32", (4,), 16, 16)
    assert store.put("t", spec, data, checksum(data)) == (True, False)


def test_leases_expire_on_the_monotonic_clock_and_report_wall_time(tmp_path: Path) -> None:
    clock = FakeClock()
    with KVStore(settings(tmp_path), SidecarMetrics(), clock=clock) as store:
        store.open(start_reaper=False)
        put_one(store)
        grant = store.lease("t", [KEY], ttl_s=10)
        assert grant.expires_unix_ms == (clock.unix + 10) * 1000
        clock.unix -= 3600  # a wall-clock step back changes no expiry
        clock.mono += 9
        assert store.expire() == (0, 0)
        assert store.extend(grant.lease_id, 10) == (clock.unix + 10) * 1000
        clock.mono += 11
        assert store.expire() == (1, 0)
        assert store.gauges().active_leases == 0


class LookupOnly:
    """A store with the BlockStore interface and neither optional capability."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.policy_name = inner.policy_name
        self.max_stored_bytes = inner.max_stored_bytes
        self.lookup, self.read, self.put = inner.lookup, inner.read, inner.put
        self.delete, self.clear_tenant = inner.delete, inner.clear_tenant
        self.gauges, self.close = inner.gauges, inner.close


def test_a_store_without_leases_or_reservations_answers_unimplemented(tmp_path: Path) -> None:
    with KVStore(settings(tmp_path)) as inner:
        inner.open(start_reaper=False)
        store: BlockStore = LookupOnly(inner)
        assert not isinstance(store, Leasing) and not isinstance(store, Reserving)
        service = KVCacheService(store, settings(tmp_path), SidecarMetrics())
        with pytest.raises(UnimplementedError):
            service.Lease(pb.LeaseRequest(tenant="t", keys=[KEY]), None)  # type: ignore[arg-type]
        with pytest.raises(UnimplementedError):
            service.Abort(pb.AbortRequest(write_ids=["x"]), None)  # type: ignore[arg-type]
        put_one(inner)
        found = service.Lookup(pb.LookupRequest(tenant="t", keys=[KEY]), None)  # type: ignore[arg-type]
        assert found.hit_blocks == 1
        assert service.Stats(pb.StatsRequest(), None).blocks == 1  # type: ignore[arg-type]


def test_the_checksum_in_parts_equals_the_checksum_of_the_whole() -> None:
    """The vLLM connector hashes a block layer by layer as it copies it; the sidecar
    checks the whole payload: both must be the same checksum."""
    payload = np.random.default_rng(3).integers(0, 256, size=3 * 4096 + 17, dtype=np.uint8)
    hasher = checksum_hasher()
    for part in np.array_split(payload, 3):
        hasher.update(part)
    assert hasher.intdigest() == checksum(payload.tobytes())
    assert checksum_hasher().intdigest() != checksum(payload.tobytes())


def test_recency_order_survives_a_restart_with_writes_counting_as_use(tmp_path: Path) -> None:
    """A block read once, then outlived by blocks written later and never read, is the
    least recently used after a restart too (the index sorted never-read blocks, whose
    last hit is 0, before every block ever read: old read chains outlived new ones)."""
    clock = FakeClock()
    cfg = settings(tmp_path, capacity_bytes=256 * 1024, high_watermark=1.0, low_watermark=1.0)
    data = np.zeros(72 * 1024 // 4, dtype=np.float32).tobytes()  # three fit, four do not

    def put(store: KVStore, key: bytes) -> None:
        clock.unix += 1
        n = len(data)
        spec = BlockSpec(key, b"", Codec.RAW, "float32", (n // 4,), n, n)
        assert store.put("t", spec, data, checksum(data))[0]

    a, b, c, d = (bytes([n]) * 32 for n in range(1, 5))
    with KVStore(cfg, SidecarMetrics(), clock=clock) as store:
        store.open(start_reaper=False)
        put(store, a)
        clock.unix += 1
        assert store.read("t", a) is not None
        store.flush_stats()
        put(store, b)
        put(store, c)
    with KVStore(cfg, SidecarMetrics(), clock=clock) as store:
        store.open(start_reaper=False)
        assert {store.record(k) is not None for k in (a, b, c)} == {True}
        put(store, d)
        held = [k for k in (a, b, c, d) if store.record(k) is not None]
    assert held == [b, c, d], "the block used longest ago goes first"
