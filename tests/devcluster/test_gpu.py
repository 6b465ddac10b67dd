"""GPU scheduling on the dev cluster: ``nvidia.com/gpu`` is a real extended resource.

With three nodes, dev-node-0 and dev-node-1 advertise 8 GPUs each and
dev-node-2 none (see :mod:`dscache_tools.devcluster.nodes`).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from dscache_tools.devcluster import DevCluster, wait_until
from dscache_tools.devcluster.nodes import GPU_RESOURCE, GPUS_PER_NODE, SIMULATED_PLACEMENT

pytestmark = pytest.mark.cluster


def _pod(name: str, gpus: int, node: str | None = None) -> str:
    resources: dict[str, Any] = {"requests": {"cpu": "100m"}}
    if gpus:
        resources = {"limits": {GPU_RESOURCE: str(gpus)}}
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "registry.local/infer:1", "resources": resources}],
        **SIMULATED_PLACEMENT,
    }
    if node:
        spec["nodeSelector"] = {**spec["nodeSelector"], "kubernetes.io/hostname": node}
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})


def _gpu_nodes(cluster: DevCluster) -> tuple[set[str], set[str]]:
    with_gpu, without = set(), set()
    for node in cluster.kubectl_json("get", "nodes", "-l", "dscache.io/node-kind=simulated")[
        "items"
    ]:
        count = int(node["status"]["allocatable"].get(GPU_RESOURCE, "0"))
        (with_gpu if count else without).add(node["metadata"]["name"])
    return with_gpu, without


def _running_on(cluster: DevCluster, ns: str, name: str) -> str | None:
    pod = cluster.kubectl_json("get", "pod", name, "-n", ns)
    if pod["status"].get("phase") != "Running":
        return None
    node: str = pod["spec"]["nodeName"]
    return node


def _unschedulable_message(cluster: DevCluster, ns: str, name: str) -> str | None:
    pod = cluster.kubectl_json("get", "pod", name, "-n", ns)
    for condition in pod["status"].get("conditions", []):
        if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
            message: str = condition["message"]
            return message
    return None


def test_nodes_advertise_gpus(dev_cluster: DevCluster) -> None:
    with_gpu, without = _gpu_nodes(dev_cluster)
    assert with_gpu == {"dev-node-0", "dev-node-1"}
    assert without == {"dev-node-2"}


def test_gpu_pods_land_only_on_gpu_nodes(dev_cluster: DevCluster, namespace: str) -> None:
    ns = namespace
    with_gpu, without = _gpu_nodes(dev_cluster)
    names = [f"gpu-{i}" for i in range(4)]
    for name in names:
        dev_cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=_pod(name, gpus=1))
    for name in names:
        node = wait_until(f"{name} running", lambda n=name: _running_on(dev_cluster, ns, n))
        assert node in with_gpu

    # The CPU-only node takes ordinary pods but not a GPU pod pinned to it.
    dev_cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=_pod("cpu-pinned", gpus=0, node=sorted(without)[0])
    )
    assert wait_until("cpu pod running", lambda: _running_on(dev_cluster, ns, "cpu-pinned")) in (
        without
    )
    dev_cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=_pod("gpu-pinned", gpus=1, node=sorted(without)[0])
    )
    message = wait_until(
        "gpu-pinned to be unschedulable",
        lambda: _unschedulable_message(dev_cluster, ns, "gpu-pinned"),
    )
    assert f"Insufficient {GPU_RESOURCE}" in message


def test_pod_needing_more_gpus_than_any_node_stays_pending(
    dev_cluster: DevCluster, namespace: str
) -> None:
    ns = namespace
    dev_cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=_pod("huge", gpus=GPUS_PER_NODE + 1))
    message = wait_until(
        "huge to be unschedulable", lambda: _unschedulable_message(dev_cluster, ns, "huge")
    )
    assert f"Insufficient {GPU_RESOURCE}" in message
    pod = dev_cluster.kubectl_json("get", "pod", "huge", "-n", ns)
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")

    # A pod asking for every GPU of one node fits.
    dev_cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=_pod("full", gpus=GPUS_PER_NODE))
    wait_until("full running", lambda: _running_on(dev_cluster, ns, "full"))
