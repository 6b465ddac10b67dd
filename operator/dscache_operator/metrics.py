"""The operator's Prometheus metrics (prefix ``dscache_operator_``), on an injectable registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_PREFIX = "dscache_operator_"


class OperatorMetrics:
    """Build one per process; tests pass a fresh registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconciles = self._counter(
            "reconciles_total",
            "Reconciles by result: ok, invalid_spec, api_error, namespace_terminating.",
            "result",
        )
        self.reconcile_seconds = Histogram(
            f"{_PREFIX}reconcile_seconds",
            "Time of one reconcile, API calls and analysis included.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.rollout_events = self._counter(
            "rollout_events_total",
            "Rollout transitions by reason (StepStarted, Promoted, AnalysisFailed, ...).",
            "reason",
        )
        self.analyses = self._counter(
            "analyses_total", "Analysis verdicts: Pass, Fail, NoData, Skipped.", "result"
        )
        self.api_requests = self._counter(
            "api_requests_total",
            "Kubernetes API requests the reconciler sent, by HTTP verb (kopf's watches and "
            "status patches not included).",
            "verb",
        )

    def count_api_request(self, verb: str) -> None:
        """One API request sent (``Kube``'s ``on_request``)."""
        self.api_requests.labels(verb=verb).inc()

    def _counter(self, name: str, documentation: str, label: str) -> Counter:
        return Counter(_PREFIX + name, documentation, [label], registry=self.registry)
