"""Prometheus metrics of the vLLM connector (prefix ``dscache_vllm_``).

vLLM's API server serves every process's prometheus_client metrics on its own
``/metrics`` (it runs them in multiprocess mode), so these appear beside vLLM's.
The registry is injectable so tests read a fresh one.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

#: Lookups read a local index: tens of microseconds, milliseconds when it falls back.
LOOKUP_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 2.5e-2, 0.1, 0.5)


@dataclass(frozen=True)
class ConnectorMetrics:
    lookups: Counter
    lookup_seconds: Histogram
    loaded_tokens: Counter
    load_failures: Counter
    stored_blocks: Counter
    store_dropped: Counter
    store_failures: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry = REGISTRY) -> ConnectorMetrics:
        return cls(
            lookups=Counter(
                "dscache_vllm_lookups",
                "Scheduler-side lookups by result (hit, miss, error)",
                ["result"],
                registry=registry,
            ),
            lookup_seconds=Histogram(
                "dscache_vllm_lookup_seconds",
                "Time of one scheduler-side lookup (keys and index read)",
                buckets=LOOKUP_BUCKETS_S,
                registry=registry,
            ),
            loaded_tokens=Counter(
                "dscache_vllm_loaded_tokens",
                "Prompt tokens whose KV was copied from dscache into vLLM's pages",
                registry=registry,
            ),
            load_failures=Counter(
                "dscache_vllm_load_failures",
                "vLLM pages that could not be loaded and were recomputed, by reason",
                ["reason"],
                registry=registry,
            ),
            stored_blocks=Counter(
                "dscache_vllm_stored_blocks",
                "Blocks handed to the sidecar (newly stored or already present)",
                registry=registry,
            ),
            store_dropped=Counter(
                "dscache_vllm_store_dropped_blocks",
                "Blocks not stored because the write queue was full",
                registry=registry,
            ),
            store_failures=Counter(
                "dscache_vllm_store_failures",
                "Blocks whose store failed (sidecar down, disk full)",
                registry=registry,
            ),
        )
