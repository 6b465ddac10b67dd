"""Every metric of the model server, against an injectable registry.

Conventions: prefix ``dscache_server_``, base units, ``_total`` on counters only,
labels with small fixed value sets only (never a session id, raw API key or block
key). The ``tenant`` label of the requests and prompt-token counters takes the
bounded values ``dscache_server.auth`` gives (the API-key file's tenant names,
``default``, at most 32 gateway-set names, ``other``).
The names other components read come from ``dscache.metricnames``.

The metrics are declared once, in the ``_SPECS`` table (attribute -> kind, name,
labels, help); ``ServerMetrics`` builds them all against its registry and
pre-creates every labelled series whose values are fixed, so a scrape shows zeros
rather than nothing.

Hit levels (label ``level``):
    * ``token``: prompt tokens restored from the cache vs. recomputed;
    * ``block``: cacheable full blocks found vs. not found;
    * ``session``: a turn of a known session (``X-Session-ID`` seen before) that
      found its previous turn's prefix, vs. one that did not.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dscache import metricnames as names

P = names.SERVER_PREFIX

#: Request latencies, seconds: 5 ms to 2 min.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: Cache operations, seconds: 0.5 ms to 2.5 s.
CACHE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
#: Request phases, seconds: 50 us (a direct lookup) to 2 min (a long queue).
PHASE_BUCKETS: tuple[float, ...] = (
    *(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1),
    *(0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
)

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


class _Spec(NamedTuple):
    kind: type[Counter] | type[Histogram] | type[Gauge]
    name: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()

    def build(self, registry: CollectorRegistry) -> Counter | Histogram | Gauge:
        if self.kind is Histogram:
            return Histogram(
                self.name, self.help, self.labels, buckets=self.buckets, registry=registry
            )
        return self.kind(self.name, self.help, self.labels, registry=registry)


_SPECS: dict[str, _Spec] = {
    "requests": _Spec(
        Counter,
        names.REQUESTS,
        ("endpoint", "code", names.TENANT_LABEL),
        "HTTP API requests by endpoint, status code and tenant.",
    ),
    "ttft": _Spec(
        Histogram,
        names.TTFT_SECONDS,
        ("cache",),
        "Time from request arrival to the first generated token.",
        LATENCY_BUCKETS,
    ),
    "latency": _Spec(
        Histogram,
        P + "request_duration_seconds",
        ("endpoint",),
        "End-to-end latency of a completion request.",
        LATENCY_BUCKETS,
    ),
    "queue_wait": _Spec(
        Histogram,
        P + "queue_wait_seconds",
        (),
        "Time a request waited for a generation slot.",
        LATENCY_BUCKETS,
    ),
    "prompt_tokens": _Spec(
        Counter,
        names.PROMPT_TOKENS,
        (names.SOURCE_LABEL, names.TENANT_LABEL),
        "Prompt tokens by source (reused from the cache or recomputed) and tenant.",
    ),
    "generated_tokens": _Spec(
        Counter, P + "generated_tokens_total", (), "Completion tokens generated."
    ),
    "cache_hits": _Spec(
        Counter,
        names.CACHE_HITS,
        (names.LEVEL_LABEL,),
        "Cache hits at token, block and session level.",
    ),
    "cache_misses": _Spec(
        Counter,
        names.CACHE_MISSES,
        (names.LEVEL_LABEL,),
        "Cache misses at token, block and session level.",
    ),
    "fallbacks": _Spec(
        Counter,
        names.CACHE_FALLBACKS,
        ("reason",),
        "Requests that recomputed because the cache failed, by reason.",
    ),
    "admission": _Spec(
        Counter,
        P + "cache_admission_total",
        ("decision",),
        "Cache admission decisions: admit, short (under the floor), no_gain "
        "(loading would not beat recompute), probe (refused, loaded anyway to keep "
        "measuring) or disabled.",
    ),
    "cache_op_seconds": _Spec(
        Histogram,
        names.CACHE_OP_SECONDS,
        (names.OP_LABEL,),
        "Latency of cache operations (lookup, load, store).",
        CACHE_BUCKETS,
    ),
    "phase_seconds": _Spec(
        Histogram,
        names.REQUEST_PHASE_SECONDS,
        (names.PHASE_LABEL,),
        "Seconds a request spent in each phase (tokenize, queue, lookup, lease, map_verify, "
        "prefill, first_decode; store runs in the background).",
        PHASE_BUCKETS,
    ),
    "decode_batch": _Spec(
        Histogram,
        P + "decode_batch_size",
        (),
        "Requests decoded together in one engine step.",
        (1, 2, 4, 8, 16, 32, 64, 128),
    ),
    "lookups": _Spec(
        Counter,
        names.CACHE_LOOKUPS,
        ("path",),
        "Cache lookups by path: direct (the sidecar's index read here) or rpc.",
    ),
    "blocks_stored": _Spec(
        Counter,
        P + "blocks_stored_total",
        ("result",),
        "Blocks written to the cache in the background, by result.",
    ),
    "signals_sent": _Spec(
        Counter,
        P + "cache_signals_total",
        ("kind", "result"),
        "Signals sent to the sidecar's eviction policy (ended, expected, queued), by result "
        "(sent, failed).",
    ),
    "respelled": _Spec(
        Counter,
        P + "respelled_tokens_total",
        (),
        "Prompt tokens taken from the tokenization the cache stored them with (a "
        "previous answer's generated ids, found after a restart or on another pod) "
        "where encoding the text again split it differently.",
    ),
    "store_codec": _Spec(
        Counter,
        P + "store_codec_total",
        ("codec", "reason"),
        "Background store jobs by the codec chosen (raw, zstd, int8, sample = zstd where "
        "a block shrinks) and why (fixed, short, low_repetition, no_headroom, chosen).",
    ),
    "templates_recorded": _Spec(
        Counter,
        P + "templates_recorded_total",
        (),
        "Requests the live template miner counted (those with a full block).",
    ),
    "templates_tracked": _Spec(
        Gauge, P + "templates_tracked", (), "Prompt prefixes the live template miner holds."
    ),
    "queue_depth": _Spec(Gauge, P + "queue_depth", (), "Requests waiting for a generation slot."),
    "inflight": _Spec(Gauge, P + "inflight_requests", (), "Requests holding a generation slot."),
    "store_backlog": _Spec(
        Gauge, P + "store_backlog", (), "Background store jobs not finished yet."
    ),
    "crossover_tokens": _Spec(
        Gauge,
        P + "cache_crossover_tokens",
        (),
        "Smallest usable prefix (tokens) that is loaded: where loading starts to beat "
        "recomputing (-1: it never does).",
    ),
    "admission_upper_tokens": _Spec(
        Gauge,
        P + "cache_admission_upper_tokens",
        (),
        "Largest usable prefix (tokens) that is loaded (the context length when loading "
        "pays up to it; -1: it never pays).",
    ),
    "cost_per_token": _Spec(
        Gauge,
        P + "cache_cost_seconds_per_token",
        ("path", "tokens"),
        "The admission model's seconds per token to load or recompute a prefix of up to "
        "`tokens` tokens (calibrated at start, refined from served requests).",
    ),
}

#: Labelled series created at start, so they scrape as 0 before the first event.
_FIXED_SERIES: dict[str, tuple[dict[str, str], ...]] = {
    "fallbacks": tuple({"reason": r} for r in FALLBACK_REASONS),
    "phase_seconds": tuple({names.PHASE_LABEL: p} for p in names.PHASES),
    "lookups": ({"path": "direct"}, {"path": "rpc"}),
    "cache_hits": tuple({names.LEVEL_LABEL: level} for level in names.HIT_LEVELS),
    "cache_misses": tuple({names.LEVEL_LABEL: level} for level in names.HIT_LEVELS),
}
_SOURCES = (names.SOURCE_REUSED, names.SOURCE_RECOMPUTED)


class ServerMetrics:
    """The server's metrics; build one per server (tests pass a fresh registry).

    Each attribute below is the metric of the same key in ``_SPECS``.
    """

    registry: CollectorRegistry
    requests: Counter
    ttft: Histogram
    latency: Histogram
    queue_wait: Histogram
    prompt_tokens: Counter
    generated_tokens: Counter
    cache_hits: Counter
    cache_misses: Counter
    fallbacks: Counter
    admission: Counter
    cache_op_seconds: Histogram
    phase_seconds: Histogram
    decode_batch: Histogram
    lookups: Counter
    blocks_stored: Counter
    signals_sent: Counter
    respelled: Counter
    store_codec: Counter
    templates_recorded: Counter
    templates_tracked: Gauge
    queue_depth: Gauge
    inflight: Gauge
    store_backlog: Gauge
    crossover_tokens: Gauge
    admission_upper_tokens: Gauge
    cost_per_token: Gauge

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for attr, spec in _SPECS.items():
            setattr(self, attr, spec.build(self.registry))
        for attr, series in _FIXED_SERIES.items():
            metric = getattr(self, attr)
            for labels in series:
                metric.labels(**labels)

    def add_tenants(self, tenants: tuple[str, ...]) -> None:
        """Creates the prompt-token series of ``tenants`` (tenant labels), so they scrape as 0."""
        for tenant in tenants:
            for source in _SOURCES:
                self.prompt_tokens.labels(
                    **{names.SOURCE_LABEL: source, names.TENANT_LABEL: tenant}
                )
