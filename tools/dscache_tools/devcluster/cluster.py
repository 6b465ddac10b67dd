"""Starts, finds and stops a dev Kubernetes control plane on loopback.

This module is the lifecycle; the pieces it puts together live beside it:
kubectl, helm and the environment (:mod:`.access`), the processes
(:mod:`.supervisor`), the components' command lines and
readiness (:mod:`.controlplane`), certificates and kubeconfigs (:mod:`.pki`,
:mod:`.kubeconfig`), fake nodes (:mod:`.nodes`), and real nodes with
Prometheus (:mod:`.nodeagents`, :mod:`.realnodes`, :mod:`.host`).

Contract:
    * ``DevCluster.start(state_dir, ...)`` runs etcd, kube-apiserver,
      kube-controller-manager, kube-scheduler and KWOK as local processes
      bound to 127.0.0.1 on free ports, creates the fake nodes, and returns
      only when the cluster is ready: the API server answers ``/readyz``,
      every node is Ready without a not-ready taint, the controller manager
      and scheduler report healthy, and the ``default`` ServiceAccount exists
      in namespace ``default`` (pods cannot be created before it does).
    * ``state_dir`` holds everything of one cluster: ``state.json`` (ports,
      pids, paths), ``pki/``, ``etcd/`` data, ``logs/<component>.log`` and
      the admin ``kubeconfig``. Only one cluster runs per state dir.
    * On a failed start every process is stopped, the logs are kept, and
      :class:`ClusterError` names them with the tail of the relevant one.
    * ``stop()`` stops the processes in stages (KWOK, scheduler and
      controller manager; then the API server; then etcd) with SIGTERM and
      SIGKILL after a grace period, and removes the state dir (with
      ``keep_logs``: all but ``logs/`` and ``state.json``). It only signals
      pids whose executable is the recorded binary, so a recycled pid is
      never killed. ``start`` never wipes a non-empty directory without a
      ``state.json`` and never overwrites a kubeconfig it did not write.
    * With ``tie_to_parent`` (the pytest fixture) no process outlives the
      process that started it, even if that process is killed. Without it
      (``dscache dev cluster up``) the processes run in their own session and
      outlive the command.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dscache_tools.devcluster import (
    build,
    controlplane,
    host,
    kubeconfig,
    nodeagents,
    nodes,
    realnodes,
)
from dscache_tools.devcluster.access import ClusterAccess, ToolError
from dscache_tools.devcluster.api import ApiClient
from dscache_tools.devcluster.nodeagents import ImageLoader
from dscache_tools.devcluster.procs import atomic_write
from dscache_tools.devcluster.supervisor import ClusterError, ProcessRecord, Supervisor
from dscache_tools.devcluster.versions import PINNED, cache_root
from dscache_tools.net import free_port

if TYPE_CHECKING:
    from dscache_tools.devcluster.pki import Pki

logger = logging.getLogger(__name__)

__all__ = [
    "ClusterError",
    "DevCluster",
    "ImageLoader",
    "ProcessRecord",
    "ToolError",
    "refuse_if_running",
]

STATE_FILE = "state.json"
DEFAULT_NODES = 3
#: Stop stages: clients of the API server, the API server, etcd.
_STOP_STAGES = (
    frozenset({"kwok", "kube-scheduler", "kube-controller-manager", "prometheus", "podsd"}),
    frozenset({"kube-apiserver"}),
    frozenset({"etcd"}),
)


@dataclass(eq=False, kw_only=True)
class DevCluster(ClusterAccess):
    """A running dev cluster, started here or found through its state dir.

    Attributes:
        state_dir: The cluster's state directory.
        kubeconfig: Admin kubeconfig (the ``--kubeconfig`` path when given).
        server: API server URL, ``https://<address>:<port>``: loopback, or node
            0's bridge address when there are real nodes (pods reach it there).
        binaries: The binaries it runs; ``tool_dirs`` hold kubectl and helm.
        node_count: Number of fake (KWOK) nodes.
        processes: Every process started, in order.
        real_nodes: Names of the real nodes (kubelet + containerd), if any.
        prometheus_url: The Prometheus beside the cluster (pods reach it), if any.
        tie_to_parent: Processes started from now on die with this process.
    """

    state_dir: Path
    server: str
    node_count: int
    processes: list[ProcessRecord]
    real_nodes: tuple[str, ...] = ()
    tie_to_parent: bool = False
    supervisor: Supervisor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(
            self.state_dir, self.processes, on_change=self.save, tie_to_parent=self.tie_to_parent
        )

    def running(self) -> list[str]:
        """Names of the components whose process is still alive."""
        return self.supervisor.running()

    @property
    def log_dir(self) -> Path:
        """Where each component's log is."""
        return self.supervisor.log_dir

    # --------------------------------------------------------------- lifecycle

    @classmethod
    def load(cls, state_dir: Path) -> DevCluster | None:
        """The cluster recorded in ``state_dir``, or ``None`` when there is none."""
        try:
            state = json.loads((state_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        known = set(build.Binaries.__dataclass_fields__)
        paths = {k: Path(v) for k, v in state["binaries"].items() if k in known}
        # A state file of an older dscache lacks the node agents: never needed to stop it.
        defaults = vars(build.locate(PINNED))
        return cls(
            state_dir=state_dir,
            kubeconfig=Path(state["kubeconfig"]),
            server=state["server"],
            binaries=build.Binaries(**{**defaults, **paths}),
            node_count=int(state["nodes"]),
            processes=[ProcessRecord(**p) for p in state["processes"]],
            real_nodes=tuple(state.get("real_nodes", ())),
            prometheus_url=state.get("prometheus_url"),
        )

    @classmethod
    def start(
        cls,
        state_dir: Path,
        *,
        node_count: int = DEFAULT_NODES,
        real_nodes: int = 0,
        load_images: ImageLoader | None = None,
        prometheus_binary: str | None = None,
        kubeconfig: Path | None = None,
        binaries: build.Binaries | None = None,
        tie_to_parent: bool = False,
        timeout: float = 60.0,
    ) -> DevCluster:
        """Starts a cluster and waits until it is ready.

        Args:
            state_dir: Directory for this cluster's state; must not hold a
                running cluster. A stale one (no process alive) is replaced.
            node_count: Number of fake (KWOK) nodes (see :mod:`.nodes`).
            real_nodes: Number of real nodes (see :mod:`.realnodes`); needs
                root and the packages in :data:`.realnodes.PACKAGES`.
            load_images: Imports the images pods run into a node's containerd
                (called with its socket before the kubelet starts); must
                provide :data:`.realnodes.PAUSE_IMAGE`.
            prometheus_binary: With real nodes, also run this Prometheus beside
                the cluster, scraping the dscache pods (:mod:`.prometheus`);
                its URL is ``prometheus_url``.
            kubeconfig: Also write the admin kubeconfig here (default: only
                ``<state_dir>/kubeconfig``).
            binaries: Binaries to run; default: the pinned versions, which
                must already be built (see :func:`build.ensure_built`).
            tie_to_parent: Kill the processes when this process dies.
            timeout: Seconds to wait for readiness (image imports not counted).

        Raises:
            ClusterError: A cluster already runs there, a binary is missing, the
                host cannot run real nodes (the message names the missing
                piece), or the cluster did not become ready (logs are kept).
        """
        # cryptography is needed to start a cluster, not to build or find one.
        try:
            from dscache_tools.devcluster import pki
        except ModuleNotFoundError as exc:
            raise ClusterError(
                f"starting a dev cluster needs the 'dev' extra: pip install 'dscache[dev]' ({exc})"
            ) from exc

        shapes = nodes.node_shapes(node_count)
        user_kubeconfig = _claim_state_dir(state_dir, kubeconfig)
        bins = binaries or build.locate(PINNED)
        missing = bins.missing(with_node_agents=real_nodes > 0)
        if missing:
            raise ClusterError(
                "dev cluster binaries are missing (run `dscache dev cluster build`): "
                + ", ".join(str(p) for p in missing)
            )
        plans = realnodes.plan(real_nodes, state_dir, cache_root())
        if plans:
            if load_images is None:
                raise ClusterError("real nodes need images: pass load_images")
            try:
                host.preflight(realnodes.REQUIRED)
            except host.HostError as exc:
                raise ClusterError(str(exc)) from exc
        started = time.monotonic()
        (state_dir / "logs").mkdir(parents=True)
        cluster = cls(
            state_dir=state_dir,
            kubeconfig=user_kubeconfig or state_dir / "kubeconfig",
            server="",
            binaries=bins,
            node_count=node_count,
            processes=[],
            real_nodes=tuple(p.name for p in plans),
            tie_to_parent=tie_to_parent,
        )
        try:
            record = nodeagents.prepare_host(state_dir, plans)
            # With real nodes the API server serves on node 0's bridge, which pods reach.
            address = plans[0].ip if plans else "127.0.0.1"
            material = pki.generate(
                state_dir / "pki",
                service_ip=controlplane.SERVICE_IP,
                extra_ips=(address,) if plans else (),
            )
            ports = {name: free_port() for name in controlplane.PORTS}
            cluster.server = f"https://{address}:{ports['apiserver']}"
            client = cluster._boot_control_plane(
                material, ports, address, bool(plans), started + timeout
            )
            if plans and prometheus_binary:
                nodeagents.start_prometheus(cluster, prometheus_binary, address)
            for shape in shapes:
                manifest = nodes.node_manifest(shape, simulated_taint=bool(plans))
                reply = client.post("/api/v1/nodes", manifest)
                if reply.status not in (201, 409):
                    raise ClusterError(
                        f"creating node {shape.name}: HTTP {reply.status} {reply.body}"
                    )
            if plans and record is not None and load_images is not None:
                started += nodeagents.start_real_nodes(
                    cluster, plans, record=record, material=material, load_images=load_images
                )
            want = node_count + len(plans)
            controlplane.wait_ready(cluster.supervisor, client, ports, want, started + timeout)
        except BaseException:
            cluster.stop(keep_logs=True)
            raise
        logger.info(
            "dev cluster ready in %.1f s: %s, %d simulated + %d real nodes, kubeconfig %s",
            time.monotonic() - started,
            cluster.server,
            node_count,
            len(plans),
            cluster.kubeconfig,
        )
        return cluster

    def _boot_control_plane(
        self,
        material: Pki,
        ports: Mapping[str, int],
        address: str,
        real_nodes: bool,
        deadline: float,
    ) -> ApiClient:
        """Writes the kubeconfigs and KWOK's config, starts the components; returns an admin client.

        Returns once the API server is ready; the other components are started, not yet ready.
        """
        admin_kubeconfig = kubeconfig.write(self.state_dir / "kubeconfig", self.server, material)
        if self.kubeconfig != admin_kubeconfig:
            kubeconfig.write(self.kubeconfig, self.server, material)
        (self.state_dir / "kwok.yaml").write_text(nodes.kwok_config(self.binaries.kwok_stages))
        self.save()
        commands = controlplane.commands(
            self.binaries,
            self.state_dir,
            material,
            ports=ports,
            kubeconfig=admin_kubeconfig,
            address=address,
            real_nodes=real_nodes,
        )
        client = controlplane.admin_client(self.server, self.state_dir / "pki")
        if client is None:  # the PKI was just written
            raise ClusterError(f"no admin certificate in {self.state_dir / 'pki'}")
        self.supervisor.launch("etcd", commands["etcd"])
        self.supervisor.launch("kube-apiserver", commands["kube-apiserver"])
        self.supervisor.wait(
            "kube-apiserver", lambda: client.get("/readyz").status == 200, deadline
        )
        for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
            self.supervisor.launch(name, commands[name])
        return client

    def stop(self, keep_logs: bool = False) -> None:
        """Stops every process, takes back the host changes and removes the state.

        With real nodes, the pods on them are deleted first (with the
        controllers stopped, nothing recreates them) and the kubelets tear
        them down, so no network namespace, mount or container outlives the
        cluster; whatever is left is killed and unmounted afterwards.

        With ``keep_logs``, ``logs/`` and ``state.json`` stay (a later ``start``
        in the same directory recognises them as stale and replaces them).

        A ``--kubeconfig`` file written by ``start`` is removed too.
        """
        clients, *servers = _STOP_STAGES
        # Clients first (so nothing recreates pods), then the real nodes' pods and
        # agents, then the API server (it deletes its lease in etcd on the way out),
        # etcd, and last the container runtimes; each stage gets the full grace period.
        self.supervisor.stop(clients)
        plans = realnodes.plan(len(self.real_nodes), self.state_dir, cache_root())
        if plans:
            nodeagents.drain_real_nodes(self, plans)
            agents = [f"{kind}-{p.name}" for p in plans for kind in ("kubelet", "netpol")]
            self.supervisor.stop({"kube-proxy", *agents})
            for plan in plans:
                if plan.containerd_socket.exists():
                    realnodes.purge_containers(plan.containerd_socket)
        for stage in servers:
            self.supervisor.stop(stage)
        self.supervisor.stop({f"containerd-{p.name}" for p in plans})
        record = host.HostRecord.load(self.state_dir / host.RECORD_FILE)
        if record is not None:
            host.undo(record, log=logger.warning)
        if self.kubeconfig != self.state_dir / "kubeconfig" and kubeconfig.is_ours(self.kubeconfig):
            self.kubeconfig.unlink()
        if not keep_logs:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            return
        for child in self.state_dir.iterdir() if self.state_dir.exists() else ():
            if child.name not in ("logs", STATE_FILE):
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)

    def load_images(self, load: ImageLoader) -> None:
        """Imports images into every real node's containerd of this running cluster
        (``load``, e.g. ``image_loader(names=[...])``): for pods of an image the
        nodes did not get at start (an image already there is skipped).

        Raises:
            ClusterError: the cluster has no real node.
        """
        if not self.real_nodes:
            raise ClusterError("a cluster without real nodes runs no image")
        for plan in realnodes.plan(len(self.real_nodes), self.state_dir, cache_root()):
            load(plan.containerd_socket)

    def save(self) -> None:
        """Writes ``state.json``: what ``load`` (and so ``down`` and ``env``) needs."""
        state: dict[str, Any] = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "nodes": self.node_count,
            "real_nodes": list(self.real_nodes),
            "prometheus_url": self.prometheus_url,
            "binaries": {k: str(v) for k, v in vars(self.binaries).items()},
            "processes": [vars(p) for p in self.processes],
        }
        atomic_write(self.state_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")


def refuse_if_running(state_dir: Path) -> DevCluster | None:
    """The stopped cluster recorded in ``state_dir``, if any.

    Cheap: callers check this before slow preparations (building images).

    Raises:
        ClusterError: A cluster runs from ``state_dir``.
    """
    existing = DevCluster.load(state_dir)
    alive = existing.running() if existing is not None else []
    if alive:
        raise ClusterError(
            f"a dev cluster already runs from {state_dir} ({', '.join(alive)}); "
            "stop it first with `dscache dev cluster down`"
        )
    return existing


def _claim_state_dir(state_dir: Path, user_kubeconfig: Path | None) -> Path | None:
    """Checks that a cluster may start in ``state_dir``; clears a stale one.

    Returns:
        The resolved ``--kubeconfig`` path, if one was given.

    Raises:
        ClusterError: A cluster runs there, the directory is someone else's,
            or the kubeconfig path holds a kubeconfig we did not write.
    """
    existing = refuse_if_running(state_dir)
    if existing is not None:
        logger.info("removing the stale state of a stopped cluster in %s", state_dir)
        existing.stop()
    elif state_dir.exists() and any(state_dir.iterdir()):
        # Never wipe a directory that is not ours (a mistyped --state-dir).
        raise ClusterError(f"{state_dir} is not empty and holds no dev cluster state")
    resolved = user_kubeconfig.expanduser().resolve() if user_kubeconfig else None
    if resolved is not None and resolved.exists() and not kubeconfig.is_ours(resolved):
        raise ClusterError(f"refusing to overwrite {resolved}: it is not a dev cluster kubeconfig")
    return resolved
