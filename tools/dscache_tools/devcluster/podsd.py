"""Pod discovery for the dev cluster's Prometheus: a file_sd targets file kept current.

Debian's ``prometheus`` is built without Kubernetes service discovery, so the
dev cluster runs this small loop beside it (``python -m
dscache_tools.devcluster.podsd``): it lists the dscache pods through the API server
every second and rewrites Prometheus' ``file_sd`` file when the set changes
(Prometheus notices the rename at once).

Contract:
    * :func:`targets` is pure: one target group per container port named
      ``http`` or ``metrics`` of each running, not terminating model pod
      (``app.kubernetes.io/name: dscache``, ``app.kubernetes.io/component:
      model``: what the operator's ServiceMonitor selects) with a pod IP, labelled with what
      the operator's analysis selects on (``namespace``,
      ``dscache_io_revision``) plus ``dscache_io_slot``, ``pod`` and
      ``container``; sorted, so equal pod sets give equal files.
    * The file is replaced atomically; an API error keeps the last file.
    * Standard library only (the dev cluster's :class:`ApiClient`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from dscache_tools.devcluster.api import ApiClient

logger = logging.getLogger(__name__)

# Model pods only: the router's port passes /metrics through to some model pod,
# which would count that pod's series twice under the router's name.
SELECTOR = "app.kubernetes.io/name=dscache,app.kubernetes.io/component=model"
PORT_NAMES = ("http", "metrics")
_SELECTED = dict(pair.split("=", 1) for pair in SELECTOR.split(","))


def targets(pods: dict[str, Any]) -> list[dict[str, Any]]:
    """file_sd target groups for the pods of a ``/api/v1/pods`` list."""
    groups = []
    for pod in pods.get("items", []):
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        pod_labels = meta.get("labels") or {}
        if any(pod_labels.get(k) != v for k, v in _SELECTED.items()):
            continue
        for container in spec.get("containers") or []:
            for port in container.get("ports") or []:
                if port.get("name") not in PORT_NAMES:
                    continue
                labels = {
                    "namespace": meta["namespace"],
                    "pod": meta["name"],
                    "container": container["name"],
                    "dscache_io_revision": pod_labels.get("dscache.io/revision", ""),
                    "dscache_io_slot": pod_labels.get("dscache.io/slot", ""),
                }
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": labels})
    return sorted(groups, key=lambda g: (g["targets"][0], g["labels"]["container"]))


def write_if_changed(path: Path, groups: list[dict[str, Any]], last: str | None) -> str:
    """Atomically replaces ``path`` when its text would change; returns the text."""
    text = json.dumps(groups, indent=1, sort_keys=True) + "\n"
    if text != last:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return text


def main(argv: list[str] | None = None) -> int:
    """``python -m dscache_tools.devcluster.podsd --server URL --pki DIR --out FILE``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--server", required=True, help="API server URL, https://HOST:PORT")
    p.add_argument("--pki", required=True, type=Path, help="the cluster's pki/ directory")
    p.add_argument("--out", required=True, type=Path, help="file_sd targets file to keep current")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between two listings")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s podsd: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    host, _, port = args.server.removeprefix("https://").rpartition(":")
    api = ApiClient(
        int(port),
        args.pki / "ca.crt",
        (args.pki / "admin.crt", args.pki / "admin.key"),
        host=host,
    )
    last = write_if_changed(args.out, [], None)
    path = "/api/v1/pods?" + urllib.parse.urlencode({"labelSelector": SELECTOR})
    while True:
        reply = api.get(path)
        if reply.status == 200 and isinstance(reply.body, dict):
            last = write_if_changed(args.out, targets(reply.body), last)
        else:
            logger.warning("listing pods: HTTP %s", reply.status)
        time.sleep(args.interval)


if __name__ == "__main__":
    raise SystemExit(main())
