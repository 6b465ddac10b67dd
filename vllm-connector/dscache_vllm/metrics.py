"""The vLLM connector's counters (prefix ``dscache_vllm_``), in the process and on vLLM's /metrics.

Each connector instance (vLLM builds one per role, scheduler and worker) counts
what it does through :class:`ConnectorMetrics`: into prometheus_client counters of
a registry of the process (:func:`process_registry`, read by the probe and by
tests; private, so it never collides with vLLM's own registry), and into pending
deltas that vLLM collects as ``KVConnectorStats`` after each step
(``get_kv_connector_stats``), ships to its API server, and hands to
:class:`DscachePromMetrics` there, which exports the same series on vLLM's own
``/metrics`` (with vLLM's engine labels). This module imports no vLLM: the
connector module binds the two vLLM-facing classes.

Series (all counters): ``lookups_total{result=hit|miss|error}``,
``lookup_seconds_total`` (time of the scheduler-side lookups),
``loaded_tokens_total``, ``load_failures_total{reason=unavailable|missing|layout}``
(pages), ``stored_blocks_total``, ``store_dropped_blocks_total``,
``store_failures_total`` (blocks), ``uncached_requests_total{reason=prompt_embeds|
mm_unhashed|lora_unreadable|unknown_input}`` (requests whose inputs cannot be keyed,
neither loaded nor saved; see ``dscache_vllm.extras``), ``signals_total{kind=ended|
expected}`` and ``signal_failures_total`` (eviction signals; ``dscache_vllm.signals``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

PREFIX = "dscache_vllm_"
#: family (without prefix) -> (help, label name or None)
FAMILIES: dict[str, tuple[str, str | None]] = {
    "lookups": ("Scheduler-side lookups by result", "result"),
    "lookup_seconds": ("Seconds spent in scheduler-side lookups (keys and index read)", None),
    "loaded_tokens": ("Prompt tokens whose KV was copied from dscache into vLLM's pages", None),
    "load_failures": ("vLLM pages that could not be loaded (recomputed), by reason", "reason"),
    "stored_blocks": ("Blocks handed to the sidecar (newly stored or already present)", None),
    "store_dropped_blocks": ("Blocks not stored because the write queue was full", None),
    "store_failures": ("Blocks whose store failed (sidecar down, disk full)", None),
    "uncached_requests": (
        "Requests not cached because an input cannot be keyed (prompt embeddings, ...)",
        "reason",
    ),
    "signals": ("Eviction signals sent to the sidecar for finished requests, by kind", "kind"),
    "signal_failures": ("Eviction signals that failed or were dropped (queue full)", None),
}

_PROCESS_REGISTRY = CollectorRegistry()
_PROCESS_COUNTERS: dict[str, Counter] | None = None
_PROCESS_LOCK = threading.Lock()


def _counters(registry: CollectorRegistry) -> dict[str, Counter]:
    return {
        name: Counter(PREFIX + name, doc, [label] if label else [], registry=registry)
        for name, (doc, label) in FAMILIES.items()
    }


def process_registry() -> CollectorRegistry:
    """The registry every connector of this process counts into."""
    return _PROCESS_REGISTRY


def _process_counters() -> dict[str, Counter]:
    global _PROCESS_COUNTERS  # noqa: PLW0603 - one set of series per process
    with _PROCESS_LOCK:
        if _PROCESS_COUNTERS is None:
            _PROCESS_COUNTERS = _counters(_PROCESS_REGISTRY)
        return _PROCESS_COUNTERS


def _key(family: str, label: str | None) -> str:
    return f"{family}|{label}" if label else family


@dataclass
class ConnectorMetrics:
    """What one connector instance counts (thread safe)."""

    counters: dict[str, Counter]
    _pending: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ConnectorMetrics:
        """Counters on ``registry`` (tests), or on the process registry (None)."""
        return cls(_counters(registry) if registry is not None else _process_counters())

    def _inc(self, family: str, amount: float, label: str | None = None) -> None:
        counter = self.counters[family]
        (counter.labels(label) if label else counter).inc(amount)
        with self._lock:
            key = _key(family, label)
            self._pending[key] = self._pending.get(key, 0.0) + amount

    def lookup(self, result: str, seconds: float) -> None:
        self._inc("lookups", 1, result)
        self._inc("lookup_seconds", seconds)

    def loaded(self, tokens: int) -> None:
        self._inc("loaded_tokens", tokens)

    def load_failed(self, reason: str, pages: int) -> None:
        self._inc("load_failures", pages, reason)

    def stored(self, blocks: int) -> None:
        self._inc("stored_blocks", blocks)

    def dropped(self, blocks: int) -> None:
        self._inc("store_dropped_blocks", blocks)

    def store_failed(self, blocks: int) -> None:
        self._inc("store_failures", blocks)

    def uncached(self, reason: str) -> None:
        self._inc("uncached_requests", 1, reason)

    def signalled(self, kind: str) -> None:
        self._inc("signals", 1, kind)

    def signal_failed(self) -> None:
        self._inc("signal_failures", 1)

    def take(self) -> dict[str, float]:
        """The increments since the last call (``family|label`` -> amount)."""
        with self._lock:
            out, self._pending = self._pending, {}
        return {k: v for k, v in out.items() if v}


def merge(into: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """Adds ``other``'s increments to ``into`` (and returns it)."""
    for k, v in other.items():
        into[k] = into.get(k, 0.0) + v
    return into


def export(
    make_counter: Callable[..., Any],
    labelnames: list[str],
    per_engine: dict[int, list[object]],
) -> Callable[[dict[str, float], int], None]:
    """Builds the ``dscache_vllm_*`` counters with vLLM's counter class and engine
    labels; returns ``observe(increments, engine_idx)``."""
    families = {
        name: make_counter(
            name=PREFIX + name,
            documentation=doc,
            labelnames=[*labelnames, label] if label else list(labelnames),
        )
        for name, (doc, label) in FAMILIES.items()
    }

    def observe(increments: dict[str, float], engine_idx: int) -> None:
        engine = per_engine.get(engine_idx, per_engine.get(0, []))
        for key, amount in increments.items():
            family, _, label = key.partition("|")
            counter = families.get(family)
            if counter is None or amount <= 0:
                continue
            values = [*engine, label] if label else list(engine)
            (counter.labels(*values) if values else counter).inc(amount)

    return observe
