"""Kubernetes objects the dev cluster's tests create, written once.

Imported by the test modules beside it (``from kube_objects import ...``).
"""

from __future__ import annotations

import json
from typing import Any

from dscache_tools.devcluster import DevCluster


def deployment(
    name: str,
    containers: list[dict[str, Any]],
    *,
    replicas: int,
    pod: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Deployment ``name`` whose pods carry the label ``app=<name>``.

    Args:
        name: Its name and the ``app`` label of it and its pods.
        containers: The pod's containers.
        replicas: How many pods.
        pod: More fields of the pod spec (placement, service account token).
        spec: More fields of the Deployment spec (strategy).
    """
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            **(spec or {}),
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": containers, **(pod or {})},
            },
        },
    }


def apply(cluster: DevCluster, ns: str, obj: dict[str, Any]) -> None:
    """``kubectl apply`` of ``obj`` in namespace ``ns``."""
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=json.dumps(obj))
