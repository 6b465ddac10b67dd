"""The names of the metrics other parts read: one place, imported by writer and readers.

The model server exports these series (``dscache_server.metrics``); the operator's
rollout analysis queries them through Prometheus (``dscache_operator.analysis``);
the load generator scrapes them (``dscache_tools.loadgen``); the tests' fake server
writes them (``tests/fakes``). A rename here renames it everywhere, so a gate can
never read a series nobody writes. The ``VLLM_*`` names are vLLM's own (its
engine writes them; a test on a real vLLM engine checks that they exist).

Names are the Prometheus family names (no ``_total``/``_bucket`` suffix); the
``*_SERIES`` constants add the suffix a query or a text exposition uses.
"""

from __future__ import annotations

from typing import Final

#: Prefix of every model-server metric.
SERVER_PREFIX: Final = "dscache_server_"

#: Counter: prompt tokens by ``source`` (:data:`SOURCE_REUSED` or :data:`SOURCE_RECOMPUTED`).
PROMPT_TOKENS: Final = SERVER_PREFIX + "prompt_tokens"
PROMPT_TOKENS_SERIES: Final = PROMPT_TOKENS + "_total"
#: Label of :data:`PROMPT_TOKENS` and its two values.
SOURCE_LABEL: Final = "source"
SOURCE_REUSED: Final = "reused"
SOURCE_RECOMPUTED: Final = "recomputed"

#: Label of :data:`PROMPT_TOKENS` and of the requests counter: the tenant, from a
#: bounded set (the API-key file's tenant names, ``default``, a few gateway-set
#: names, ``other``); readers sum over it.
TENANT_LABEL: Final = "tenant"

#: Histogram: seconds from a request's arrival to its first generated token.
TTFT_SECONDS: Final = SERVER_PREFIX + "ttft_seconds"
TTFT_BUCKET_SERIES: Final = TTFT_SECONDS + "_bucket"

#: vLLM's own series (its v1 engine's ``/metrics``), which the rollout gates read for
#: ``spec.engine: vllm`` pods: every prompt token, the same by ``source``
#: (:data:`VLLM_CACHED_SOURCES` and ``local_compute``), and the TTFT histogram.
VLLM_PROMPT_TOKENS_SERIES: Final = "vllm:prompt_tokens_total"
VLLM_PROMPT_TOKENS_BY_SOURCE_SERIES: Final = "vllm:prompt_tokens_by_source_total"
#: The ``source`` values of prompt tokens vLLM did not compute: its own prefix cache
#: (``local_cache_hit``) and a KV connector's load (``external_kv_transfer``: dscache).
VLLM_CACHED_SOURCES: Final = ("local_cache_hit", "external_kv_transfer")
VLLM_SOURCE_COMPUTED: Final = "local_compute"
VLLM_TTFT_BUCKET_SERIES: Final = "vllm:time_to_first_token_seconds_bucket"

#: Counters of cache hits and misses by ``level`` (:data:`HIT_LEVELS`).
CACHE_HITS: Final = SERVER_PREFIX + "cache_hits"
CACHE_MISSES: Final = SERVER_PREFIX + "cache_misses"
LEVEL_LABEL: Final = "level"

#: Counter: requests that recomputed because the cache failed, by ``reason``.
CACHE_FALLBACKS: Final = SERVER_PREFIX + "cache_fallbacks"
HIT_LEVELS: Final = ("token", "block", "session")

#: Counter: HTTP API requests by ``endpoint`` and ``code`` (the fallback rate's denominator).
REQUESTS: Final = SERVER_PREFIX + "requests"
#: Histogram: seconds of one cache operation by ``op`` (:data:`OP_LOOKUP`, load, store).
CACHE_OP_SECONDS: Final = SERVER_PREFIX + "cache_op_seconds"
OP_LABEL: Final = "op"
OP_LOOKUP: Final = "lookup"

#: Histogram: seconds one request spent in each ``phase`` (:data:`PHASES`).
REQUEST_PHASE_SECONDS: Final = SERVER_PREFIX + "request_phase_seconds"
PHASE_LABEL: Final = "phase"
#: The phases of a request, in the order they happen. On its way to the first token:
#: ``tokenize`` (JSON, chat template, tokenizer), ``queue`` (waiting for the engine),
#: ``lookup`` (block keys, how many are stored), ``lease`` (pinning them),
#: ``map_verify`` (views on the segment files, and any wait for their checksums),
#: ``prefill`` (the forward over the uncached tail). Then ``first_decode`` (the
#: forward of the first generated token) and, off the request's path, ``store``
#: (exporting and writing its new blocks in the background).
PHASES: Final = (
    "tokenize",
    "queue",
    "lookup",
    "lease",
    "map_verify",
    "prefill",
    "first_decode",
    "store",
)
#: Counter: lookups by ``path``: ``direct`` (the index read in the server's process)
#: or ``rpc`` (asked of the sidecar).
CACHE_LOOKUPS: Final = SERVER_PREFIX + "cache_lookups"

#: Where the router (NGINX's Lua) serves its metrics, on its listen port.
ROUTER_METRICS_PATH: Final = "/dscache/router/metrics"
#: Where the router pod's NGINX serves its picker's metrics (``dscache_picker_*``,
#: ``dscache_epp_*``; the picker itself listens on the pod's loopback only).
PICKER_METRICS_PATH: Final = "/dscache/picker/metrics"
#: Prefix of every router metric (served at :data:`ROUTER_METRICS_PATH`).
ROUTER_PREFIX: Final = "dscache_router_"
#: Counter: requests the router answered, by ``track`` (stable, canary, previous) and
#: ``code`` (the status class: 1xx ... 5xx).
ROUTER_REQUESTS: Final = ROUTER_PREFIX + "requests"
#: Counter: upstream tries beyond a request's first, by ``track``.
ROUTER_RETRIES: Final = ROUTER_PREFIX + "retries"
#: Counter: tries sent to each pod, by ``upstream`` (a configured address).
ROUTER_UPSTREAM_REQUESTS: Final = ROUTER_PREFIX + "upstream_requests"
#: Counter: tries that ended in a connection error, a timeout or a 5xx, by ``upstream``.
ROUTER_UPSTREAM_ERRORS: Final = ROUTER_PREFIX + "upstream_errors"
#: Counter: requests that passed a pod over its bounded load, by ``upstream``.
ROUTER_OVERLOAD_SKIPS: Final = ROUTER_PREFIX + "overload_skips"
#: Gauge: tries in progress on each pod, by ``upstream`` (bounded-load balancer only).
ROUTER_UPSTREAM_INFLIGHT: Final = ROUTER_PREFIX + "upstream_inflight"
#: Gauges: the configured canary weight (percent) and bounded-load factor.
ROUTER_CANARY_WEIGHT: Final = ROUTER_PREFIX + "canary_weight_percent"
ROUTER_BALANCE_FACTOR: Final = ROUTER_PREFIX + "balance_factor"
#: Counter: requests placed on the picker's advice, by reason (or failed).
ROUTER_PICKS: Final = ROUTER_PREFIX + "picks"
#: Counter: sessions this replica did not know, looked up on the pods, by result
#: (found, unknown, failed).
ROUTER_LOCATES: Final = ROUTER_PREFIX + "session_locates"
#: Counter: requests no session placed, looked up by what the pods hold past their
#: opening, by result (found, unknown, failed).
ROUTER_HOLDERS: Final = ROUTER_PREFIX + "holder_lookups"
#: Prefix of every picker metric (served at :data:`PICKER_METRICS_PATH`).
PICKER_PREFIX: Final = "dscache_picker_"
#: Counter: holder lookups the blocks could not settle, asked of the pods' conversation
#: ledgers, by result (found, unknown).
PICKER_CONVERSATIONS: Final = PICKER_PREFIX + "conversations"
#: Histogram: seconds the picker took to answer a holder lookup.
PICKER_HOLDER_SECONDS: Final = PICKER_PREFIX + "holder_seconds"
#: Labels of the router's series.
ROUTER_TRACK_LABEL: Final = "track"
ROUTER_CODE_LABEL: Final = "code"
ROUTER_UPSTREAM_LABEL: Final = "upstream"
