"""Real nodes for the dev cluster: containerd + CNI + kubelet per node, one kube-proxy.

Pods bound to a real node run for real: containerd (Debian's 1.6, its own
root, state and socket per node) runs them with runc, the CNI ``bridge`` plugin
puts them on a bridge per node, and kube-proxy programs ClusterIP Services
with iptables. Everything a node writes lives under
``<state_dir>/nodes/<node>/``, except containerd's image store, which is
cached per node under ``<cache>/containerd/<node>/`` so the images imported
once survive ``down`` and ``up``.

Contract:
    * :func:`plan` is pure: node names ``dev-real-<i>``, bridge ``dscache<i>``
      with address ``10.246.<i>.1/24`` (the node's InternalIP), pod subnet
      ``10.246.<i>.0/24``, and every file's path and text
      (:func:`containerd_config`, :func:`cni_config`, :func:`kubelet_config`,
      :func:`kube_proxy_config`).
    * The API server serves on node 0's bridge address when real nodes exist,
      so pods reach it through the ``kubernetes`` Service (10.96.0.1:443).
    * Real nodes carry the label ``dscache.io/node-kind=real``; simulated
      (KWOK) nodes get ``dscache.io/node-kind=simulated`` and, when real nodes
      exist, the taint ``dscache.io/simulated=true:NoSchedule``, so ordinary
      workloads run on real nodes and only pods that ask for simulated nodes
      (a toleration) land on KWOK's.
    * The kubelet's image garbage collection is off (the dev images are
      imported, not pullable) and disk-pressure eviction thresholds are low, so
      a busy developer disk does not evict the cluster's pods.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.devcluster import nodes

#: Pod network of real nodes (KWOK's fake pod IPs use 10.244.0.0/16).
POD_CIDR = "10.246.0.0/16"
NODE_PREFIX = "dev-real"
NODE_KIND_LABEL = nodes.NODE_KIND_LABEL
PAUSE_IMAGE = "dscache.local/pause:1.0"
CNI_BIN_DIR = "/usr/lib/cni"
#: Debian packages a real node needs (executable, package).
REQUIRED = (
    ("containerd", "containerd"),
    ("ctr", "containerd"),
    ("runc", "runc"),
    ("bridge", "containernetworking-plugins"),
    ("host-local", "containernetworking-plugins"),
    ("loopback", "containernetworking-plugins"),
    ("iptables", "iptables"),
    ("ip", "iproute2"),
    ("conntrack", "conntrack"),
)
#: Debian package names of :data:`REQUIRED`, for installers.
PACKAGES = tuple(sorted({pkg for _exe, pkg in REQUIRED}))


@dataclass(frozen=True)
class NodePlan:
    """Everything about one real node that does not depend on a running process."""

    index: int
    name: str
    bridge: str
    ip: str
    subnet: str
    directory: Path
    image_store: Path

    @property
    def containerd_socket(self) -> Path:
        """containerd's gRPC socket (the kubelet's CRI endpoint)."""
        return self.directory / "containerd" / "containerd.sock"

    @property
    def cgroup_name(self) -> str:
        """The cgroup (in every hierarchy) this node's pods live under."""
        return f"dscache-{self.name}"


def plan(count: int, state_dir: Path, cache_root: Path) -> list[NodePlan]:
    """The ``count`` real nodes of a cluster in ``state_dir``.

    Raises:
        ValueError: ``count`` is negative or above 16.
    """
    if not 0 <= count <= 16:
        raise ValueError(f"--real-nodes must be between 0 and 16, got {count}")
    nodes = []
    for i in range(count):
        name = f"{NODE_PREFIX}-{i}"
        nodes.append(
            NodePlan(
                index=i,
                name=name,
                bridge=f"dscache{i}",
                ip=f"10.246.{i}.1",
                subnet=f"10.246.{i}.0/24",
                directory=state_dir / "nodes" / name,
                image_store=cache_root / "containerd" / name,
            )
        )
    return nodes


def containerd_config(node: NodePlan, sandbox_image: str = PAUSE_IMAGE) -> str:
    """containerd's config.toml (version 2) for ``node``."""
    d = node.directory / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join(
        [
            "version = 2",
            f'root = "{node.image_store}"',
            f'state = "{d / "state"}"',
            "oom_score = 0",
            "[grpc]",
            f'  address = "{node.containerd_socket}"',
            "[ttrpc]",
            '  address = ""',
            "[debug]",
            '  address = ""',
            "[metrics]",
            '  address = ""',
            '[plugins."io.containerd.internal.v1.opt"]',
            f'  path = "{d / "opt"}"',
            f"[{cri}]",
            f'  sandbox_image = "{sandbox_image}"',
            # This VM denies negative oom_score_adj even to root; without this every
            # sandbox fails with "can't get final child's PID from pipe: EOF".
            "  restrict_oom_score_adj = true",
            "  enable_selinux = false",
            "  disable_apparmor = true",
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]",
            "  SystemdCgroup = false",
            f"[{cri}.cni]",
            f'  bin_dir = "{CNI_BIN_DIR}"',
            f'  conf_dir = "{node.directory / "cni" / "net.d"}"',
            "  max_conf_num = 1",
            "",
        ]
    )


def cni_config(node: NodePlan) -> str:
    """The node's CNI network: a bridge, host-local IPAM in the node's subnet, no NAT."""
    conf = {
        "cniVersion": "1.0.0",
        "name": "dscache-dev",
        "plugins": [
            {
                "type": "bridge",
                "bridge": node.bridge,
                "isGateway": True,
                # No masquerade: pod traffic never leaves the machine (host.keep_pods_local).
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.subnet, "gateway": node.ip}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.directory / "cni" / "ipam"),
                },
            }
        ],
    }
    return json.dumps(conf, indent=2) + "\n"


def kubelet_config(
    node: NodePlan, *, ca_cert: Path, serving: tuple[Path, Path], port: int, healthz_port: int
) -> str:
    """The kubelet's KubeletConfiguration (JSON, which the kubelet reads as YAML)."""
    conf = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(serving[0]),
        "tlsPrivateKeyFile": str(serving[1]),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{node.cgroup_name}",
        "failSwapOn": False,
        "failCgroupV1": False,
        "enforceNodeAllocatable": [],
        "podCIDR": node.subnet,
        "maxPods": 110,
        "serializeImagePulls": False,
        # Images are imported, not pulled: never collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "podLogsDir": str(node.directory / "pod-logs"),
        "volumePluginDir": str(node.directory / "volume-plugins"),
        "resolvConf": "",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "registerNode": True,
        "localStorageCapacityIsolation": True,
        "containerLogMaxSize": "10Mi",
        "containerLogMaxFiles": 2,
    }
    return json.dumps(conf, indent=2) + "\n"


def kube_proxy_config(
    node: NodePlan, *, kubeconfig: Path, healthz_port: int, metrics_port: int
) -> str:
    """kube-proxy's configuration: iptables mode, host sysctls left as they are."""
    conf = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": node.name,
        "bindAddress": node.ip,
        "clusterCIDR": POD_CIDR,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "nodePortAddresses": [POD_CIDR],
        # 0 = leave the host's conntrack sysctls alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        # No NodePorts on 127.0.0.1 (that would set route_localnet).
        "iptables": {"localhostNodePorts": False, "masqueradeAll": False},
    }
    return json.dumps(conf, indent=2) + "\n"


# ----------------------------------------------------------------------------- containerd


def ctr(socket: Path, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """Runs ``ctr`` against the containerd at ``socket`` in the ``k8s.io`` namespace."""
    return subprocess.run(
        ["ctr", "--address", str(socket), "--namespace", "k8s.io", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def running_tasks(socket: Path) -> list[str]:
    """Ids of the tasks (running containers and sandboxes) containerd still has."""
    done = ctr(socket, "tasks", "list", "--quiet", timeout=30)
    return done.stdout.split() if done.returncode == 0 else []


def purge_containers(socket: Path) -> int:
    """Kills and removes every container (and its network namespace) in ``k8s.io``.

    The image store outlives a cluster; its containers must not, or the next
    kubelet would find sandboxes of pods that never existed in its cluster.

    Returns:
        How many containers were removed.
    """
    for task in running_tasks(socket):
        ctr(socket, "tasks", "kill", "--signal", "SIGKILL", task, timeout=30)
        ctr(socket, "tasks", "delete", "--force", task, timeout=30)
    listed = ctr(socket, "containers", "list", "--quiet", timeout=30)
    ids = listed.stdout.split() if listed.returncode == 0 else []
    for cid in ids:
        info = ctr(socket, "containers", "info", cid, timeout=30)
        for netns in _netns_paths(info.stdout):
            subprocess.run(["umount", "-l", netns], capture_output=True, check=False)
            Path(netns).unlink(missing_ok=True)
        ctr(socket, "containers", "delete", cid, timeout=60)
    return len(ids)


def _netns_paths(info_json: str) -> list[str]:
    try:
        info = json.loads(info_json)
    except ValueError:
        return []
    spaces = (((info.get("Spec") or {}).get("linux") or {}).get("namespaces")) or []
    return [
        ns["path"]
        for ns in spaces
        if ns.get("type") == "network" and str(ns.get("path", "")).startswith("/var/run/netns/")
    ]


def real_nodes_default() -> tuple[int, str | None]:
    """1 when this host can run a real node, else 0 and the reason."""
    from dscache_tools.devcluster import host

    try:
        host.preflight(REQUIRED)
    except host.HostError as exc:
        return 0, str(exc)
    return 1, None
