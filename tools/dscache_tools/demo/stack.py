"""The whole data path on one machine: sidecars, model servers, NGINX, Prometheus.

Every piece is the real program (``dscache sidecar``, ``dscache server``, Debian's
NGINX with the Lua module running the config of :mod:`dscache_router.nginx`,
optionally Debian's Prometheus), started as a child process on loopback with a
free port and its files under one work dir. The demo and the end-to-end tests
build their stacks from these calls.

Contract:
    * Nothing listens beyond 127.0.0.1; nothing is written outside the work dir.
    * ``LocalStack`` is a context manager: leaving it stops every child it started,
      on success, on error, and on Ctrl-C.
    * A child that fails to start is a ``StartError`` naming its log file.
    * A killed sidecar or server restarts with its own command line (same port,
      socket and data dir), so the router and its server find it where it was.
    * With ``StackOptions.sidecar_tmpfs`` each sidecar's data dir is a tmpfs the
      stack mounted; ``stop`` unmounts every one (lazily, so a straggler's open
      file cannot keep it).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from dscache_tools.demo.parts import (
    NGINX_PACKAGES,
    Router,
    Server,
    Sidecar,
    StackOptions,
    child_env,
    find_nginx,
    prometheus_config,
    render_router,
    worker_pids,
)
from dscache_tools.net import free_port, port_open
from dscache_tools.polling import poll
from dscache_tools.procs import Child, ProcessGroup, StartError, http_ok

__all__ = [
    "NGINX_PACKAGES",
    "LocalStack",
    "Router",
    "Server",
    "Sidecar",
    "StackOptions",
    "child_env",
    "find_nginx",
]

log = logging.getLogger(__name__)


@dataclass
class LocalStack:
    """Children of one local deployment; stop them all by leaving the context."""

    workdir: Path
    options: StackOptions = field(default_factory=StackOptions)
    procs: ProcessGroup = field(init=False)
    sidecars: list[Sidecar] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    router: Router | None = None
    replicas: list[Router] = field(default_factory=list)
    prometheus_port: int | None = None
    _seq: int = 0
    _prometheus: Child | None = None
    _mounts: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessGroup(self.workdir / "logs")
        self._env = child_env()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "dscache.cli", "--log-level", "INFO", *args]

    def _name(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}{self._seq}"

    # -- sidecars -----------------------------------------------------------------

    def start_sidecar(self, name: str | None = None) -> Sidecar:
        """Starts a sidecar on a fresh data dir and waits until it serves."""
        name = name or self._name("sidecar")
        data = self.workdir / name
        data.mkdir(parents=True, exist_ok=True)
        if self.options.sidecar_tmpfs:
            self._mount_tmpfs(data, self.options.sidecar_tmpfs)
        sock = data / "sidecar.sock"
        port = free_port()
        child = self.procs.start(
            name,
            self._python(
                "sidecar",
                "--data-dir", str(data),
                "--capacity", self.options.sidecar_capacity,
                "--segment-size", self.options.sidecar_segment_size,
                "--socket", str(sock),
                "--metrics-host", "127.0.0.1",
                "--metrics-port", str(port),
                *self.options.sidecar_args,
            ),
            env=self._env,
        )  # fmt: skip
        sidecar = Sidecar(name, data, sock, port, child)
        child.wait_ready(
            lambda: sock.exists() and http_ok(sidecar.metrics_url),
            timeout_s=120,
            what="serving",
        )
        self.sidecars.append(sidecar)
        return sidecar

    def kill_sidecar(self, sidecar: Sidecar) -> None:
        """SIGKILLs a sidecar, as a crash would."""
        self.procs.kill(sidecar.child)

    def restart_sidecar(self, sidecar: Sidecar) -> Sidecar:
        """Starts a stopped or killed sidecar again on its socket, port and data dir.

        Returns the new record (also in ``sidecars`` and on its server) once its
        ``/readyz`` answers, which checks the gRPC socket the server uses.
        """
        child = self._respawn(sidecar.child)
        child.wait_ready(
            lambda: http_ok(f"http://127.0.0.1:{sidecar.metrics_port}/readyz"),
            timeout_s=120,
            what="ready",
        )
        new = replace(sidecar, child=child)
        self.sidecars = [new if s is sidecar else s for s in self.sidecars]
        self.servers = [
            replace(s, sidecar=new) if s.sidecar is sidecar else s for s in self.servers
        ]
        return new

    def _respawn(self, old: Child) -> Child:
        self.procs.stop(old)  # reaps it (and any straggler of its group)
        return self.procs.start(old.name, old.argv, env=self._env, stop_signal=old.stop_signal)

    def _mount_tmpfs(self, where: Path, size: str) -> None:
        from pydantic import ByteSize, TypeAdapter

        nbytes = TypeAdapter(ByteSize).validate_python(size)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(nbytes)}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise StartError(
                f"cannot mount a {size} tmpfs at {where} (needs root): {done.stderr.strip()}"
            )
        self._mounts.append(where)

    def _unmount_all(self) -> None:
        for where in reversed(self._mounts):
            done = subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
            if done.returncode != 0:
                log.warning("cannot unmount %s: %s", where, done.stderr.decode().strip())
        self._mounts.clear()

    # -- model servers --------------------------------------------------------------

    def start_servers(
        self,
        count: int,
        *,
        cache: bool,
        track: str = "stable",
        prefix: str = "server",
    ) -> list[Server]:
        """Starts ``count`` servers (each with its own sidecar when ``cache``) at once.

        They load in parallel; the call returns when every one answers ``/ready``.
        """
        started: list[Server] = []
        for _ in range(count):
            name = self._name(prefix)
            sidecar = self.start_sidecar(name + "-sidecar") if cache else None
            port = free_port()
            args = [
                "server",
                "--model", self.options.model,
                "--host", "127.0.0.1",
                "--port", str(port),
                "--threads", str(self.options.threads),
                "--max-queue", str(self.options.max_queue),
                *self.options.server_args,
            ]  # fmt: skip
            if sidecar is not None:
                args += ["--sidecar-socket", str(sidecar.socket)]
                args += ["--sidecar-data-dir", str(sidecar.data_dir)]
            child = self.procs.start(name, self._python(*args), env=self._env)
            started.append(Server(name, port, child, sidecar, track))
        for server in started:
            server.child.wait_ready(
                lambda s=server: http_ok(s.url + "/ready"),  # type: ignore[misc]
                timeout_s=self.options.ready_timeout_s,
                what="ready",
                interval_s=0.5,
            )
        self.servers.extend(started)
        return started

    def kill_server(self, server: Server) -> None:
        """SIGKILLs a model server (not its sidecar), as a crash would."""
        self.procs.kill(server.child)

    def restart_server(self, server: Server) -> Server:
        """Starts a stopped or killed server again on its port; returns once ready."""
        child = self._respawn(server.child)
        child.wait_ready(
            lambda: http_ok(server.url + "/ready"),
            timeout_s=self.options.ready_timeout_s,
            what="ready",
            interval_s=0.5,
        )
        new = replace(server, child=child)
        self.servers = [new if s is server else s for s in self.servers]
        return new

    def stop_server(self, server: Server) -> None:
        """Stops a server and its sidecar."""
        self.procs.stop(server.child, grace_s=30)
        if server.sidecar is not None:
            self.procs.stop(server.sidecar.child)
            if server.sidecar in self.sidecars:
                self.sidecars.remove(server.sidecar)
        if server in self.servers:
            self.servers.remove(server)

    # -- router ---------------------------------------------------------------------

    def start_router(
        self,
        stable: list[Server] | None = None,
        canary: list[Server] | None = None,
        *,
        canary_weight: float = 0.0,
        prompt_key: bool = True,
        routing: Literal["hash", "kv"] = "hash",
        session_memory_s: int = 0,
    ) -> Router:
        """Starts NGINX in front of the given servers (default: all, on stable).

        ``routing="kv"`` also starts the picker (KV-aware + similarity routing) and
        has NGINX consult it; ``"hash"`` is the session / prompt-key hash alone.
        ``session_memory_s`` keeps a session on its track across weight changes.
        """
        if self.router is not None:
            self.stop_router()
        stable = self.servers if stable is None and canary is None else (stable or [])
        template = Router(
            port=0,
            workdir=self.workdir,
            conf=self.workdir,
            child=None,  # type: ignore[arg-type]  # set by _start_nginx
            stable=tuple(s.address for s in stable),
            canary=tuple(s.address for s in canary or ()),
            canary_weight=canary_weight,
            prompt_key=prompt_key,
            balance_factor=self.options.balance_factor,
            session_memory_s=session_memory_s,
        )
        self.router = self._start_nginx(template, kv=routing == "kv")
        return self.router

    def start_router_replica(self) -> Router:
        """Starts one more router like :meth:`start_router`'s (its own NGINX, and its
        own picker with KV routing), as a Service's second router pod would be."""
        if self.router is None:
            raise RuntimeError("no router running")
        replica = self._start_nginx(self.router, kv=self.router.picker is not None)
        self.replicas.append(replica)
        return replica

    def _start_nginx(self, like: Router, *, kv: bool) -> Router:
        nginx = find_nginx()
        workdir = self.workdir / self._name("router")
        workdir.mkdir(parents=True, exist_ok=True)
        # NGINX run as root drops its workers to 'nobody'; they must reach the dir.
        for d in (self.workdir, workdir):
            d.chmod(0o755)
        router = replace(like, port=free_port(), workdir=workdir, conf=workdir / "nginx.conf")
        router.picker = router.picker_child = None
        if kv:
            servers = [s for s in self.servers if s.address in (*router.stable, *router.canary)]
            router.picker, router.picker_child = self._start_picker(servers)
        render_router(router)
        argv = [nginx, "-p", str(workdir), "-c", str(router.conf), "-e", "stderr"]
        argv += ["-g", "daemon off;"]
        router.child = self.procs.start("nginx", argv, stop_signal=signal.SIGQUIT)
        router.child.wait_ready(
            lambda: http_ok(router.url + "/dscache/router/health"),
            timeout_s=30,
            what="serving",
        )
        return router

    def set_canary_weight(self, weight: float) -> None:
        """Re-renders every router's config with a new canary weight and reloads NGINX.

        Returns once every old worker has exited, so each later request sees the
        new weight.
        """
        if self.router is None:
            raise RuntimeError("no router running")
        for router in (self.router, *self.replicas):
            router.canary_weight = weight
            render_router(router)
            self.reload_router(router)

    def reload_router(self, router: Router | None = None) -> None:
        """Reloads NGINX (SIGHUP; default: the first router) and returns once every old
        worker has exited.

        Old workers finish the requests they hold first, so a reload under load
        drops none.
        """
        router = router or self.router
        if router is None:
            raise RuntimeError("no router running")
        child = router.child
        before = set(worker_pids(child.pid))
        os.kill(child.pid, signal.SIGHUP)

        def reloaded() -> bool:
            now = set(worker_pids(child.pid))
            return bool(now) and not now & before

        if not poll(reloaded, timeout=30, interval=0.05):
            raise StartError(f"nginx did not reload; log {child.log_path}")

    def stop_router(self) -> None:
        """Stops every router (NGINX, graceful quit) and its picker."""
        for router in (*self.replicas, *([self.router] if self.router else [])):
            self.procs.stop(router.child)
            if router.picker_child is not None:
                self.procs.stop(router.picker_child)
        self.router = None
        self.replicas.clear()

    def start_endpoint_picker(
        self, servers: list[Server], track_weights: dict[str, float] | None = None
    ) -> str:
        """Starts ``dscache picker --epp`` over ``servers`` (each on its own track, as
        a gateway's InferencePool holds them); returns its ext_proc ``host:port``."""
        eport = free_port()
        extra = ["--epp", "--epp-host", "127.0.0.1", "--epp-port", str(eport)]
        extra += [a for s in servers for a in ("--epp-endpoint", f"{s.address}={s.track}")]
        for track, weight in (track_weights or {}).items():
            extra += ["--epp-track-weight", f"{track}={weight}"]
        _address, child = self._start_picker(servers, extra)
        child.wait_ready(
            lambda: port_open("127.0.0.1", eport), timeout_s=30, what="ext_proc", interval_s=0.2
        )
        return f"127.0.0.1:{eport}"

    def _start_picker(self, servers: list[Server], extra: Sequence[str] = ()) -> tuple[str, Child]:
        """Starts ``dscache picker`` knowing each server's sidecar filter; its address."""
        port = free_port()
        args = ["picker", "--host", "127.0.0.1", "--port", str(port), "--refresh", "0.5", *extra]
        for s in servers:
            if s.sidecar is not None:
                url = f"http://127.0.0.1:{s.sidecar.metrics_port}/dscache/holdings"
                args += ["--holdings", f"{s.address}={url}"]
        child = self.procs.start(self._name("picker"), self._python(*args), env=self._env)
        child.wait_ready(
            lambda: http_ok(f"http://127.0.0.1:{port}/health"),
            timeout_s=60,
            what="serving",
            interval_s=0.2,
        )
        return f"127.0.0.1:{port}", child

    # -- prometheus -----------------------------------------------------------------

    def start_prometheus(self, scrape_interval_s: int = 2, run_label: str = "") -> int:
        """Points Debian's Prometheus at every running server and sidecar.

        The first call starts it; later calls rewrite its targets and reload it
        (SIGHUP), so one Prometheus and one TSDB span every pass of a demo. Targets
        carry ``run=<run_label>``. Returns its port.
        """
        binary = shutil.which("prometheus")
        if binary is None:
            raise StartError("Prometheus is optional and not installed: apt-get install prometheus")
        pdir = self.workdir / "prometheus"
        pdir.mkdir(parents=True, exist_ok=True)
        conf = pdir / "prometheus.yml"
        conf.write_text(
            prometheus_config(self.servers, self.sidecars, scrape_interval_s, run_label)
        )
        if self._prometheus is not None and self._prometheus.alive():
            os.kill(self._prometheus.pid, signal.SIGHUP)
            assert self.prometheus_port is not None
            return self.prometheus_port
        port = free_port()
        child = self.procs.start(
            "prometheus",
            [
                binary,
                f"--config.file={conf}",
                f"--storage.tsdb.path={pdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
        )
        child.wait_ready(
            lambda: http_ok(f"http://127.0.0.1:{port}/-/ready"),
            timeout_s=60,
            what="ready",
        )
        self._prometheus = child
        self.prometheus_port = port
        return port

    def stop(self) -> None:
        """Stops everything this stack started: the servers first, since a sidecar
        told to stop serves on while a server is connected (its last stores)."""
        for server in self.servers:
            self.procs.stop(server.child)
        self.procs.stop_all()
        self._unmount_all()
        self.servers.clear()
        self.sidecars.clear()
        self.router = None
        self._prometheus = None
        self.prometheus_port = None
