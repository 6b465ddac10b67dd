"""What a dev cluster runs beside its control plane: real nodes' agents and Prometheus.

:mod:`.realnodes` says what a real node is (paths, addresses, config texts) and
:mod:`.host` what it changes on the machine; this module starts and drains
the processes of a running cluster (anything shaped as :class:`NodeHost`, which
:class:`.cluster.DevCluster` is; this module never imports it): one containerd,
one kubelet and one NetworkPolicy controller (kube-router's firewall alone:
policies are enforced on real nodes) per real node, one kube-proxy, and Prometheus with its
pod discovery loop (:mod:`.podsd`).

Contract:
    * :func:`prepare_host` claims the host and records every change before
      making it (bridges, sysctls, the egress chain), so ``stop`` can undo it.
    * :func:`start_real_nodes` imports the images into each node's containerd
      before its kubelet starts (kubelets never pull) and removes containers
      a previous cluster left in the cached image store; it returns the seconds
      spent importing, which do not count against the start-up timeout.
    * :func:`drain_real_nodes` deletes the pods bound to real nodes and waits
      (up to 45 s) until the kubelets tore their containers down.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dscache_tools.devcluster import host, kubeconfig, nodes, prometheus, realnodes
from dscache_tools.devcluster.controlplane import admin_client, http_ok
from dscache_tools.devcluster.supervisor import ClusterError, ProcessRecord, Supervisor
from dscache_tools.net import free_port
from dscache_tools.polling import poll

if TYPE_CHECKING:
    from dscache_tools.devcluster.build import Binaries
    from dscache_tools.devcluster.pki import Pki

logger = logging.getLogger(__name__)

#: Imports the dev images into the containerd listening on the given socket.
ImageLoader = Callable[[Path], None]
#: Sub-directories of a real node's directory, created before its agents start.
_NODE_DIRS = ("containerd", "cni/net.d", "kubelet", "pod-logs", "volume-plugins")


class NodeHost(Protocol):
    """What the node agents need of the cluster they join (a ``DevCluster``)."""

    state_dir: Path
    server: str
    binaries: Binaries
    processes: list[ProcessRecord]
    supervisor: Supervisor
    prometheus_url: str | None

    def running(self) -> list[str]: ...

    def save(self) -> None: ...


def prepare_host(state_dir: Path, plans: list[realnodes.NodePlan]) -> host.HostRecord | None:
    """Claims the host and makes the network changes real nodes need (recorded)."""
    if not plans:
        return None
    try:
        record = host.claim(state_dir)
        host.remember_sysctls(record, host.KUBELET_SYSCTLS)
        host.remember_kube_chains(record)
        host.remember_netns(record)
        host.set_sysctls(record, host.NETWORK_SYSCTLS)
        for plan in plans:
            host.add_bridge(record, plan.bridge, f"{plan.ip}/24")
            host.add_mount_root(record, plan.directory)
        host.keep_pods_local(record, realnodes.POD_CIDR)
    except host.HostError as exc:
        raise ClusterError(str(exc)) from exc
    return record


def start_real_nodes(
    cluster: NodeHost,
    plans: list[realnodes.NodePlan],
    *,
    record: host.HostRecord,
    material: Pki,
    load_images: ImageLoader,
) -> float:
    """Starts containerd, imports images, starts the kubelets and kube-proxy.

    Returns:
        Seconds spent importing images (not counted against the timeout).
    """
    import_s = 0.0
    for plan in plans:
        _start_containerd(cluster, plan)
        began = time.monotonic()
        load_images(plan.containerd_socket)
        import_s += time.monotonic() - began
    record.kube_proxy = str(cluster.binaries.kube_proxy)
    _record_owners(cluster, record)
    for plan in plans:
        host.add_cgroup(record, plan.cgroup_name)
        _start_kubelet(cluster, plan, material)
    _start_kube_proxy(cluster, plans[0], material)
    for plan in plans:
        _start_netpol(cluster, plan, record)
    _record_owners(cluster, record)
    return import_s


def _record_owners(cluster: NodeHost, record: host.HostRecord) -> None:
    """The host stays claimed while any of the cluster's processes lives."""
    record.owners = [(p.pid, p.exe) for p in cluster.processes]
    record.save()


def _start_containerd(cluster: NodeHost, plan: realnodes.NodePlan) -> None:
    for sub in _NODE_DIRS:
        (plan.directory / sub).mkdir(parents=True, exist_ok=True)
    plan.image_store.mkdir(parents=True, exist_ok=True)
    config = plan.directory / "containerd" / "config.toml"
    config.write_text(realnodes.containerd_config(plan))
    (plan.directory / "cni" / "net.d" / "10-dscache.conflist").write_text(
        realnodes.cni_config(plan)
    )
    name = f"containerd-{plan.name}"
    cluster.supervisor.launch(name, [host.which("containerd"), "--config", str(config)])
    socket = plan.containerd_socket
    cluster.supervisor.wait(name, functools.partial(_containerd_up, socket), time.monotonic() + 60)
    purged = realnodes.purge_containers(socket)
    if purged:
        logger.info("removed %d stale containers from %s", purged, plan.image_store)


def _start_kubelet(cluster: NodeHost, plan: realnodes.NodePlan, material: Pki) -> None:
    from dscache_tools.devcluster import pki  # cryptography: the 'dev' extra

    creds = pki.node_credentials(material, plan.directory / "pki", plan.name, plan.ip)
    node_kubeconfig = kubeconfig.write(
        plan.directory / "kubelet.kubeconfig",
        cluster.server,
        material,
        client=(creds.client_cert, creds.client_key),
        user=plan.name,
    )
    kubelet_conf = plan.directory / "kubelet.yaml"
    kubelet_conf.write_text(
        realnodes.kubelet_config(
            plan,
            ca_cert=material.ca_cert,
            serving=(creds.serving_cert, creds.serving_key),
            port=free_port(),
            healthz_port=free_port(),
        )
    )
    labels = f"{nodes.DEV_NODE_LABEL}=true,{realnodes.NODE_KIND_LABEL}=real"
    cluster.supervisor.launch(
        f"kubelet-{plan.name}",
        [
            str(cluster.binaries.kubelet),
            f"--config={kubelet_conf}",
            f"--kubeconfig={node_kubeconfig}",
            f"--root-dir={plan.directory / 'kubelet'}",
            f"--cert-dir={plan.directory / 'pki'}",
            f"--hostname-override={plan.name}",
            f"--node-ip={plan.ip}",
            f"--node-labels={labels}",
            "--v=1",
        ],
    )


def _start_kube_proxy(cluster: NodeHost, plan: realnodes.NodePlan, material: Pki) -> None:
    from dscache_tools.devcluster import pki  # cryptography: the 'dev' extra

    state = cluster.state_dir
    cert = pki.client_credentials(material, state / "pki", "kube-proxy", "system:kube-proxy")
    proxy_kubeconfig = kubeconfig.write(
        state / "kube-proxy.kubeconfig", cluster.server, material, client=cert, user="kube-proxy"
    )
    proxy_conf = state / "kube-proxy.yaml"
    proxy_conf.write_text(
        realnodes.kube_proxy_config(
            plan,
            kubeconfig=proxy_kubeconfig,
            healthz_port=free_port(),
            metrics_port=free_port(),
        )
    )
    cluster.supervisor.launch(
        "kube-proxy", [str(cluster.binaries.kube_proxy), f"--config={proxy_conf}"]
    )


#: The NetworkPolicy controller's RBAC: reads only (kube-router's informers also
#: watch Services and endpoints, even with its service proxy off).
_NETPOL_RULES = [
    {
        "apiGroups": [""],
        "resources": ["pods", "namespaces", "nodes", "services", "endpoints"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch"],
    },
]
NETPOL_NAME = "dscache-netpol"


def _netpol_token(cluster: NodeHost) -> str:
    """A ServiceAccount token for the controller (its account, role and binding created)."""
    api = admin_client(cluster.server, cluster.state_dir / "pki")
    if api is None:
        raise ClusterError("no admin credentials for the NetworkPolicy controller's account")
    ns = "kube-system"
    objects = [
        (f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": NETPOL_NAME}}),
        (
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            {"metadata": {"name": NETPOL_NAME}, "rules": _NETPOL_RULES},
        ),
        (
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            {
                "metadata": {"name": NETPOL_NAME},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": NETPOL_NAME,
                },
                "subjects": [{"kind": "ServiceAccount", "name": NETPOL_NAME, "namespace": ns}],
            },
        ),
    ]
    for path, body in objects:
        reply = api.post(path, body)
        if reply.status not in (201, 409):
            raise ClusterError(f"creating {path}: HTTP {reply.status} {reply.body}")
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 7 * 86400},
    }
    path = f"/api/v1/namespaces/{ns}/serviceaccounts/{NETPOL_NAME}/token"
    reply = api.post(path, request)
    token = (reply.body or {}).get("status", {}).get("token") if reply.status == 201 else None
    if not token:
        raise ClusterError(f"a token for {NETPOL_NAME}: HTTP {reply.status} {reply.body}")
    return str(token)


def _start_netpol(cluster: NodeHost, plan: realnodes.NodePlan, record: host.HostRecord) -> None:
    """Starts kube-router's firewall alone for ``plan``'s node: NetworkPolicies are enforced.

    It programs iptables (KUBE-ROUTER-* and KUBE-NWPLCY-* chains, undone with the
    other KUBE-* chains) and ipsets (those made after it starts are destroyed by
    :func:`host.undo`); its routing and service proxy stay off (the bridge and
    kube-proxy do those). It lets the node's own traffic through (kubelet probes,
    Prometheus on the host). Without the ``ipset`` tool the node runs without it and
    says so: NetworkPolicies are then not enforced.
    """
    if host.find("ipset") is None:
        logger.warning(
            "NetworkPolicies are not enforced on %s: the NetworkPolicy controller needs the "
            "ipset tool (apt-get install ipset)",
            plan.name,
        )
        return
    creds = plan.directory / "netpol"
    creds.mkdir(parents=True, exist_ok=True)
    config = creds / "kubeconfig"
    config.touch(mode=0o600)
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "dev",
                        "cluster": {
                            "server": cluster.server,
                            "certificate-authority": str(cluster.state_dir / "pki" / "ca.crt"),
                        },
                    }
                ],
                "users": [{"name": NETPOL_NAME, "user": {"token": _netpol_token(cluster)}}],
                "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": NETPOL_NAME}}],
                "current-context": "dev",
            }
        )
    )
    # kube-router finds its node by name at start: wait for the kubelet to register it.
    api = admin_client(cluster.server, cluster.state_dir / "pki")
    cluster.supervisor.wait(
        f"kubelet-{plan.name}",
        lambda: api is not None and api.get(f"/api/v1/nodes/{plan.name}").status == 200,
        time.monotonic() + 120,
    )
    host.remember_ipsets(record)
    health = free_port()
    name = f"netpol-{plan.name}"
    cluster.supervisor.launch(
        name,
        [
            str(cluster.binaries.netpol),
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--run-loadbalancer=false",
            f"--kubeconfig={config}",
            f"--hostname-override={plan.name}",
            f"--health-port={health}",
            "--metrics-port=0",
            "--enable-ipv6=false",
            "--v=1",
        ],
    )
    url = f"http://127.0.0.1:{health}/healthz"
    cluster.supervisor.wait(name, functools.partial(http_ok, url), time.monotonic() + 90)


def start_prometheus(cluster: NodeHost, binary: str, address: str) -> None:
    """Starts :mod:`.podsd` and Prometheus on ``address``; sets ``cluster.prometheus_url``."""
    targets = cluster.state_dir / "prometheus-targets.json"
    cluster.supervisor.launch(
        "podsd",
        [
            sys.executable,
            "-m",
            "dscache_tools.devcluster.podsd",
            f"--server={cluster.server}",
            f"--pki={cluster.state_dir / 'pki'}",
            f"--out={targets}",
        ],
    )
    cluster.supervisor.wait("podsd", targets.exists, time.monotonic() + 30)
    (cluster.state_dir / "prometheus.yml").write_text(prometheus.config(targets))
    listen = f"{address}:{free_port()}"
    cluster.supervisor.launch("prometheus", prometheus.command(binary, cluster.state_dir, listen))
    cluster.prometheus_url = f"http://{listen}"
    cluster.save()
    url = f"{cluster.prometheus_url}/-/ready"
    cluster.supervisor.wait("prometheus", functools.partial(http_ok, url), time.monotonic() + 60)


def drain_real_nodes(cluster: NodeHost, plans: list[realnodes.NodePlan]) -> None:
    """Deletes the pods bound to real nodes and waits for the kubelets to tear them down."""
    api = admin_client(cluster.server, cluster.state_dir / "pki")
    if api is not None and "kube-apiserver" in cluster.running():
        for plan in plans:
            reply = api.get(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{plan.name}")
            for pod in (reply.body or {}).get("items", []) if reply.status == 200 else []:
                meta = pod["metadata"]
                api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    {"gracePeriodSeconds": 0},
                )
    kubelets = [f"kubelet-{p.name}" for p in plans]

    def torn_down() -> bool:
        if not any(n in cluster.running() for n in kubelets):
            return True  # no kubelet left to tear anything down
        return not any(
            realnodes.running_tasks(p.containerd_socket)
            for p in plans
            if p.containerd_socket.exists()
        )

    poll(torn_down, 45.0, interval=0.5)


def _containerd_up(socket: Path) -> bool:
    return realnodes.ctr(socket, "version", timeout=5).returncode == 0
