"""The chart's operator as pods on a real node: in-cluster config, its own RBAC, two peered replicas.

Needs a dev cluster with a real node (kubelet + containerd running our core
image); on a cluster of simulated nodes only, a pod runs no process and the
test is skipped. Its own module: no local operator may run next to the pods.
"""

from __future__ import annotations

from typing import Any

import pytest
from dscache_tools.devcluster import DevCluster, wait_until
from operator_harness import apply_example

pytestmark = pytest.mark.cluster


def _peers(c: DevCluster, name: str) -> dict[str, Any]:
    out: dict[str, Any] = c.kubectl_json("get", "clusterkopfpeering", name).get("status") or {}
    return out


def _last_peering_state(log: str) -> str:
    """``active`` or ``paused``: what the replica's last peering message said."""
    state = "paused"
    for line in log.splitlines():
        if "Resuming operations after the pause" in line:
            state = "active"
        elif "Pausing operations in favour of" in line or "Pausing all operators" in line:
            state = "paused"
    return state


def test_the_charts_operator_runs_in_cluster_with_one_active_replica(
    dev_cluster: DevCluster, chart: str, ns: str
) -> None:
    c = dev_cluster
    if not getattr(c, "real_nodes", ()):
        pytest.skip("needs a real node in the dev cluster: operator pods run the core image")
    c.kubectl("scale", "deployment/dscache", "-n", chart, "--replicas=2")
    try:
        c.kubectl("rollout", "status", "deployment/dscache", "-n", chart, "--timeout=300s")
        pods = c.kubectl_json("get", "pods", "-n", chart, "-l", "app.kubernetes.io/name=dscache")
        names = sorted(p["metadata"]["name"] for p in pods["items"])
        assert len(names) == 2
        # kopf's identity is the pod name (POD_ID); both keep their record alive.
        wait_until(
            "both replicas in the peering", lambda: set(_peers(c, "dscache")) == set(names), 120
        )

        apply_example(c, ns, "01-minimal")

        def reconciled() -> dict[str, Any] | None:
            body = c.kubectl_json("get", "dscd", "chat", "-n", ns)
            st = body.get("status") or {}
            done = st.get("observedGeneration") == body["metadata"]["generation"]
            return body if done else None

        body = wait_until("the in-cluster operator reconciled the example", reconciled, 180)
        deps = c.kubectl_json(
            "get", "deployments", "-n", ns, "-l", "app.kubernetes.io/instance=chat"
        )
        assert {d["metadata"]["name"] for d in deps["items"]} == {"chat-blue", "chat-router"}
        for d in deps["items"]:
            assert d["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]

        def logs_of_all() -> dict[str, str]:
            return {n: c.kubectl("logs", n, "-n", chart).stdout for n in names}

        def settled() -> dict[str, str] | None:
            got = logs_of_all()
            active = [n for n, text in got.items() if _last_peering_state(text) == "active"]
            return got if len(active) == 1 else None

        try:
            logs = wait_until("one replica active", settled, 60, 2.0)
        except TimeoutError:
            logs = logs_of_all()
        # kopf starts a peered replica paused and resumes it when it sees no live
        # peer of higher priority. Two replicas started together can both resume
        # before either has written its keep-alive; the younger pauses as soon as
        # it reads the older's. What matters is where they settle: one acts.
        active = [n for n, text in logs.items() if _last_peering_state(text) == "active"]
        assert len(active) == 1, {n: t[-2000:] for n, t in logs.items()}
        for text in logs.values():
            # The ServiceAccount token, in-cluster config and the chart's RBAC were enough.
            # (Other modules' namespaces may still be terminating: the API refuses new
            # objects there with a 403 NamespaceTerminating, which is not about RBAC.)
            refused = [
                line
                for line in text.splitlines()
                if ("Forbidden" in line or " 403" in line) and "NamespaceTerminating" not in line
            ]
            assert not refused, "\n".join(refused)[-3000:]
            assert "Read-only file system" not in text, text[-3000:]
        c.kubectl("delete", "dscd", "chat", "-n", ns, "--timeout=120s")
    finally:
        # Back to zero: the other modules' operator runs as a local process.
        c.kubectl("scale", "deployment/dscache", "-n", chart, "--replicas=0", check=False)
