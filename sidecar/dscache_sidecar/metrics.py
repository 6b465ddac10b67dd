"""The sidecar's Prometheus metrics (prefix ``dscache_sidecar_``), one injectable registry.

Labels take only small fixed value sets (result, reason, op, where, code); never a
key, tenant or request id. Totals the store holds (blocks, bytes, leases) are read
at scrape time by a collector instead of being mirrored into gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
#: Holdings builds read every key in the index: milliseconds to seconds.
_BUILD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class StoreGauges:
    """What the store reports at scrape time."""

    blocks: int
    used_bytes: int
    capacity_bytes: int
    free_bytes: int
    segments: int
    active_leases: int
    pending_writes: int
    stored_raw_bytes: int
    stored_payload_bytes: int
    tenants: int = 0


class RemoteStatus(Protocol):
    """What the shared tier reports at scrape time."""

    @property
    def up(self) -> bool: ...

    @property
    def queued(self) -> int: ...


class SidecarMetrics:
    """Every metric of the sidecar, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def counter(name: str, documentation: str, *labels: str) -> Counter:
            return Counter(name, documentation, labels, registry=r)

        self.lookups = counter(
            "dscache_sidecar_lookups_total",
            "Lookup and Lease calls by outcome (hit: every key, partial: some, miss: none)",
            "op",
            "result",
        )
        self.lookup_blocks = counter(
            "dscache_sidecar_lookup_blocks_total",
            "Blocks asked for in Lookup/Lease, by result (hit or miss)",
            "op",
            "result",
        )
        self.lookup_tokens = counter(
            "dscache_sidecar_lookup_tokens_total",
            "Tokens asked for in Lookup/Lease (when the client says block_tokens), by result",
            "op",
            "result",
        )
        self.stored_blocks = counter(
            "dscache_sidecar_stored_blocks_total", "Blocks published in the index"
        )
        self.stored_bytes = counter(
            "dscache_sidecar_stored_bytes_total", "Payload bytes published (after the codec)"
        )
        self.evictions = counter(
            "dscache_sidecar_evictions_total",
            "Blocks removed from the index, by reason (capacity, quota: a tenant over its "
            "share lost its own LRU blocks, cascade, corrupt, delete, tenant_clear)",
            "reason",
        )
        self.checksum_failures = counter(
            "dscache_sidecar_checksum_failures_total",
            "Blocks whose bytes did not match their checksum, by where it was found",
            "where",
        )
        self.signals = counter(
            "dscache_sidecar_signals_total",
            "Serving-path signals received (Signal RPC), by kind (ended, expected, queued) "
            "and whether the policy marked any stored block (marked, unmarked)",
            "kind",
            "result",
        )
        self.stale_readers = counter(
            "dscache_sidecar_stale_readers_cleared_total",
            "Reader slots of the LMDB index freed because their process was gone",
        )
        self.write_rejections = counter(
            "dscache_sidecar_write_rejections_total",
            "Allocate/Put requests refused, by reason",
            "reason",
        )
        self.rpc_latency = Histogram(
            "dscache_sidecar_rpc_duration_seconds",
            "gRPC handling time by method",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rpc_errors = Counter(
            "dscache_sidecar_rpc_errors_total",
            "gRPC calls that ended with an error status, by method and code",
            ["op", "code"],
            registry=r,
        )

        # The shared tier (dscache_sidecar.shared); zero without one.
        self.remote_blocks = counter(
            "dscache_sidecar_remote_blocks_total",
            "Blocks of the shared tier by op (lookup, fetch, push) and result (hit, miss, ok, "
            "corrupt, forged: a signature that does not verify, not_stored)",
            "op",
            "result",
        )
        self.remote_bytes = counter(
            "dscache_sidecar_remote_bytes_total",
            "Bytes moved to (push) or from (fetch) the shared tier",
            "op",
        )
        self.remote_latency = Histogram(
            "dscache_sidecar_remote_duration_seconds",
            "Time of shared-tier operations (lookup, fetch: a whole prefix, push: one batch)",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.remote_errors = counter(
            "dscache_sidecar_remote_errors_total",
            "Failed shared-tier operations by op and kind (timeout, connection, budget, other)",
            "op",
            "kind",
        )
        self.remote_write_drops = counter(
            "dscache_sidecar_remote_write_drops_total",
            "Blocks not written to the shared tier, by reason (queue_full, down, error, gone)",
            "reason",
        )

        # The holdings filter (dscache_sidecar.holdings_publisher); zero while off.
        self.holdings_keys = Gauge(
            "dscache_sidecar_holdings_keys",
            "Block keys in the published holdings filter (GET /dscache/holdings)",
            registry=r,
        )
        self.holdings_bytes = Gauge(
            "dscache_sidecar_holdings_bytes",
            "Bytes of the published holdings filter (the response body)",
            registry=r,
        )
        self.holdings_build = Histogram(
            "dscache_sidecar_holdings_build_seconds",
            "Time to read the index's keys and build the holdings filter, per build",
            buckets=_BUILD_BUCKETS,
            registry=r,
        )

        # KV events (dscache_sidecar.kvevents); zero while off.
        self.kv_events = counter(
            "dscache_sidecar_kv_events_total",
            "KV events published, by type (BlockStored, BlockRemoved, AllBlocksCleared)",
            "type",
        )
        self.kv_event_blocks = counter(
            "dscache_sidecar_kv_event_blocks_total",
            "Blocks named in published KV events, by type",
            "type",
        )
        self.kv_event_batches = counter(
            "dscache_sidecar_kv_event_batches_total",
            "KV event batches sent, by how (publish: to every subscriber; replay: to one)",
            "how",
        )
        self.kv_event_bytes = counter(
            "dscache_sidecar_kv_event_bytes_total",
            "Payload bytes of the KV event batches published (what each subscriber receives)",
        )
        self.kv_event_drops = counter(
            "dscache_sidecar_kv_event_drops_total",
            "Store changes not published as KV events because the queue was full (a "
            "resync of the whole holdings follows)",
        )
        self.kv_event_resyncs = counter(
            "dscache_sidecar_kv_event_resyncs_total",
            "Whole-holdings announcements (AllBlocksCleared, then every block), by reason "
            "(start, dropped: to every subscriber; replay_gap: to one that asked for batches "
            "older than the buffer)",
            "reason",
        )

    def count_lookup(self, op: str, hits: int, asked: int, block_tokens: int) -> None:
        """Counts one Lookup/Lease/Get of ``asked`` leading blocks, ``hits`` found."""
        if asked == 0:
            return
        result = "hit" if hits == asked else ("partial" if hits else "miss")
        self.lookups.labels(op=op, result=result).inc()
        for outcome, n in (("hit", hits), ("miss", asked - hits)):
            if n:
                self.lookup_blocks.labels(op=op, result=outcome).inc(n)
                if block_tokens:
                    self.lookup_tokens.labels(op=op, result=outcome).inc(n * block_tokens)

    def evicted_blocks(self) -> int:
        """Blocks removed from the index for any reason, since start (for Stats)."""
        return _total(self.evictions)

    def checksum_failure_count(self, where: str | None = None) -> int:
        """Blocks that failed verification, since start; ``where`` narrows it."""
        return _total(self.checksum_failures, {"where": where} if where else None)

    def watch_store(self, read: Callable[[], StoreGauges]) -> None:
        """Registers a collector that reads the store's totals at scrape time."""
        self.registry.register(_StoreCollector(read))

    def watch_remote(self, read: Callable[[], RemoteStatus]) -> None:
        """Registers a collector that reads the shared tier's state at scrape time."""
        self.registry.register(_RemoteCollector(read))


def _total(counter: Counter, labels: dict[str, str] | None = None) -> int:
    """Sum of a labelled counter's ``_total`` samples (matching ``labels``)."""
    return int(
        sum(
            sample.value
            for family in counter.collect()
            for sample in family.samples
            if sample.name.endswith("_total")
            and all(sample.labels.get(k) == v for k, v in (labels or {}).items())
        )
    )


class _StoreCollector(Collector):
    def __init__(self, read: Callable[[], StoreGauges]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = self._read()
        yield GaugeMetricFamily("dscache_sidecar_blocks", "Blocks in the index", value=g.blocks)
        yield GaugeMetricFamily(
            "dscache_sidecar_used_bytes",
            "Segment bytes held by live, reserved or still-leased blocks",
            value=g.used_bytes,
        )
        yield GaugeMetricFamily(
            "dscache_sidecar_capacity_bytes", "Segment bytes available", value=g.capacity_bytes
        )
        yield GaugeMetricFamily(
            "dscache_sidecar_segments", "Segment files in use", value=g.segments
        )
        yield GaugeMetricFamily(
            "dscache_sidecar_active_leases", "Leases not yet released", value=g.active_leases
        )
        yield GaugeMetricFamily(
            "dscache_sidecar_pending_writes",
            "Allocate reservations awaiting Commit",
            value=g.pending_writes,
        )
        yield GaugeMetricFamily(
            "dscache_sidecar_tenants", "Tenants holding at least one block", value=g.tenants
        )
        ratio = g.stored_raw_bytes / g.stored_payload_bytes if g.stored_payload_bytes else 1.0
        yield GaugeMetricFamily(
            "dscache_sidecar_compression_ratio",
            "Decoded bytes / stored bytes over the blocks in the index",
            value=ratio,
        )


class _RemoteCollector(Collector):
    def __init__(self, read: Callable[[], RemoteStatus]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._read()
        yield GaugeMetricFamily(
            "dscache_sidecar_remote_up",
            "1 while the shared tier answers, 0 until its first connect and while it is "
            "skipped after a failure",
            value=1.0 if s.up else 0.0,
        )
        yield GaugeMetricFamily(
            "dscache_sidecar_remote_queue_blocks",
            "Blocks waiting to be written to the shared tier",
            value=s.queued,
        )
