"""Builds the operator's objects and runs kopf until SIGTERM/SIGINT.

Everything is constructed here and passed down (no module-level registry or
client): the API client, the reconciler, the metrics registry, kopf's registry
and settings.
"""

from __future__ import annotations

import logging

import kopf
from prometheus_client import start_http_server

from dscache_operator.handlers import kopf_settings, register
from dscache_operator.kube import Kube, load_api_client
from dscache_operator.metrics import OperatorMetrics
from dscache_operator.reconcile import Reconciler
from dscache_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


def run(settings: OperatorSettings) -> int:
    """Runs the operator; returns the exit status."""
    # kopf logs every timer run at INFO; one line per resource per tick is noise.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = OperatorMetrics()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=metrics.registry)
    kube = Kube(load_api_client(), timeout_s=settings.api_timeout_seconds)
    reconciler = Reconciler(kube, settings, metrics)
    registry = kopf.OperatorRegistry()
    register(registry, reconciler, settings)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    log.info(
        "dscache operator: %s, tick %.1fs",
        "all namespaces" if settings.clusterwide else f"namespaces {settings.namespaces}",
        settings.tick_seconds,
    )
    kopf.run(
        registry=registry,
        settings=kopf_settings(settings),
        standalone=True,
        clusterwide=settings.clusterwide,
        namespaces=() if settings.clusterwide else settings.namespaces,
        liveness_endpoint=liveness,
    )
    return 0
