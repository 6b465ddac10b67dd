"""Prometheus Operator objects: the ServiceMonitors and the alerting PrometheusRule (pure).

Two ServiceMonitors: ``<name>`` scrapes the model pods (server and sidecar),
``<name>-router`` the router pods' ``/dscache/router/metrics``.

Applied only when the cluster serves their CRDs (the reconciler asks).

The alerts (:func:`alert_rules`) are built once, for a :class:`Scope`: the
operator's rule scopes them to one resource (its namespace and its two track
Services, every figure summed over both tracks); the Helm chart's cluster-wide
rule (``charts/dscache/templates/prometheusrule.yaml``, written from this code
by :mod:`dscache_operator.chartrules`) keeps one figure per ``namespace,
service`` and reads its thresholds from the chart's values. The PromQL comes
from :mod:`dscache_operator.analysis`, the one place expressions are built.

The alerts and their defaults (each fires only after its ``for``):

* ``DscacheHitRateLow`` / ``DscacheBlockHitRateLow`` / ``DscacheSessionHitRateLow``:
  the token, block or session hit rate over 10m under the floor
  (``rollout.analysis.minHitRate``, else :data:`HIT_RATE_FLOOR` 0.85), for 10m;
* ``DscacheHitRateDropped``: the token hit rate under ``minHitRateRatio`` x its
  own level of the hour before, for 10m (the cache got worse than it was);
* ``DscacheLookupSlow``: P99 cache lookup of the model servers over 5m above
  :data:`LOOKUP_P99_SECONDS`, for 10m;
* ``DscacheSidecarDown``: a sidecar's metrics target ``up == 0`` for 5m, and
  ``DscacheSidecarAbsent``: no sidecar target at all for 10m while replicas > 0;
* ``DscacheFallbackRateHigh``: cache failures that made a request recompute
  over 10m above :data:`FALLBACK_RATIO` of the requests, for 10m.

An empty window (no traffic) gives NaN, which is never under or over a
threshold: an idle deployment raises no hit-rate, latency or fallback alert.

``spec.engine: vllm``: the token hit-rate alerts (``DscacheHitRateLow``,
``DscacheHitRateDropped``) read vLLM's own figures (prompt tokens served by its
prefix cache and by the dscache connector, over all its prompt tokens; see
:func:`dscache_operator.analysis.token_hit_rate`), and the sidecar alerts apply
as they are; the block and session levels, slow lookups and fallbacks are the
reference server's series, absent on vLLM pods, so those stay quiet there.
"""

from __future__ import annotations

from dataclasses import dataclass

from dscache.metricnames import PICKER_METRICS_PATH, ROUTER_METRICS_PATH
from dscache_operator import analysis as q
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

#: Default floor of the token, block and session hit rates (without ``minHitRate``).
HIT_RATE_FLOOR = 0.85
#: P99 seconds of a cache lookup above which lookups are called slow (50 ms: 25x the
#: 2 ms the server's cost model assumes uncalibrated, a tenth of its 0.5 s deadline).
LOOKUP_P99_SECONDS = 0.05
#: Share of requests recomputed because the cache failed above which the cache is failing.
FALLBACK_RATIO = 0.05

_LEVELS = (("block", "DscacheBlockHitRateLow"), ("session", "DscacheSessionHitRateLow"))


@dataclass(frozen=True)
class Scope:
    """Where a set of alerts looks and what it prints.

    Attributes:
        selector: label matchers every series is narrowed by (may be empty).
        by: labels each figure keeps (``namespace, service``), empty: one figure.
        who: how a summary names the deployment (plain text or a label template).
        floor, ratio, lookup_p99, fallback_ratio: the thresholds, as PromQL text.
        absent: also alert when no sidecar target exists at all.
    """

    selector: str
    by: str
    who: str
    floor: str
    ratio: str
    lookup_p99: str
    fallback_ratio: str
    absent: bool


# A PrometheusRule alert's six fields, positionally in the order the file shows them.
def _rule(  # noqa: PLR0917
    alert: str, expr: str, for_: str, severity: str, summary: str, runbook: str
) -> Obj:
    return {
        "alert": alert,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": runbook},
    }


def _hit_rate_rules(s: Scope) -> list[Obj]:
    token = q.token_hit_rate(s.selector, "10m", by=s.by)
    before = q.token_hit_rate(s.selector, "1h", " offset 10m", by=s.by)
    evictions = "dscache_sidecar_evictions_total by reason"
    rules = [
        _rule(
            "DscacheHitRateLow",
            f"{token} < {s.floor}",
            "10m",
            "warning",
            f"{s.who}: KV-cache token hit rate below {s.floor} for 10 minutes",
            "Fewer prompt tokens than expected come from the cache. Check, in order: "
            "sessions losing their pod (router retries, a rollout in progress), a cache too "
            f"small ({evictions}: many capacity evictions), sidecars down "
            "(DscacheSidecarDown) or failing (dscache_server_cache_fallbacks_total by "
            "reason). Traffic with little reuse has a naturally lower rate: raise or "
            "lower spec.rollout.analysis.minHitRate to fit.",
        )
    ]
    for level, alert in _LEVELS:
        rules.append(
            _rule(
                alert,
                f"{q.level_hit_rate(level, s.selector, '10m', by=s.by)} < {s.floor}",
                "10m",
                "warning",
                f"{s.who}: KV-cache {level} hit rate below {s.floor} for 10 minutes",
                f"Cacheable {level}s are not found in the cache. "
                + (
                    "A session's next turn lands on a pod without its prefix: check the "
                    "router's session affinity and pod churn (restarts, scaling, rollouts)."
                    if level == "session"
                    else f"Blocks are evicted before reuse ({evictions}) or stored late "
                    "(dscache_server_store_backlog); grow spec.cache.size."
                ),
            )
        )
    rules.append(
        _rule(
            "DscacheHitRateDropped",
            f"({token}) < {s.ratio} * ({before})",
            "10m",
            "warning",
            f"{s.who}: KV-cache token hit rate below {s.ratio} x its level of the hour "
            "before, for 10 minutes",
            "The cache got worse than it was, whatever its natural level: a cold rollout, "
            "sessions reshuffled by a scale-up, or a change in traffic. Compare "
            "dscache_server_cache_hits_total by level before and after the drop.",
        )
    )
    return rules


def _health_rules(s: Scope) -> list[Obj]:
    up = q.sidecar_up(s.selector)
    rules = [
        _rule(
            "DscacheLookupSlow",
            f"{q.lookup_p99(s.selector, '5m', by=s.by)} > {s.lookup_p99}",
            "10m",
            "warning",
            f"{s.who}: P99 KV-cache lookup above {s.lookup_p99}s for 10 minutes",
            "The sidecar answers lookups slowly, so loading costs more than the cost model "
            "assumed and admission may stop. Check the sidecar's "
            "dscache_sidecar_rpc_duration_seconds by op, its CPU limit and the cache "
            "volume's latency.",
        ),
        _rule(
            "DscacheSidecarDown",
            f"{up} == 0",
            "5m",
            "critical",
            f"{s.who}: sidecar {{{{ $labels.pod }}}} not scraped for 5 minutes",
            "The pod's KV sidecar does not answer on its metrics port: its model server "
            "recomputes every prompt. kubectl describe pod / kubectl logs -c sidecar; "
            "a locked or full data directory stops it at start.",
        ),
        _rule(
            "DscacheSharedTierDown",
            q.shared_tier_down(s.selector),
            "10m",
            "warning",
            f"{s.who}: sidecar {{{{ $labels.pod }}}} cannot use the shared tier for 10 minutes",
            "The sidecar's Redis Cluster (spec.cache.shared) fails or times out, so it is "
            "skipped: sessions that move to this pod recompute their prefix and reused "
            "blocks are not written. Requests are still served. Check "
            "dscache_sidecar_remote_errors_total by op and kind, the cluster's health "
            "(redis-cli cluster info) and the Secret's endpoints and password.",
        ),
        _rule(
            "DscacheFallbackRateHigh",
            f"{q.fallback_ratio(s.selector, '10m', by=s.by)} > {s.fallback_ratio}",
            "10m",
            "warning",
            f"{s.who}: over {s.fallback_ratio} of requests fell back to recompute for 10 minutes",
            "Cache calls fail (dscache_server_cache_fallbacks_total by reason: unavailable "
            "or timeout = the sidecar, full = the cache disk, corrupt = bad blocks). "
            "Requests are still served, slower.",
        ),
    ]
    if s.absent:
        rules.append(
            _rule(
                "DscacheSidecarAbsent",
                f"absent({up})",
                "10m",
                "warning",
                f"{s.who}: Prometheus scrapes no sidecar for 10 minutes",
                "No sidecar target exists: the ServiceMonitor is not picked up by "
                "Prometheus (its selector labels) or no model pod runs.",
            )
        )
    return rules


def alert_rules(scope: Scope) -> list[Obj]:
    """Every alert of :mod:`this module <dscache_operator.desired.monitoring>` for ``scope``."""
    return _hit_rate_rules(scope) + _health_rules(scope)


def resource_scope(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Scope:
    """The operator's scope: one resource, both tracks summed, thresholds from its spec."""
    a = spec.rollout.analysis
    floor = a.min_hit_rate if a.min_hit_rate is not None else HIT_RATE_FLOOR
    return Scope(
        selector=f'{a.namespace_label}="{owner.namespace}",service=~"{owner.name}-(blue|green)"',
        by="",
        who=f"{owner.namespace}/{owner.name}",
        floor=str(floor),
        ratio=str(a.min_hit_rate_ratio),
        lookup_p99=str(LOOKUP_P99_SECONDS),
        fallback_ratio=str(FALLBACK_RATIO),
        absent=spec.replicas > 0,
    )


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
                {"port": q.SIDECAR_ENDPOINT, "path": "/metrics", "interval": "15s"},
            ],
        },
    }


def router_service_monitor(owner: Owner, picker: bool = False) -> Obj:
    """ServiceMonitor ``<name>-router`` scraping every router pod's Lua counters
    (``dscache_router_*``: requests by track and status, retries, tries, errors and
    in-flight per pod, overload skips, picks; each router replica its own series)
    and, with ``picker``, its picker's (``dscache_picker_*``, ``dscache_epp_*``)."""
    endpoints = [{"port": "http", "path": ROUTER_METRICS_PATH, "interval": "15s"}]
    if picker:
        endpoints.append({"port": "http", "path": PICKER_METRICS_PATH, "interval": "15s"})
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta(owner, f"{owner.name}-router", labels(owner, "router", "all")),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner, "router")},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "endpoints": endpoints,
        },
    }


def prometheus_rule(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """PrometheusRule with every alert of :func:`alert_rules` for this resource."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": meta(owner, owner.name, labels(owner, "model", "all")),
        "spec": {
            "groups": [
                {
                    "name": f"dscache.{owner.namespace}.{owner.name}",
                    "rules": alert_rules(resource_scope(owner, spec)),
                }
            ]
        },
    }
