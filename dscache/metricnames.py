"""The names of the metrics other parts read: one place, imported by writer and readers.

The model server exports these series (``dscache_server.metrics``); the operator's
rollout analysis queries them through Prometheus (``dscache_operator.analysis``);
the load generator scrapes them (``dscache_tools.loadgen``); the tests' fake server
writes them (``tests/fakes``). A rename here renames it everywhere, so a gate can
never read a series nobody writes.

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

#: Histogram: seconds from a request's arrival to its first generated token.
TTFT_SECONDS: Final = SERVER_PREFIX + "ttft_seconds"
TTFT_BUCKET_SERIES: Final = TTFT_SECONDS + "_bucket"

#: Counters of cache hits and misses by ``level`` (:data:`HIT_LEVELS`).
CACHE_HITS: Final = SERVER_PREFIX + "cache_hits"
CACHE_MISSES: Final = SERVER_PREFIX + "cache_misses"
LEVEL_LABEL: Final = "level"

#: Counter: requests that recomputed because the cache failed, by ``reason``.
CACHE_FALLBACKS: Final = SERVER_PREFIX + "cache_fallbacks"
HIT_LEVELS: Final = ("token", "block", "session")
