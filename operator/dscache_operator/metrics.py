"""The operator's Prometheus metrics (prefix ``dscache_operator_``), on an injectable registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class OperatorMetrics:
    """Build one per process; tests pass a fresh registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = "dscache_operator_"
        self.reconciles = Counter(
            p + "reconciles_total",
            "Reconciles by result: ok, invalid_spec, api_error.",
            ["result"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            p + "reconcile_seconds",
            "Time of one reconcile, API calls and analysis included.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.rollout_events = Counter(
            p + "rollout_events_total",
            "Rollout transitions by reason (StepStarted, Promoted, AnalysisFailed, ...).",
            ["reason"],
            registry=r,
        )
        self.analyses = Counter(
            p + "analyses_total",
            "Analysis verdicts: Pass, Fail, NoData, Skipped.",
            ["result"],
            registry=r,
        )
