"""Starts, finds and stops a dev Kubernetes control plane on loopback.

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
    * With ``tie_to_parent`` (the pytest fixture) each process also gets
      PR_SET_PDEATHSIG (SIGKILL), so none outlives the process that started
      it even if that process is killed. Without it (``dscache dev cluster
      up``) the processes run in their own session and outlive the command.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import functools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dscache_tools.devcluster import build, host, nodes, prometheus, realnodes
from dscache_tools.devcluster.api import ApiClient
from dscache_tools.devcluster.versions import PINNED, cache_root
from dscache_tools.net import free_port

if TYPE_CHECKING:
    from dscache_tools.devcluster.pki import Pki

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"
DEFAULT_NODES = 3
#: Service range; its first address is the ``kubernetes`` Service.
SERVICE_CIDR = "10.96.0.0/16"
#: Pod IPs KWOK hands out.
POD_CIDR = "10.244.0.0/16"
#: Seconds from SIGTERM to SIGKILL.
STOP_GRACE_S = 10.0
#: Stop stages: clients of the API server, the API server, etcd.
_STOP_STAGES = (
    frozenset({"kwok", "kube-scheduler", "kube-controller-manager", "prometheus", "podsd"}),
    frozenset({"kube-apiserver"}),
    frozenset({"etcd"}),
)
_PR_SET_PDEATHSIG = 1
#: Context name of every kubeconfig written here; marks files ``stop`` may remove.
_CONTEXT = "dscache-dev"

T = TypeVar("T")
#: Imports the dev images into the containerd listening on the given socket.
ImageLoader = Callable[[Path], None]


class ClusterError(RuntimeError):
    """The cluster could not start, or a state dir holds a running cluster."""


class ToolError(subprocess.CalledProcessError):
    """kubectl or helm failed; ``str()`` includes what it printed on stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr:\n{self.stderr}\nstdout:\n{self.output}"


@dataclass(frozen=True)
class ProcessRecord:
    """One started component."""

    name: str
    pid: int
    exe: str
    log: str


def _set_pdeathsig() -> None:
    # SIGKILL, not SIGTERM: with its parent gone nobody stops the processes in
    # order, and an API server whose etcd went first retries its lease
    # clean-up instead of exiting. The state is throw-away anyway.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def process_running(pid: int, exe: str) -> bool:
    """True when ``pid`` is alive, not a zombie, and runs ``exe``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        target = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X") and target.removesuffix(" (deleted)") == exe


def _kubeconfig_text(
    server: str, material: Pki, client: tuple[Path, Path] | None = None, user: str = "admin"
) -> str:
    cert, key = client or (material.admin_cert, material.admin_key)

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "dscache-dev",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": b64(material.ca_cert),
                },
            }
        ],
        "users": [
            {
                "name": f"dscache-dev-{user}",
                "user": {
                    "client-certificate-data": b64(cert),
                    "client-key-data": b64(key),
                },
            }
        ],
        "contexts": [
            {
                "name": "dscache-dev",
                "context": {
                    "cluster": "dscache-dev",
                    "user": f"dscache-dev-{user}",
                    "namespace": "default",
                },
            }
        ],
        "current-context": _CONTEXT,
    }
    # JSON is YAML; kubectl, helm and client libraries all read it.
    return json.dumps(config, indent=2) + "\n"


def _is_our_kubeconfig(path: Path) -> bool:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("current-context") == _CONTEXT


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


class DevCluster:
    """A running dev cluster, started here or found through its state dir.

    Attributes:
        state_dir: The cluster's state directory.
        kubeconfig: Admin kubeconfig (the ``--kubeconfig`` path when given).
        server: API server URL, ``https://<address>:<port>``: loopback, or node
            0's bridge address when there are real nodes (pods reach it there).
        binaries: The binaries it runs; ``tool_dirs`` hold kubectl and helm.
        node_count: Number of fake (KWOK) nodes.
        real_nodes: Names of the real nodes (kubelet + containerd), if any.
        prometheus_url: The Prometheus beside the cluster (pods reach it), if any.
    """

    def __init__(
        self,
        *,
        state_dir: Path,
        kubeconfig: Path,
        server: str,
        binaries: build.Binaries,
        node_count: int,
        processes: list[ProcessRecord],
        popens: Mapping[str, subprocess.Popen[bytes]] | None = None,
        real_nodes: tuple[str, ...] = (),
        prometheus_url: str | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.kubeconfig = kubeconfig
        self.server = server
        self.binaries = binaries
        self.node_count = node_count
        self.real_nodes = real_nodes
        self.prometheus_url = prometheus_url
        self.processes = processes
        self._popens: dict[str, subprocess.Popen[bytes]] = dict(popens or {})

    # ----------------------------------------------------------------- queries

    @property
    def log_dir(self) -> Path:
        """Where each component's log is."""
        return self.state_dir / "logs"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with KUBECONFIG and PATH set.

        PATH starts with the directories of the matching kubectl and helm.
        """
        env = dict(os.environ if base is None else base)
        dirs = [str(d) for d in self.binaries.tool_dirs]
        env["PATH"] = os.pathsep.join([*dirs, env.get("PATH", "")]).rstrip(os.pathsep)
        env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def shell_exports(self) -> str:
        """``export`` lines for a POSIX shell (what ``dscache dev cluster env`` prints)."""
        dirs = os.pathsep.join(str(d) for d in self.binaries.tool_dirs)
        lines = (
            f"export KUBECONFIG={shlex.quote(str(self.kubeconfig))}\n"
            f'export PATH={shlex.quote(dirs)}"${{PATH:+:$PATH}}"\n'
        )
        if self.prometheus_url:
            lines += f"export DSCACHE_PROMETHEUS_URL={shlex.quote(self.prometheus_url)}\n"
        return lines

    def kubectl(
        self,
        *args: str,
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Runs the matching kubectl against this cluster.

        Args:
            *args: kubectl arguments.
            stdin: Text fed to kubectl (e.g. a manifest for ``apply -f -``).
            check: Raise :class:`ToolError` (a ``CalledProcessError``) on a non-zero exit.
            timeout: Seconds before the command is killed.
        """
        return self._tool(self.binaries.kubectl, args, stdin, check, timeout)

    def kubectl_json(self, *args: str, timeout: float = 120.0) -> Any:
        """``kubectl <args> -o json``, decoded."""
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def helm(
        self,
        *args: str,
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 300.0,
    ) -> subprocess.CompletedProcess[str]:
        """Runs the matching helm against this cluster (same arguments as :meth:`kubectl`)."""
        return self._tool(self.binaries.helm, args, stdin, check, timeout)

    def _tool(
        self,
        exe: Path,
        args: tuple[str, ...],
        stdin: str | None,
        check: bool,
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(exe), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise ToolError(done.returncode, done.args, output=done.stdout, stderr=done.stderr)
        return done

    def running(self) -> list[str]:
        """Names of the components whose process is still alive."""
        return [p.name for p in self.processes if process_running(p.pid, p.exe)]

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
        binaries = build.Binaries(**{**defaults, **paths})
        return cls(
            state_dir=state_dir,
            kubeconfig=Path(state["kubeconfig"]),
            server=state["server"],
            binaries=binaries,
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
        existing = cls.load(state_dir)
        if existing is not None:
            alive = existing.running()
            if alive:
                raise ClusterError(
                    f"a dev cluster already runs from {state_dir} ({', '.join(alive)}); "
                    "stop it first with `dscache dev cluster down`"
                )
            logger.info("removing the stale state of a stopped cluster in %s", state_dir)
            existing.stop()
        elif state_dir.exists() and any(state_dir.iterdir()):
            # Never wipe a directory that is not ours (a mistyped --state-dir).
            raise ClusterError(f"{state_dir} is not empty and holds no dev cluster state")
        user_kubeconfig = kubeconfig.expanduser().resolve() if kubeconfig else None
        if (
            user_kubeconfig is not None
            and user_kubeconfig.exists()
            and not _is_our_kubeconfig(user_kubeconfig)
        ):
            raise ClusterError(
                f"refusing to overwrite {user_kubeconfig}: it is not a dev cluster kubeconfig"
            )

        bins = binaries or build.locate(PINNED)
        needed = [
            p
            for p in bins.all_executables()
            if real_nodes or p not in (bins.kubelet, bins.kube_proxy)
        ]
        missing = [str(p) for p in needed if not os.access(p, os.X_OK)]
        if missing:
            raise ClusterError(
                "dev cluster binaries are missing (run `dscache dev cluster build`): "
                + ", ".join(missing)
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
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / "logs").mkdir()
        cluster = cls(
            state_dir=state_dir,
            kubeconfig=user_kubeconfig or state_dir / "kubeconfig",
            server="",
            binaries=bins,
            node_count=node_count,
            processes=[],
            real_nodes=tuple(p.name for p in plans),
        )
        try:
            record = cluster._prepare_host(plans)
            # With real nodes the API server serves on node 0's bridge, which pods reach.
            address = plans[0].ip if plans else "127.0.0.1"
            material = pki.generate(
                state_dir / "pki", service_ip="10.96.0.1", extra_ips=(address,) if plans else ()
            )
            ports = {
                name: free_port()
                for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")
            }
            cluster.server = f"https://{address}:{ports['apiserver']}"
            admin_kubeconfig = state_dir / "kubeconfig"
            text = _kubeconfig_text(cluster.server, material)
            _write_private(admin_kubeconfig, text)
            if user_kubeconfig is not None:
                _write_private(user_kubeconfig, text)
            (state_dir / "kwok.yaml").write_text(nodes.kwok_config(bins.kwok_stages))
            cluster._save()
            commands = cluster._commands(material, ports, admin_kubeconfig, address, bool(plans))
            client = ApiClient(
                ports["apiserver"],
                material.ca_cert,
                (material.admin_cert, material.admin_key),
                host=address,
            )
            cluster._launch("etcd", commands["etcd"], tie_to_parent)
            cluster._launch("kube-apiserver", commands["kube-apiserver"], tie_to_parent)
            cluster._wait(
                "kube-apiserver",
                lambda: client.get("/readyz").status == 200,
                started + timeout,
            )
            for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
                cluster._launch(name, commands[name], tie_to_parent)
            if plans and prometheus_binary:
                cluster._start_prometheus(prometheus_binary, address, tie_to_parent)
            for shape in shapes:
                reply = client.post(
                    "/api/v1/nodes", nodes.node_manifest(shape, simulated_taint=bool(plans))
                )
                if reply.status not in (201, 409):
                    raise ClusterError(
                        f"creating node {shape.name}: HTTP {reply.status} {reply.body}"
                    )
            if plans and record is not None and load_images is not None:
                ready_by = cluster._start_real_nodes(
                    plans,
                    record=record,
                    material=material,
                    load_images=load_images,
                    tie_to_parent=tie_to_parent,
                )
                started += ready_by
            cluster._wait_ready(client, ports, started + timeout)
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
        stages = list(_STOP_STAGES)
        # Clients first (so nothing recreates pods), then the real nodes' pods and
        # agents, then the API server (it deletes its lease in etcd on the way out),
        # etcd, and last the container runtimes; each stage gets the full grace period.
        self._stop_stage(stages[0])
        plans = realnodes.plan(len(self.real_nodes), self.state_dir, cache_root())
        if plans:
            self._drain_real_nodes(plans)
            self._stop_stage(frozenset({"kube-proxy", *(f"kubelet-{p.name}" for p in plans)}))
            for plan in plans:
                if plan.containerd_socket.exists():
                    realnodes.purge_containers(plan.containerd_socket)
        for stage in stages[1:]:
            self._stop_stage(stage)
        self._stop_stage(frozenset(f"containerd-{p.name}" for p in plans))
        record = host.HostRecord.load(self.state_dir / host.RECORD_FILE)
        if record is not None:
            host.undo(record, log=logger.warning)
        if self.kubeconfig != self.state_dir / "kubeconfig" and _is_our_kubeconfig(self.kubeconfig):
            self.kubeconfig.unlink()
        if keep_logs:
            for child in self.state_dir.iterdir() if self.state_dir.exists() else ():
                if child.name not in ("logs", STATE_FILE):
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
        else:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _stop_stage(self, stage: frozenset[str]) -> None:
        records = [p for p in self.processes if p.name in stage]
        for record in records:
            if process_running(record.pid, record.exe):
                logger.debug("SIGTERM %s (pid %d)", record.name, record.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for record in records:
            self._wait_exit(record, deadline)

    # ------------------------------------------------------------- real nodes

    def _prepare_host(self, plans: list[realnodes.NodePlan]) -> host.HostRecord | None:
        """Claims the host and makes the network changes real nodes need (recorded)."""
        if not plans:
            return None
        try:
            record = host.claim(self.state_dir)
            host.remember_sysctls(record, host.KUBELET_SYSCTLS)
            host.remember_kube_chains(record)
            host.set_sysctls(record, host.NETWORK_SYSCTLS)
            for plan in plans:
                host.add_bridge(record, plan.bridge, f"{plan.ip}/24")
                host.add_mount_root(record, plan.directory)
            host.keep_pods_local(record, realnodes.POD_CIDR)
        except host.HostError as exc:
            raise ClusterError(str(exc)) from exc
        return record

    def _start_real_nodes(
        self,
        plans: list[realnodes.NodePlan],
        *,
        record: host.HostRecord,
        material: Pki,
        load_images: ImageLoader,
        tie_to_parent: bool,
    ) -> float:
        """Starts containerd, imports images, starts the kubelets and kube-proxy.

        Returns:
            Seconds spent importing images (not counted against the timeout).
        """
        from dscache_tools.devcluster import pki

        import_s = 0.0
        for plan in plans:
            for sub in ("containerd", "cni/net.d", "kubelet", "pod-logs", "volume-plugins"):
                (plan.directory / sub).mkdir(parents=True, exist_ok=True)
            plan.image_store.mkdir(parents=True, exist_ok=True)
            config = plan.directory / "containerd" / "config.toml"
            config.write_text(realnodes.containerd_config(plan))
            (plan.directory / "cni" / "net.d" / "10-dscache.conflist").write_text(
                realnodes.cni_config(plan)
            )
            self._launch(
                f"containerd-{plan.name}",
                [host.which("containerd"), "--config", str(config)],
                tie_to_parent,
            )
            socket = plan.containerd_socket
            self._wait(
                f"containerd-{plan.name}",
                functools.partial(_containerd_up, socket),
                time.monotonic() + 60,
            )
            purged = realnodes.purge_containers(plan.containerd_socket)
            if purged:
                logger.info("removed %d stale containers from %s", purged, plan.image_store)
            began = time.monotonic()
            load_images(plan.containerd_socket)
            import_s += time.monotonic() - began

        record.kube_proxy = str(self.binaries.kube_proxy)
        record.owners = [(p.pid, p.exe) for p in self.processes]
        record.save()
        for plan in plans:
            creds = pki.node_credentials(material, plan.directory / "pki", plan.name, plan.ip)
            kubeconfig = plan.directory / "kubelet.kubeconfig"
            _write_private(
                kubeconfig,
                _kubeconfig_text(
                    self.server, material, (creds.client_cert, creds.client_key), plan.name
                ),
            )
            host.add_cgroup(record, plan.cgroup_name)
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
            self._launch(
                f"kubelet-{plan.name}",
                [
                    str(self.binaries.kubelet),
                    f"--config={kubelet_conf}",
                    f"--kubeconfig={kubeconfig}",
                    f"--root-dir={plan.directory / 'kubelet'}",
                    f"--cert-dir={plan.directory / 'pki'}",
                    f"--hostname-override={plan.name}",
                    f"--node-ip={plan.ip}",
                    f"--node-labels={labels}",
                    "--v=1",
                ],
                tie_to_parent,
            )
        proxy_cert = pki.client_credentials(
            material, self.state_dir / "pki", "kube-proxy", "system:kube-proxy"
        )
        proxy_kubeconfig = self.state_dir / "kube-proxy.kubeconfig"
        _write_private(
            proxy_kubeconfig, _kubeconfig_text(self.server, material, proxy_cert, "kube-proxy")
        )
        proxy_conf = self.state_dir / "kube-proxy.yaml"
        proxy_conf.write_text(
            realnodes.kube_proxy_config(
                plans[0],
                kubeconfig=proxy_kubeconfig,
                healthz_port=free_port(),
                metrics_port=free_port(),
            )
        )
        self._launch(
            "kube-proxy", [str(self.binaries.kube_proxy), f"--config={proxy_conf}"], tie_to_parent
        )
        record.owners = [(p.pid, p.exe) for p in self.processes]
        record.save()
        return import_s

    def _start_prometheus(self, binary: str, address: str, tie_to_parent: bool) -> None:
        targets = self.state_dir / "prometheus-targets.json"
        self._launch(
            "podsd",
            [
                sys.executable,
                "-m",
                "dscache_tools.devcluster.podsd",
                f"--server={self.server}",
                f"--pki={self.state_dir / 'pki'}",
                f"--out={targets}",
            ],
            tie_to_parent,
        )
        self._wait("podsd", targets.exists, time.monotonic() + 30)
        (self.state_dir / "prometheus.yml").write_text(prometheus.config(targets))
        listen = f"{address}:{free_port()}"
        self._launch(
            "prometheus", prometheus.command(binary, self.state_dir, listen), tie_to_parent
        )
        self.prometheus_url = f"http://{listen}"
        self._save()
        url = f"{self.prometheus_url}/-/ready"
        self._wait("prometheus", functools.partial(_http_ok, url), time.monotonic() + 60)

    def _drain_real_nodes(self, plans: list[realnodes.NodePlan]) -> None:
        """Deletes the pods bound to real nodes and waits for the kubelets to tear them down."""
        material = self.state_dir / "pki"
        api = self._api_client(material)
        if api is not None and "kube-apiserver" in self.running():
            for plan in plans:
                reply = api.get(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{plan.name}")
                for pod in (reply.body or {}).get("items", []) if reply.status == 200 else []:
                    meta = pod["metadata"]
                    api.request(
                        "DELETE",
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0},
                    )
        deadline = time.monotonic() + 45
        alive = [f"kubelet-{p.name}" for p in plans]
        while time.monotonic() < deadline and any(n in self.running() for n in alive):
            if not any(
                realnodes.running_tasks(p.containerd_socket)
                for p in plans
                if p.containerd_socket.exists()
            ):
                return
            time.sleep(0.5)

    def _api_client(self, material: Path) -> ApiClient | None:
        address, _, port = self.server.removeprefix("https://").rpartition(":")
        if not port.isdigit() or not (material / "admin.crt").exists():
            return None
        return ApiClient(
            int(port),
            material / "ca.crt",
            (material / "admin.crt", material / "admin.key"),
            host=address,
        )

    # --------------------------------------------------------------- internals

    def _wait_exit(self, record: ProcessRecord, deadline: float) -> None:
        popen = self._popens.get(record.name)
        while process_running(record.pid, record.exe):
            if popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            else:
                time.sleep(0.1)
            if time.monotonic() >= deadline and process_running(record.pid, record.exe):
                logger.warning("%s (pid %d) ignored SIGTERM; killing it", record.name, record.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record.pid, signal.SIGKILL)
                if popen is not None:
                    popen.wait()
                break
        if popen is not None and popen.poll() is None:
            popen.wait()

    def _commands(
        self,
        material: Pki,
        ports: Mapping[str, int],
        kubeconfig: Path,
        address: str = "127.0.0.1",
        real_nodes: bool = False,
    ) -> dict[str, list[str]]:
        b = self.binaries
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        kc = str(kubeconfig)
        return {
            "etcd": [
                str(b.etcd),
                "--name=dev",
                f"--data-dir={self.state_dir / 'etcd'}",
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
            "kube-apiserver": [
                str(b.kube_apiserver),
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
                *(
                    [
                        # Logs, exec and port-forward reach the kubelets at their node IPs.
                        f"--kubelet-client-certificate={material.admin_cert}",
                        f"--kubelet-client-key={material.admin_key}",
                        f"--kubelet-certificate-authority={material.ca_cert}",
                        "--kubelet-preferred-address-types=InternalIP",
                    ]
                    if real_nodes
                    # The kubernetes Service cannot point at a loopback address.
                    else ["--endpoint-reconciler-type=none"]
                ),
                "--profiling=false",
            ],
            "kube-controller-manager": [
                str(b.kube_controller_manager),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['controller-manager']}",
                "--leader-elect=false",
                f"--root-ca-file={material.ca_cert}",
                f"--service-account-private-key-file={material.service_account_key}",
                f"--cluster-signing-cert-file={material.ca_cert}",
                f"--cluster-signing-key-file={material.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--profiling=false",
            ],
            "kube-scheduler": [
                str(b.kube_scheduler),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['scheduler']}",
                "--leader-elect=false",
                "--profiling=false",
            ],
            "kwok": [
                str(b.kwok),
                f"--kubeconfig={kc}",
                f"--config={self.state_dir / 'kwok.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={nodes.KWOK_SELECTOR}",
                "--node-lease-duration-seconds=40",
                f"--cidr={POD_CIDR}",
                "--node-ip=10.0.0.1",
            ],
        }

    def _launch(self, name: str, command: list[str], tie_to_parent: bool) -> None:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            log.write(("# " + shlex.join(command) + "\n").encode())
            log.flush()
            popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if tie_to_parent else None,  # noqa: PLW1509
            )
        self._popens[name] = popen
        self.processes.append(
            # /proc/<pid>/exe is the resolved path; compare like with like.
            ProcessRecord(
                name=name, pid=popen.pid, exe=os.path.realpath(command[0]), log=str(log_path)
            )
        )
        self._save()
        logger.debug("started %s (pid %d)", name, popen.pid)

    def _save(self) -> None:
        state: dict[str, Any] = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "nodes": self.node_count,
            "real_nodes": list(self.real_nodes),
            "prometheus_url": self.prometheus_url,
            "binaries": {k: str(v) for k, v in vars(self.binaries).items()},
            "processes": [vars(p) for p in self.processes],
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.state_dir / STATE_FILE)

    def _check_alive(self) -> None:
        for record in self.processes:
            popen = self._popens.get(record.name)
            code = popen.poll() if popen is not None else None
            if code is not None:
                raise ClusterError(
                    f"{record.name} exited with code {code} during start-up; "
                    f"logs in {self.log_dir}. {record.log}:\n{_tail(Path(record.log))}"
                )

    def _wait(self, what: str, ready: Callable[[], bool], deadline: float) -> None:
        began = time.monotonic()
        while True:
            self._check_alive()
            if ready():
                logger.debug("%s ready after %.1f s", what, time.monotonic() - began)
                return
            if time.monotonic() >= deadline:
                log = self.log_dir / f"{what}.log"
                raise ClusterError(
                    f"timed out waiting for {what}; logs in {self.log_dir}. {log}:\n{_tail(log)}"
                )
            time.sleep(0.1)

    def _wait_ready(self, client: ApiClient, ports: Mapping[str, int], deadline: float) -> None:
        for name, port_key in (
            ("kube-controller-manager", "controller-manager"),
            ("kube-scheduler", "scheduler"),
        ):
            self._wait(name, _healthz(ApiClient(ports[port_key], None, timeout=2.0)), deadline)

        def nodes_ready() -> bool:
            reply = client.get(f"/api/v1/nodes?labelSelector={nodes.DEV_NODE_LABEL}%3Dtrue")
            if reply.status != 200:
                return False
            items = reply.body.get("items", [])
            want = self.node_count + len(self.real_nodes)
            return len(items) == want and all(_node_ready(n) for n in items)

        self._wait("kwok", nodes_ready, deadline)
        self._wait(
            "kube-controller-manager",
            lambda: client.get("/api/v1/namespaces/default/serviceaccounts/default").status == 200,
            deadline,
        )


def wait_until(
    what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25
) -> T:
    """Polls ``probe`` until it returns something truthy, and returns that.

    Raises:
        TimeoutError: ``timeout`` seconds passed; the message names ``what``
            and the last value seen.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - a local URL
            return int(reply.status) == 200
    except OSError:
        return False


def _containerd_up(socket: Path) -> bool:
    return realnodes.ctr(socket, "version", timeout=5).returncode == 0


def _healthz(api: ApiClient) -> Callable[[], bool]:
    return lambda: api.get("/healthz").status == 200


def _node_ready(node: Mapping[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints", [])
    blocked = any(
        t.get("key") in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
        for t in taints
    )
    return ready and not blocked
