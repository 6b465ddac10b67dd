"""Deployments on the dev cluster go through the real controllers and scheduler.

A Deployment makes a ReplicaSet, the ReplicaSet makes pods, the scheduler binds
them to KWOK nodes (the pods tolerate their taint) and KWOK reports them Running
and Ready; an image update rolls out a second ReplicaSet and ``kubectl rollout
undo`` restores the first template.
"""

from __future__ import annotations

from typing import Any

import pytest
from dscache_tools.devcluster import DevCluster, wait_until
from dscache_tools.devcluster.nodes import SIMULATED_PLACEMENT
from kube_objects import apply, deployment

pytestmark = pytest.mark.cluster


def _deployment(image: str) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": image,
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
    }
    surge = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return deployment(
        "web", [container], replicas=3, pod=SIMULATED_PLACEMENT, spec={"strategy": surge}
    )


def _pods(cluster: DevCluster, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "app=web")[
        "items"
    ]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def _all_ready_with(cluster: DevCluster, ns: str, image: str) -> bool:
    """Three pods, all Ready, all running ``image``."""
    pods = _pods(cluster, ns)
    return len(pods) == 3 and all(
        _ready(p) and p["spec"]["containers"][0]["image"] == image for p in pods
    )


def test_deployment_rollout_and_undo(dev_cluster: DevCluster, namespace: str) -> None:
    ns = namespace
    apply(dev_cluster, ns, _deployment("registry.local/web:1"))
    dev_cluster.kubectl("rollout", "status", "-n", ns, "deployment/web", "--timeout=90s")

    replicasets = dev_cluster.kubectl_json("get", "replicasets", "-n", ns)["items"]
    assert len(replicasets) == 1
    first_rs = replicasets[0]
    owner = first_rs["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("Deployment", "web")

    pods = _pods(dev_cluster, ns)
    assert len(pods) == 3
    node_names = {n["metadata"]["name"] for n in dev_cluster.kubectl_json("get", "nodes")["items"]}
    for pod in pods:
        assert pod["metadata"]["ownerReferences"][0]["name"] == first_rs["metadata"]["name"]
        assert pod["spec"]["nodeName"] in node_names
        assert _ready(pod), pod["status"]
        assert pod["status"].get("podIP"), "KWOK assigns pod IPs"

    dev_cluster.kubectl("set", "image", "-n", ns, "deployment/web", "web=registry.local/web:2")
    dev_cluster.kubectl("rollout", "status", "-n", ns, "deployment/web", "--timeout=90s")
    replicasets = dev_cluster.kubectl_json("get", "replicasets", "-n", ns)["items"]
    assert len(replicasets) == 2
    images = {
        rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"]: (
            rs["spec"]["template"]["spec"]["containers"][0]["image"],
            rs["spec"]["replicas"],
        )
        for rs in replicasets
    }
    assert images == {"1": ("registry.local/web:1", 0), "2": ("registry.local/web:2", 3)}
    wait_until(
        "three ready pods of the new image",
        lambda: _all_ready_with(dev_cluster, ns, "registry.local/web:2"),
    )
    history = dev_cluster.kubectl("rollout", "history", "-n", ns, "deployment/web").stdout
    revisions = [line.split()[0] for line in history.splitlines() if line[:1].isdigit()]
    assert revisions == ["1", "2"], history

    dev_cluster.kubectl("rollout", "undo", "-n", ns, "deployment/web")
    dev_cluster.kubectl("rollout", "status", "-n", ns, "deployment/web", "--timeout=90s")
    web = dev_cluster.kubectl_json("get", "deployment", "-n", ns, "web")
    image = web["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.local/web:1"
    # The undo re-used the first ReplicaSet, which now carries revision 3.
    restored = dev_cluster.kubectl_json("get", "replicaset", "-n", ns, first_rs["metadata"]["name"])
    assert restored["spec"]["replicas"] == 3
    assert restored["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"
    assert web["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"
    wait_until(
        "three ready pods of the restored image",
        lambda: _all_ready_with(dev_cluster, ns, "registry.local/web:1"),
    )


def test_versions_are_stamped(dev_cluster: DevCluster) -> None:
    """kubectl, the API server and helm report the pinned release, not v0.0.0."""
    from dscache_tools.devcluster import PINNED

    version = dev_cluster.kubectl_json("version")
    assert version["serverVersion"]["gitVersion"] == PINNED.kubernetes
    assert version["clientVersion"]["gitVersion"] == PINNED.kubernetes
    major, minor = PINNED.kubernetes_minor
    assert (version["serverVersion"]["major"], version["serverVersion"]["minor"]) == (major, minor)
    helm_version = dev_cluster.helm("version", "--short").stdout.strip()
    assert helm_version.startswith(PINNED.helm)
