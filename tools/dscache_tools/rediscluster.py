"""A real Redis Cluster on loopback for tests and benches (Debian's ``redis-server``).

:class:`LocalRedisCluster` starts ``masters`` ``redis-server`` processes in
cluster mode, each on a free loopback port (and its cluster bus port, +10000),
joins them with ``redis-cli --cluster create`` and waits for ``cluster_state:ok``.
Nothing is persisted (no RDB, no AOF): the data dir holds only the nodes files.
Faults for chaos runs: :meth:`pause` (SIGSTOP: the nodes accept connections but
never answer, as an overloaded or partitioned cluster does), :meth:`resume` and
:meth:`kill`.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.net import free_port
from dscache_tools.procs import Child, start_child

__all__ = ["LocalRedisCluster", "RedisClusterStartError", "TlsFiles"]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS cluster: the nodes' certificate and key, and the CA that
    signed it (clients verify the nodes against it; clients need no certificate)."""

    cert: Path
    key: Path
    ca: Path


class RedisClusterStartError(RuntimeError):
    """The cluster did not come up; the message says why (with the servers' logs)."""


def _port_pair(host: str) -> int:
    """A free port on ``host`` whose cluster bus port (+10000) is free too."""
    for _ in range(50):
        port = free_port(host)
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, port + 10000))
        except OSError:
            continue
        return port
    raise RedisClusterStartError("no free port pair for a cluster node")


class LocalRedisCluster:
    """``masters`` Redis Cluster masters on one address (no replicas), under ``work_dir``.

    Args:
        work_dir: nodes files and logs, one folder per node.
        masters: nodes, at least 3 (Redis Cluster's minimum).
        maxmemory: per node, e.g. ``256mb``; allkeys-lru evicts past it.
        password: ``requirepass``/``masterauth`` when set.
        host: the address every node binds and is known by: loopback, or (for pods
            of the dev cluster's real node) the node bridge's address on this host.
        tls: serve TLS only (client and cluster bus ports) with these files.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        masters: int = 3,
        maxmemory: str = "256mb",
        password: str = "",
        host: str = "127.0.0.1",
        tls: TlsFiles | None = None,
    ) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RedisClusterStartError(
                    f"{tool} not found: install Debian's redis-server (scripts/setup.sh does)"
                )
        self.work_dir = work_dir
        self.masters = masters
        self.maxmemory = maxmemory
        self.password = password
        self.host = host
        self.tls = tls
        self.ports: list[int] = []
        self._procs: list[Child] = []

    @property
    def nodes(self) -> str:
        """The startup nodes, ``host:port,...`` (the sidecar's ``shared_nodes``)."""
        return ",".join(f"{self.host}:{p}" for p in self.ports)

    def _cli(self, port: int, *args: str, timeout: float = 20.0) -> str:
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        if self.tls is not None:
            auth += ["--tls", "--cacert", str(self.tls.ca)]
        out = subprocess.run(
            ["redis-cli", "-h", self.host, "-p", str(port), *auth, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return out.stdout + out.stderr

    def start(self, timeout_s: float = 60.0) -> LocalRedisCluster:
        """Starts and joins the nodes; raises :class:`RedisClusterStartError`."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        for i in range(self.masters):
            port = _port_pair(self.host)
            node_dir = self.work_dir / f"node-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            listen = ["--port", str(port)]
            if self.tls is not None:
                listen = [
                    "--port",
                    "0",
                    "--tls-port",
                    str(port),
                    "--tls-cluster",
                    "yes",
                    "--tls-cert-file",
                    str(self.tls.cert),
                    "--tls-key-file",
                    str(self.tls.key),
                    "--tls-ca-cert-file",
                    str(self.tls.ca),
                    "--tls-auth-clients",
                    "no",
                ]
            args = [
                "redis-server",
                *listen,
                "--bind", self.host,
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "5000",
                "--dir", str(node_dir),
                "--save", "",
                "--appendonly", "no",
                "--maxmemory", self.maxmemory,
                "--maxmemory-policy", "allkeys-lru",
                "--logfile", str(node_dir / "redis.log"),
            ]  # fmt: skip
            if self.password:
                args += ["--requirepass", self.password, "--masterauth", self.password]
            self._procs.append(start_child(f"redis-{port}", args, node_dir / "stdout.log"))
            self.ports.append(port)
        deadline = time.monotonic() + timeout_s
        for port in self.ports:
            while "PONG" not in self._cli(port, "ping", timeout=5):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RedisClusterStartError(f"node {port} did not answer PING")
                time.sleep(0.1)
        out = self._cli(
            self.ports[0],
            "--cluster",
            "create",
            *(f"{self.host}:{p}" for p in self.ports),
            "--cluster-replicas",
            "0",
            "--cluster-yes",
            timeout=timeout_s,
        )
        if "[OK]" not in out:
            raise RedisClusterStartError(f"redis-cli --cluster create failed:\n{out}")
        for port in self.ports:
            while "cluster_state:ok" not in self._cli(port, "cluster", "info", timeout=5):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RedisClusterStartError(f"node {port} never reported cluster_state:ok")
                time.sleep(0.2)

    def _check_alive(self) -> None:
        for port, proc in zip(self.ports, self._procs, strict=False):
            if not proc.alive():
                log_file = self.work_dir / f"node-{self.ports.index(port)}" / "redis.log"
                tail = log_file.read_text()[-2000:] if log_file.exists() else ""
                raise RedisClusterStartError(f"redis-server on {port} exited:\n{tail}")

    def _signal(self, sig: int) -> None:
        for proc in self._procs:
            if proc.alive():
                proc.signal(sig)

    def pause(self) -> None:
        """Freezes every node (SIGSTOP): connections open, no answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Thaws the nodes after :meth:`pause`."""
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """Kills every node at once (SIGKILL), as a lost cluster."""
        self._signal(signal.SIGCONT)
        for proc in self._procs:
            proc.kill()

    def stop(self) -> None:
        """Stops every node (SIGTERM, then SIGKILL); idempotent."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        for proc in self._procs:
            proc.stop(grace_s=10.0)
        self._procs.clear()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
