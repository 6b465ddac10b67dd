"""The control plane's command lines and readiness checks, as data and small probes.

Contract:
    * :func:`commands` is pure: the command line of etcd, kube-apiserver,
      kube-controller-manager, kube-scheduler and KWOK for one cluster.
      Everything but the API server binds 127.0.0.1; the API server binds
      ``address`` (loopback, or node 0's bridge with real nodes, where pods
      reach it). etcd runs without fsync: the cluster is throw-away.
    * The API server authorises with Node and RBAC and verifies clients
      against the cluster CA; with real nodes it reaches the kubelets with the
      admin certificate at their InternalIP, without them its ``kubernetes``
      Service has no endpoints (a loopback address cannot be one).
    * :func:`node_ready` is true for a Ready node without a not-ready or
      unreachable taint; :func:`wait_ready` waits for the controller manager
      and scheduler health, every dev node, and the ``default``
      ServiceAccount (pods cannot be created before it exists).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dscache_tools.devcluster import nodes
from dscache_tools.devcluster.api import ApiClient
from dscache_tools.devcluster.build import Binaries

if TYPE_CHECKING:
    from dscache_tools.devcluster.pki import Pki
    from dscache_tools.devcluster.supervisor import Supervisor

#: Service range; its first address is the ``kubernetes`` Service.
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
#: Pod IPs KWOK hands out.
POD_CIDR = "10.244.0.0/16"
#: The ports each cluster takes (free ones, chosen at start).
PORTS = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")
#: Components that are clients of the API server and serve ``/healthz``: name -> port key.
_HEALTH_PORTS = {"kube-controller-manager": "controller-manager", "kube-scheduler": "scheduler"}


def commands(
    binaries: Binaries,
    state_dir: Path,
    material: Pki,
    *,
    ports: Mapping[str, int],
    kubeconfig: Path,
    address: str = "127.0.0.1",
    real_nodes: bool = False,
) -> dict[str, list[str]]:
    """Command lines of the control plane's components, by component name."""
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
    kc = str(kubeconfig)
    # The controller manager and scheduler authenticate alike against the API server.
    client = [
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
        "--profiling=false",
    ]
    return {
        "etcd": [
            str(binaries.etcd),
            "--name=dev",
            f"--data-dir={state_dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=dev={peer_url}",
            "--initial-cluster-state=new",
            # A throw-away cluster: durability costs start-up time for nothing.
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ],
        "kube-apiserver": _apiserver(
            binaries,
            material,
            etcd_url=etcd_url,
            ports=ports,
            address=address,
            real_nodes=real_nodes,
        ),
        "kube-controller-manager": [
            str(binaries.kube_controller_manager),
            *client,
            f"--secure-port={ports['controller-manager']}",
            f"--root-ca-file={material.ca_cert}",
            f"--service-account-private-key-file={material.service_account_key}",
            f"--cluster-signing-cert-file={material.ca_cert}",
            f"--cluster-signing-key-file={material.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
        ],
        "kube-scheduler": [
            str(binaries.kube_scheduler),
            *client,
            f"--secure-port={ports['scheduler']}",
        ],
        "kwok": [
            str(binaries.kwok),
            f"--kubeconfig={kc}",
            f"--config={state_dir / 'kwok.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={nodes.KWOK_SELECTOR}",
            "--node-lease-duration-seconds=40",
            f"--cidr={POD_CIDR}",
            "--node-ip=10.0.0.1",
        ],
    }


def _apiserver(
    binaries: Binaries,
    material: Pki,
    *,
    etcd_url: str,
    ports: Mapping[str, int],
    address: str,
    real_nodes: bool,
) -> list[str]:
    if real_nodes:
        # Logs, exec and port-forward reach the kubelets at their node IPs.
        kubelets = [
            f"--kubelet-client-certificate={material.admin_cert}",
            f"--kubelet-client-key={material.admin_key}",
            f"--kubelet-certificate-authority={material.ca_cert}",
            "--kubelet-preferred-address-types=InternalIP",
        ]
    else:
        # The kubernetes Service cannot point at a loopback address.
        kubelets = ["--endpoint-reconciler-type=none"]
    return [
        str(binaries.kube_apiserver),
        f"--etcd-servers={etcd_url}",
        f"--bind-address={address}",
        f"--advertise-address={address}",
        f"--secure-port={ports['apiserver']}",
        f"--tls-cert-file={material.serving_cert}",
        f"--tls-private-key-file={material.serving_key}",
        f"--client-ca-file={material.ca_cert}",
        f"--service-account-key-file={material.service_account_pub}",
        f"--service-account-signing-key-file={material.service_account_key}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        *kubelets,
        "--profiling=false",
    ]


def admin_client(server: str, material_dir: Path) -> ApiClient | None:
    """An admin :class:`ApiClient` for ``server`` (``https://host:port``), if its PKI exists."""
    address, _, port = server.removeprefix("https://").rpartition(":")
    if not port.isdigit() or not (material_dir / "admin.crt").exists():
        return None
    return ApiClient(
        int(port),
        material_dir / "ca.crt",
        (material_dir / "admin.crt", material_dir / "admin.key"),
        host=address,
    )


def wait_ready(
    supervisor: Supervisor,
    client: ApiClient,
    ports: Mapping[str, int],
    node_count: int,
    deadline: float,
) -> None:
    """Waits until the cluster is ready (see the module contract).

    Raises:
        ClusterError: A component exited or did not become ready by ``deadline``.
    """
    for name, port_key in _HEALTH_PORTS.items():
        supervisor.wait(name, healthz(ApiClient(ports[port_key], None, timeout=2.0)), deadline)

    def nodes_ready() -> bool:
        reply = client.get(f"/api/v1/nodes?labelSelector={nodes.DEV_NODE_LABEL}%3Dtrue")
        if reply.status != 200:
            return False
        items = reply.body.get("items", [])
        return len(items) == node_count and all(node_ready(n) for n in items)

    supervisor.wait("kwok", nodes_ready, deadline)
    supervisor.wait(
        "kube-controller-manager",
        lambda: client.get("/api/v1/namespaces/default/serviceaccounts/default").status == 200,
        deadline,
    )


def http_ok(url: str) -> bool:
    """True when a GET of ``url`` (a local address) answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - a local URL
            return int(reply.status) == 200
    except OSError:
        return False


def healthz(api: ApiClient) -> Callable[[], bool]:
    """A probe: ``/healthz`` of ``api`` answers 200."""
    return lambda: api.get("/healthz").status == 200


def node_ready(node: Mapping[str, Any]) -> bool:
    """True for a Ready node without a not-ready or unreachable taint."""
    conditions = node.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints", [])
    blocked = any(
        t.get("key") in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
        for t in taints
    )
    return ready and not blocked
