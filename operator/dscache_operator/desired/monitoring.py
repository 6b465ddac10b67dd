"""Prometheus Operator objects: the ServiceMonitor and the hit-rate PrometheusRule (pure).

Applied only when the cluster serves their CRDs (the reconciler asks).
"""

from __future__ import annotations

from dscache_operator.analysis import token_hit_rate
from dscache_operator.desired.common import (
    REVISION,
    SLOT,
    Obj,
    Owner,
    labels,
    meta,
    selector_labels,
)
from dscache_operator.spec import DeepSeekCacheDeploymentSpec


def service_monitor(owner: Owner) -> Obj:
    """ServiceMonitor scraping both tracks' server and sidecar metrics."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta(owner, owner.name, labels(owner, "model", "all")),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner, "model")},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            # The series get dscache_io_revision / dscache_io_slot: what analysis selects on.
            "podTargetLabels": [REVISION, SLOT],
            "endpoints": [
                {"port": "http", "path": "/metrics", "interval": "15s"},
                {"port": "metrics", "path": "/metrics", "interval": "15s"},
            ],
        },
    }


def prometheus_rule(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """PrometheusRule ``DscacheHitRateLow`` on the token hit rate of both tracks.

    With ``minHitRate`` set: the hit rate over 10 minutes stayed under it for
    10 minutes. Without it (the default; traffic has no universal good hit
    rate): it stayed under ``minHitRateRatio`` times its own level over the
    hour before, i.e. the cache got worse than it was (sessions losing their
    pod, a cache too small, a cold rollout), whatever its natural level.
    """
    a = spec.rollout.analysis
    sel = f'{a.namespace_label}="{owner.namespace}",service=~"{owner.name}-(blue|green)"'

    def hit_rate(window: str, offset: str = "") -> str:
        return token_hit_rate(sel, window, offset)

    if a.min_hit_rate is not None:
        expr = f"{hit_rate('10m')} < {a.min_hit_rate}"
        summary = f"KV-cache token hit rate below {a.min_hit_rate} for 10 minutes"
    else:
        expr = f"({hit_rate('10m')}) < {a.min_hit_rate_ratio} * ({hit_rate('1h', ' offset 10m')})"
        summary = (
            f"KV-cache token hit rate below {a.min_hit_rate_ratio} x its level of the hour "
            "before, for 10 minutes"
        )
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": meta(owner, owner.name, labels(owner, "model", "all")),
        "spec": {
            "groups": [
                {
                    "name": f"dscache.{owner.namespace}.{owner.name}",
                    "rules": [
                        {
                            "alert": "DscacheHitRateLow",
                            "expr": expr,
                            "for": "10m",
                            "labels": {"severity": "warning"},
                            "annotations": {
                                "summary": f"{owner.namespace}/{owner.name}: {summary}",
                                "description": "Sessions are losing their pod or the cache is "
                                "too small; check the router and dscache_sidecar_evictions_total.",
                            },
                        }
                    ],
                }
            ]
        },
    }
