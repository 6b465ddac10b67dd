"""Real nodes: pods bound to a kubelet node run the dscache images for real.

What a user of ``dscache dev cluster up --real-nodes 1`` relies on: the node is
Ready, ordinary pods land on it (simulated nodes are tainted), containers run,
logs and exec work, a ClusterIP Service answers from the host and from pods,
pods reach the API server through the ``kubernetes`` Service, two containers
of a pod share a unix socket in an emptyDir, and pod traffic cannot leave the
machine.
"""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from typing import Any

import pytest
from dscache_tools.devcluster import DevCluster, wait_until
from dscache_tools.devcluster.host import BRIDGE_PREFIX, CHAIN
from dscache_tools.devcluster.nodes import NODE_KIND_LABEL, SIMULATED_TAINT
from dscache_tools.devcluster.realnodes import POD_CIDR
from kube_objects import apply, deployment

pytestmark = pytest.mark.cluster

CORE = "ghcr.io/dscache/dscache-core:0.1.0"
#: The images run as a non-root user with no shell: every command is exec form.
_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _pod_phase(cluster: DevCluster, ns: str, name: str) -> str:
    phase: str = cluster.kubectl_json("get", "pod", name, "-n", ns)["status"].get("phase", "")
    return phase


def _finished(cluster: DevCluster, ns: str, name: str) -> str | None:
    phase = _pod_phase(cluster, ns, name)
    return phase if phase in ("Succeeded", "Failed") else None


def _python_pod(name: str, code: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": CORE,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", code],
                    "securityContext": _SECURITY,
                }
            ],
            **spec,
        },
    }


def test_real_node_is_ready_and_simulated_nodes_are_tainted(dev_cluster: DevCluster) -> None:
    items = dev_cluster.kubectl_json("get", "nodes")["items"]
    kinds = {n["metadata"]["name"]: n["metadata"]["labels"].get(NODE_KIND_LABEL) for n in items}
    real = [name for name, kind in kinds.items() if kind == "real"]
    assert real == list(dev_cluster.real_nodes) == ["dev-real-0"]
    node = next(n for n in items if n["metadata"]["name"] == "dev-real-0")
    address = {a["type"]: a["address"] for a in node["status"]["addresses"]}["InternalIP"]
    assert address == "10.246.0.1"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    for n in items:
        if kinds[n["metadata"]["name"]] == "simulated":
            taints = {t["key"]: t["effect"] for t in n["spec"].get("taints", [])}
            assert taints.get(SIMULATED_TAINT) == "NoSchedule"


def test_pods_run_behind_a_service(dev_cluster: DevCluster, namespace: str) -> None:
    ns = namespace
    labels = {"app": "web"}
    web = {
        "name": "web",
        "image": CORE,
        "imagePullPolicy": "Never",
        "command": ["python", "-m", "http.server", "8080"],
        "workingDir": "/opt",
        "ports": [{"containerPort": 8080, "name": "http"}],
        "readinessProbe": {"tcpSocket": {"port": "http"}},
        "securityContext": _SECURITY,
    }
    no_token = {"automountServiceAccountToken": False}
    apply(dev_cluster, ns, deployment("web", [web], replicas=2, pod=no_token))
    apply(
        dev_cluster,
        ns,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )
    dev_cluster.kubectl("rollout", "status", "-n", ns, "deployment/web", "--timeout=120s")
    pods = dev_cluster.kubectl_json("get", "pods", "-n", ns, "-l", "app=web")["items"]
    assert {p["spec"]["nodeName"] for p in pods} == {"dev-real-0"}
    assert all(p["status"]["podIP"].startswith("10.246.0.") for p in pods)

    ip = dev_cluster.kubectl_json("get", "service", "web", "-n", ns)["spec"]["clusterIP"]

    # From the host, through kube-proxy's rules. kube-proxy rejects (connection
    # refused) until it has synced the Service's ready endpoints, a moment after
    # the rollout is reported done.
    def listing() -> bytes | None:
        try:
            with urllib.request.urlopen(f"http://{ip}/", timeout=10) as reply:
                return reply.read() if reply.status == 200 else None
        except (urllib.error.URLError, ConnectionError):
            return None

    assert b"Directory listing" in wait_until("the Service answers", listing, 60, 1.0)

    # From a pod: the Service, and the API server through the kubernetes Service.
    code = (
        "import os, ssl, urllib.request as u\n"
        f"print('svc', u.urlopen('http://{ip}/', timeout=10).status)\n"
        "d = '/var/run/secrets/kubernetes.io/serviceaccount/'\n"
        "ctx = ssl.create_default_context(cafile=d + 'ca.crt')\n"
        "r = u.Request('https://' + os.environ['KUBERNETES_SERVICE_HOST'] + '/version',"
        " headers={'Authorization': 'Bearer ' + open(d + 'token').read()})\n"
        "print('api', u.urlopen(r, context=ctx, timeout=10).status)\n"
    )
    apply(dev_cluster, ns, _python_pod("client", code))
    assert wait_until("client to finish", lambda: _finished(dev_cluster, ns, "client"), 120) == (
        "Succeeded"
    ), dev_cluster.kubectl("logs", "-n", ns, "client", check=False).stdout
    logs = dev_cluster.kubectl("logs", "-n", ns, "client").stdout.split("\n")
    assert "svc 200" in logs and "api 200" in logs

    exec_out = dev_cluster.kubectl(
        "exec", "-n", ns, "deployment/web", "--", "python", "-c", "import os; print(os.getuid())"
    )
    assert exec_out.stdout.strip() == "10001"


def test_containers_share_a_unix_socket_in_an_empty_dir(
    dev_cluster: DevCluster, namespace: str
) -> None:
    """The model server reaches its sidecar this way: one emptyDir, two containers."""
    ns = namespace
    server = (
        "import os, socket\n"
        "s = socket.socket(socket.AF_UNIX); s.bind('/run/sockets/s.sock'); s.listen(1)\n"
        "c, _ = s.accept(); c.sendall(b'hello from ' + str(os.getpid()).encode()); c.close()\n"
    )
    client = (
        "import socket, time\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        s = socket.socket(socket.AF_UNIX); s.connect('/run/sockets/s.sock'); break\n"
        "    except OSError: time.sleep(0.2)\n"
        "print(s.recv(100).decode())\n"
    )
    mount = [{"name": "sockets", "mountPath": "/run/sockets"}]
    pod = _python_pod("pair", server, volumes=[{"name": "sockets", "emptyDir": {}}])
    pod["spec"]["containers"][0]["volumeMounts"] = mount
    second = {**pod["spec"]["containers"][0], "name": "client", "command": ["python", "-c", client]}
    pod["spec"]["containers"].append(second)
    apply(dev_cluster, ns, pod)
    assert wait_until("pair to finish", lambda: _finished(dev_cluster, ns, "pair"), 120) == (
        "Succeeded"
    )
    out = dev_cluster.kubectl("logs", "-n", ns, "pair", "-c", "client").stdout
    assert out.startswith("hello from ")


def test_pod_traffic_cannot_leave_the_machine(dev_cluster: DevCluster) -> None:
    """Before any filter rule, mangle's FORWARD drops pod packets not bound for a node bridge."""

    def rules(table: str, chain: str) -> list[str]:
        out = subprocess.run(
            ["iptables", "-w", "-t", table, "-S", chain], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        return [line for line in out if line.startswith("-A ")]

    assert rules("mangle", "FORWARD")[0] == f"-A FORWARD -j {CHAIN}"
    assert rules("mangle", CHAIN) == [f"-A {CHAIN} -s {POD_CIDR} ! -o {BRIDGE_PREFIX}+ -j DROP"]
    # Pods are not masqueraded either: no NAT rule rewrites the pod network's source.
    assert not [r for r in rules("nat", "POSTROUTING") if f"-s {POD_CIDR}" in r]
