"""Builds the operator's objects and runs kopf until SIGTERM/SIGINT.

Everything is constructed here and passed down (no module-level registry or
client): the API client, the reconciler, the metrics registry, kopf's registry
and settings.

Replicas: with ``peering`` set, kopf's peering makes exactly one replica act.
Each replica keeps its record in the peering object (a ClusterKopfPeering when
watching every namespace, else a KopfPeering per watched namespace) alive with
a keep-alive; a replica pauses while it sees a live peer of higher priority
(:func:`~dscache_operator.settings.peering_priority`: the oldest wins). A
replica that exits cleanly removes its record, so a standby resumes at once;
one that dies leaves a record that goes stale after ``peering_lifetime_seconds``,
and a standby resumes then. kopf has no per-object locks: in the instant two
replicas overlap, the status write's resourceVersion guard lets only one
decision through. Without ``peering`` the process runs standalone.
"""

from __future__ import annotations

import logging

import kopf
from prometheus_client import start_http_server

from dscache_operator.handlers import kopf_settings, register
from dscache_operator.kube import ApiError, Kube, load_api_client
from dscache_operator.metrics import OperatorMetrics
from dscache_operator.reconcile import Reconciler
from dscache_operator.settings import OperatorSettings, peering_priority

log = logging.getLogger(__name__)


def check_peering(kube: Kube, settings: OperatorSettings) -> list[str]:
    """Warns about every missing peering object; returns what is missing.

    kopf keeps a peered replica paused until its peering object exists, and says
    so only at DEBUG: without this, a missing object is an operator that silently
    does nothing. Not fatal: the chart creates the object after the Deployment,
    and kopf resumes as soon as it appears.
    """
    missing: list[str] = []
    for namespace in [None] if settings.clusterwide else settings.namespaces:
        what = (
            f"ClusterKopfPeering {settings.peering!r}"
            if namespace is None
            else f"KopfPeering {settings.peering!r} in namespace {namespace}"
        )
        try:
            if kube.peering_exists(settings.peering, namespace):
                continue
        except (ApiError, OSError) as exc:
            log.warning("cannot check the %s: %s", what, exc)
            continue
        missing.append(what)
        log.warning(
            "no %s (or no kopf.dev CRDs): this replica stays paused until it exists; "
            "the chart creates it, or run without --peering",
            what,
        )
    return missing


def run(settings: OperatorSettings) -> int:
    """Runs the operator; returns the exit status."""
    # kopf logs every timer run at INFO; one line per resource per tick is noise.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = OperatorMetrics()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=metrics.registry)
    kube = Kube(
        load_api_client(),
        timeout_s=settings.api_timeout_seconds,
        on_request=metrics.count_api_request,
    )
    if not settings.standalone:
        check_peering(kube, settings)
    reconciler = Reconciler(kube, settings, metrics)
    registry = kopf.OperatorRegistry()
    register(registry, reconciler, settings)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    priority = None if settings.standalone else peering_priority()
    log.info(
        "dscache operator: %s, tick %.1fs, %s",
        "all namespaces" if settings.clusterwide else f"namespaces {settings.namespaces}",
        settings.tick_seconds,
        "standalone"
        if settings.standalone
        else f"peering {settings.peering!r} (priority {priority}, "
        f"lifetime {settings.peering_lifetime_seconds}s)",
    )
    kopf.run(
        registry=registry,
        settings=kopf_settings(settings),
        standalone=settings.standalone,
        peering_name=settings.peering or None,
        priority=priority,
        clusterwide=settings.clusterwide,
        namespaces=() if settings.clusterwide else settings.namespaces,
        liveness_endpoint=liveness,
    )
    return 0
