"""Owner references on the dev cluster: the real garbage collector deletes dependents."""

from __future__ import annotations

import pytest
from dscache_tools.devcluster import DevCluster, wait_until
from dscache_tools.devcluster.nodes import SIMULATED_PLACEMENT
from kube_objects import apply, deployment

pytestmark = pytest.mark.cluster


def test_deleting_owner_collects_owned_objects(dev_cluster: DevCluster, namespace: str) -> None:
    ns = namespace
    dev_cluster.kubectl("create", "configmap", "owner", "-n", ns, "--from-literal=k=v")
    uid = dev_cluster.kubectl_json("get", "configmap", "owner", "-n", ns)["metadata"]["uid"]
    owner_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
    for name in ("child-a", "child-b"):
        child = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "ownerReferences": [owner_ref]},
            "stringData": {"x": name},
        }
        apply(dev_cluster, ns, child)
    dev_cluster.kubectl("create", "secret", "generic", "bystander", "-n", ns, "--from-literal=x=y")

    dev_cluster.kubectl("delete", "configmap", "owner", "-n", ns)

    def remaining() -> set[str] | None:
        items = dev_cluster.kubectl_json("get", "secrets", "-n", ns)["items"]
        names = {s["metadata"]["name"] for s in items}
        return names if names.isdisjoint({"child-a", "child-b"}) else None

    assert wait_until("owned secrets to be collected", remaining) == {"bystander"}


def test_deleting_a_deployment_removes_its_replicasets_and_pods(
    dev_cluster: DevCluster, namespace: str
) -> None:
    ns = namespace
    containers = [{"name": "gc", "image": "registry.local/gc:1"}]
    apply(dev_cluster, ns, deployment("gc", containers, replicas=2, pod=SIMULATED_PLACEMENT))
    dev_cluster.kubectl("rollout", "status", "-n", ns, "deployment/gc", "--timeout=90s")
    assert dev_cluster.kubectl_json("get", "pods", "-n", ns, "-l", "app=gc")["items"]

    dev_cluster.kubectl("delete", "deployment", "gc", "-n", ns, "--cascade=background")
    wait_until(
        "replicasets and pods of the deleted deployment to go",
        lambda: (
            not dev_cluster.kubectl_json("get", "replicasets", "-n", ns)["items"]
            and not dev_cluster.kubectl_json("get", "pods", "-n", ns)["items"]
        ),
    )
