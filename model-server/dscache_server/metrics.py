"""Every metric of the model server, against an injectable registry.

Conventions: prefix ``dscache_server_``, base units, ``_total`` on counters only,
labels with small fixed value sets only (never a session id, tenant or block key).

Hit levels (label ``level``):
    * ``token``: prompt tokens restored from the cache vs. recomputed;
    * ``block``: cacheable full blocks found vs. not found;
    * ``session``: a turn of a known session (``X-Session-ID`` seen before) that
      found its previous turn's prefix, vs. one that did not.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dscache import metricnames as names

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_CACHE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

FALLBACK_REASONS = (
    "unavailable",
    "timeout",
    "full",
    "rejected",
    "corrupt",
    "short_load",
    "circuit_open",
    "error",
)


class ServerMetrics:
    """The server's metrics; build one per server (tests pass a fresh registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = names.SERVER_PREFIX
        self.requests = Counter(
            p + "requests_total",
            "HTTP API requests by endpoint and status code.",
            ["endpoint", "code"],
            registry=r,
        )
        self.ttft = Histogram(
            names.TTFT_SECONDS,
            "Time from request arrival to the first generated token.",
            ["cache"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            p + "request_duration_seconds",
            "End-to-end latency of a completion request.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            p + "queue_wait_seconds",
            "Time a request waited for a generation slot.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            names.PROMPT_TOKENS,
            "Prompt tokens by source: reused from the cache or recomputed.",
            [names.SOURCE_LABEL],
            registry=r,
        )
        self.generated_tokens = Counter(
            p + "generated_tokens_total", "Completion tokens generated.", registry=r
        )
        self.cache_hits = Counter(
            names.CACHE_HITS,
            "Cache hits at token, block and session level.",
            [names.LEVEL_LABEL],
            registry=r,
        )
        self.cache_misses = Counter(
            names.CACHE_MISSES,
            "Cache misses at token, block and session level.",
            [names.LEVEL_LABEL],
            registry=r,
        )
        self.fallbacks = Counter(
            p + "cache_fallbacks_total",
            "Requests that recomputed because the cache failed, by reason.",
            ["reason"],
            registry=r,
        )
        self.admission = Counter(
            p + "cache_admission_total",
            "Cache admission decisions: admit, short (under the minimum), no_gain "
            "(loading would not beat recompute) or disabled.",
            ["decision"],
            registry=r,
        )
        self.cache_op_seconds = Histogram(
            p + "cache_op_seconds",
            "Latency of cache operations (lookup, load, store).",
            ["op"],
            buckets=_CACHE_BUCKETS,
            registry=r,
        )
        self.blocks_stored = Counter(
            p + "blocks_stored_total",
            "Blocks written to the cache in the background, by result.",
            ["result"],
            registry=r,
        )
        self.queue_depth = Gauge(
            p + "queue_depth", "Requests waiting for a generation slot.", registry=r
        )
        self.inflight = Gauge(
            p + "inflight_requests", "Requests holding a generation slot.", registry=r
        )
        self.store_backlog = Gauge(
            p + "store_backlog", "Background store jobs not finished yet.", registry=r
        )
        self.crossover_tokens = Gauge(
            p + "cache_crossover_tokens",
            "Calibrated prompt length above which loading beats recomputing.",
            registry=r,
        )
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        for level in ("token", "block", "session"):
            self.cache_hits.labels(level=level)
            self.cache_misses.labels(level=level)
        for source in ("reused", "recomputed"):
            self.prompt_tokens.labels(source=source)
