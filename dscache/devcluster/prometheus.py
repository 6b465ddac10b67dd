"""A real Prometheus beside a dev cluster with real nodes, scraping the dscache pods.

Debian's ``prometheus`` runs on the host (not in a pod), discovers pods through
the API server (``kubernetes_sd_configs``, role ``pod``) and scrapes them at
their pod IPs, which the host routes to. It listens on node 0's bridge
address, so the operator, in a pod, reaches it for rollout analysis.

Contract:
    * :func:`config` is pure. It keeps only containers ports named ``http``
      or ``metrics`` of running pods labelled ``app.kubernetes.io/name:
      dscache``, and gives each series the labels the operator's analysis
      selects on: ``namespace`` and ``dscache_io_revision`` (the pod's
      ``dscache.io/revision`` label), plus ``dscache_io_slot``, ``pod`` and
      ``container``. This is what the chart's ServiceMonitor asks a
      Prometheus Operator for, written as plain scrape config.
    * Scrape and evaluation interval: 2 s (rollout steps of a dev cluster are
      short; a production Prometheus scrapes every 15-30 s).
"""

from __future__ import annotations

import json
from pathlib import Path

SCRAPE_INTERVAL_S = 2

_LABELS = (
    ("__meta_kubernetes_namespace", "namespace"),
    ("__meta_kubernetes_pod_name", "pod"),
    ("__meta_kubernetes_pod_container_name", "container"),
    ("__meta_kubernetes_pod_label_dscache_io_revision", "dscache_io_revision"),
    ("__meta_kubernetes_pod_label_dscache_io_slot", "dscache_io_slot"),
)


def config(kubeconfig: Path) -> str:
    """``prometheus.yml`` (JSON is YAML) discovering pods through ``kubeconfig``."""
    relabel: list[dict[str, object]] = [
        {
            "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
            "regex": "dscache",
            "action": "keep",
        },
        {
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": "http|metrics",
            "action": "keep",
        },
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
    ]
    relabel += [{"source_labels": [src], "target_label": dst} for src, dst in _LABELS]
    conf = {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "scrape_configs": [
            {
                "job_name": "dscache-pods",
                "metrics_path": "/metrics",
                "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig)}],
                "relabel_configs": relabel,
            }
        ],
    }
    return json.dumps(conf, indent=2) + "\n"


def command(binary: str, state_dir: Path, listen: str) -> list[str]:
    """The command line of the Prometheus process of the cluster in ``state_dir``."""
    return [
        binary,
        f"--config.file={state_dir / 'prometheus.yml'}",
        f"--storage.tsdb.path={state_dir / 'prometheus'}",
        f"--web.listen-address={listen}",
        "--storage.tsdb.retention.time=6h",
        "--web.enable-lifecycle",
    ]
