"""A real Prometheus beside a dev cluster with real nodes, scraping the dscache pods.

Debian's ``prometheus`` runs on the host (not in a pod) and scrapes the pods at
their pod IPs, which the host routes to. Debian builds it without Kubernetes
service discovery, so :mod:`.podsd` lists the pods and keeps a ``file_sd``
file current. It listens on node 0's bridge address, so the operator, in a pod,
reaches it for rollout analysis.

Contract:
    * :func:`config` is pure. The targets (from :mod:`.podsd`) are the ports
      named ``http`` or ``metrics`` of running dscache pods, labelled with what
      the operator's analysis selects on: ``namespace`` and
      ``dscache_io_revision`` (the pod's ``dscache.io/revision`` label), plus
      ``dscache_io_slot``, ``pod`` and ``container``. This is what the chart's
      ServiceMonitor asks a Prometheus Operator for.
    * Scrape and evaluation interval: 2 s (rollout steps of a dev cluster are
      short; a production Prometheus scrapes every 15-30 s).
"""

from __future__ import annotations

import json
from pathlib import Path

SCRAPE_INTERVAL_S = 2


def config(targets_file: Path) -> str:
    """``prometheus.yml`` (JSON is YAML) scraping the targets :mod:`.podsd` keeps current."""
    conf = {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "scrape_configs": [
            {
                "job_name": "dscache-pods",
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
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
