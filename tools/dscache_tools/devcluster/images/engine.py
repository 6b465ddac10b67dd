"""A private Docker engine that exists only while images are built.

Contract:
    * ``dockerd`` with its own ``containerd``, both with every file (data
      root, exec root, pid files, sockets, logs) under one directory
      (``<cache>/images/docker/``); no bridge, no iptables rules, no IP
      forwarding or masquerading, and the client config is private too. Its
      data root persists, so rebuilds reuse Docker's layer cache.
    * The daemons run under ``nice -n 19`` for builds (and so do the build
      steps they start; ``nice=0`` for an engine that runs the images as a
      kubelet's pods run, as the image tests do), get SIGTERM if the builder
      dies (PR_SET_PDEATHSIG), and are stopped when the ``with`` block ends,
      also on errors; a later start stops any leftover of a killed run first.
    * Needs root and Debian's ``docker.io`` (dockerd, containerd, runc and a
      client with BuildKit built in); a missing piece is an
      :class:`.specs.ImageError` naming the package.
    * Standard library only, like the rest of :mod:`..images`; its two
      readiness loops are the only hand-written polls of the dev cluster
      (tenacity is not installed yet when ``scripts/build-images.sh`` runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from dscache_tools.devcluster.images.client import DockerClient, existing, need_root
from dscache_tools.devcluster.images.specs import ImageError
from dscache_tools.devcluster.procs import (
    Progress,
    cmdline,
    mount_points,
    process_name,
    remove_cgroup,
    tail,
    terminate,
)
from dscache_tools.procs import start_child

logger = logging.getLogger(__name__)

#: Seconds between "still building" messages.
_HEARTBEAT_S = 60.0
#: Longest unix socket path (sun_path is 108 bytes with the terminating NUL).
_MAX_SOCKET_PATH = 100
#: The top-level cgroup the private engine's containers and build steps run under
#: (dockerd's ``--cgroup-parent``; dockerd's default, ``docker``, may be a real
#: engine's): removed in every hierarchy once the engine has stopped.
CGROUP_PARENT = "dscache-image-builder"


class PrivateDocker(DockerClient):
    """A ``dockerd`` and ``containerd`` of our own under one directory, for building images.

    ``with PrivateDocker(directory, say) as docker:`` starts both (stopping
    leftovers of a killed earlier run first) and stops both on exit.
    ``docker.run([...])`` runs the docker client against it. Nothing outside
    ``directory`` changes except what containerd's runc shims need while
    containers run (their sockets under /run/containerd/s, runc state under
    /run/containerd/runc/moby); the mounts dockerd leaves behind (its data
    root bound onto itself, the default network namespace) are unmounted
    once it has stopped, and so are the cgroups under :data:`CGROUP_PARENT`.
    """

    def __init__(self, directory: Path, say: Progress | None = None, *, nice: int = 19) -> None:
        runtime = directory / "run"
        if len(str(runtime / "containerd" / "containerd.sock.ttrpc")) > _MAX_SOCKET_PATH:
            # A long cache path would overflow sun_path: keep sockets in a short private dir.
            key = hashlib.sha256(str(directory).encode()).hexdigest()[:12]
            runtime = Path(tempfile.gettempdir()) / f"dscache-docker-{key}"
        super().__init__(directory, runtime / "docker.sock", say)
        self.runtime = runtime
        self.containerd_socket = runtime / "containerd" / "containerd.sock"
        self._dockerd: subprocess.Popen[bytes] | None = None
        self._containerd: subprocess.Popen[bytes] | None = None
        self._nice = nice

    # paths
    @property
    def _dockerd_pidfile(self) -> Path:
        return self.runtime / "docker.pid"

    @property
    def _containerd_pidfile(self) -> Path:
        return self.runtime / "containerd.pid"

    def __enter__(self) -> PrivateDocker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Starts containerd, then dockerd; returns once the engine answers.

        Raises:
            ImageError: A tool is missing, or a daemon did not come up (the
                message has its log's tail); nothing is left running then.
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        need_root("the private dockerd")
        dockerd = shutil.which("dockerd") or existing("/usr/sbin/dockerd")
        containerd = shutil.which("containerd") or existing("/usr/bin/containerd")
        missing = [
            name
            for name, found in (
                ("dockerd", dockerd),
                ("containerd", containerd),
                ("runc", shutil.which("runc") or existing("/usr/sbin/runc")),
            )
            if found is None
        ]
        if missing or dockerd is None or containerd is None:
            raise ImageError(
                f"{', '.join(missing)} not found: apt-get install docker.io "
                "(Debian's package brings dockerd, containerd and runc; "
                "scripts/build-images.sh installs it)"
            )
        for path in (self.directory, self.runtime, self.directory / "client"):
            path.mkdir(parents=True, exist_ok=True)
        self._stop_leftover(self._dockerd_pidfile, "dockerd")
        self._stop_leftover(self._containerd_pidfile, "containerd")
        ctr_dir = self.directory / "containerd"
        ctr_dir.mkdir(exist_ok=True)
        self.containerd_socket.parent.mkdir(parents=True, exist_ok=True)
        config = ctr_dir / "config.toml"
        config.write_text(
            "\n".join(
                [
                    "# containerd of dscache's image builder (dscache_tools.devcluster.images)",
                    "version = 2",
                    f'root = "{ctr_dir / "root"}"',
                    f'state = "{self.runtime / "containerd" / "state"}"',
                    'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
                    "",
                    "[grpc]",
                    f'  address = "{self.containerd_socket}"',
                    "",
                    "[ttrpc]",
                    f'  address = "{self.containerd_socket}.ttrpc"',
                    "",
                    '[plugins."io.containerd.internal.v1.opt"]',
                    f'  path = "{ctr_dir / "opt"}"',
                    "",
                ]
            )
        )
        self._containerd = self._spawn(
            [containerd, "--config", str(config), "--log-level", "warn"],
            ctr_dir / "containerd.log",
        )
        self._containerd_pidfile.write_text(f"{self._containerd.pid}\n")
        self._wait_for_socket(
            self.containerd_socket, self._containerd, ctr_dir / "containerd.log", 30.0
        )

        daemon_json = self.directory / "daemon.json"
        # dockerd 20.10 writes a trust key to /etc/docker/key.json unless told otherwise.
        daemon_json.write_text(
            json.dumps({"deprecated-key-path": str(self.directory / "key.json")}, indent=2) + "\n"
        )
        self._dockerd = self._spawn(
            [
                dockerd,
                "--config-file",
                str(daemon_json),
                "--data-root",
                str(self.directory / "data"),
                "--exec-root",
                str(self.runtime / "exec"),
                "--pidfile",
                str(self._dockerd_pidfile),
                "--host",
                f"unix://{self.socket}",
                "--containerd",
                str(self.containerd_socket),
                "--bridge=none",
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--log-level=warn",
                f"--cgroup-parent=/{CGROUP_PARENT}",
            ],
            self.directory / "dockerd.log",
        )
        deadline = time.monotonic() + 60.0
        while True:
            if self._dockerd.poll() is not None:
                log = self.directory / "dockerd.log"
                raise ImageError(
                    f"dockerd exited with {self._exit_code()} at start; {log}:\n{tail(log, 40)}"
                )
            probe = subprocess.run(
                [self._client, "version", "--format", "{{.Server.Version}}"],
                env=self.env(),
                capture_output=True,
                text=True,
                check=False,
            )
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise ImageError(
                    f"dockerd did not answer on {self.socket} within 60 s: {probe.stderr.strip()}"
                )
            time.sleep(0.3)
        driver = self.run(["info", "--format", "{{.Driver}}"]).strip()
        self._say(f"private dockerd {probe.stdout.strip()} up ({driver}) on {self.socket}")
        if driver != "overlay2":
            self._say(f"warning: storage driver {driver}: layers are full copies (slow, large)")
        self.check_buildx()

    def _exit_code(self) -> int | None:
        return self._dockerd.returncode if self._dockerd else None

    def _spawn(self, command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        argv = ["nice", "-n", str(self._nice), *command]
        # SIGTERM when the builder dies: the daemons shut down cleanly instead of
        # holding the data root until the next build stops them as leftovers.
        return start_child(Path(command[0]).name, argv, log_path, tie=signal.SIGTERM).proc

    @staticmethod
    def _wait_for_socket(
        path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ImageError(
                    f"containerd exited with {proc.returncode} at start; {log}:\n{tail(log, 40)}"
                )
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(path))
                return
            time.sleep(0.1)
        raise ImageError(f"containerd did not listen on {path} within {timeout:.0f} s; see {log}")

    def _stop_leftover(self, pidfile: Path, name: str) -> None:
        """Stops a daemon a killed earlier run left behind (we hold the build lock)."""
        pid = self._alive_pidfile(pidfile, name)
        if pid is not None:
            self._say(f"stopping leftover {name} (pid {pid}) of an interrupted build")
            terminate(pid, 30.0)
        pidfile.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stops dockerd (its containers first), then containerd; idempotent."""
        for proc, pidfile in (
            (self._dockerd, self._dockerd_pidfile),
            (self._containerd, self._containerd_pidfile),
        ):
            if proc is None:
                continue
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=45.0)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            pidfile.unlink(missing_ok=True)
        self._dockerd = None
        self._containerd = None
        self._undo_leftovers()

    def _undo_leftovers(self) -> None:
        """Unmounts what dockerd leaves mounted after it exits, removes its cgroups.

        dockerd bind-mounts its data root onto itself (to make it a private
        mount) and keeps the default network namespace mounted under its exec
        root; neither is undone at shutdown, so the host would keep them. The
        cgroups it and BuildKit made under :data:`CGROUP_PARENT` stay too (a
        fresh host had ``docker`` and ``docker/buildkit`` groups after a build).
        """
        if self._alive_pidfile(self._dockerd_pidfile, "dockerd") is not None:
            return  # not ours to undo while some dockerd still runs on them
        for point in mount_points(self.directory, self.runtime):
            subprocess.run(["umount", point], capture_output=True, check=False)
        for group in remove_cgroup(CGROUP_PARENT):
            logger.warning("cgroup %s is still in use; left in place", group)

    def _alive_pidfile(self, pidfile: Path, name: str) -> int | None:
        """The pid in ``pidfile`` when it is a live ``name`` working in our directory."""
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        alive = process_name(pid) == name and str(self.directory) in cmdline(pid)
        return pid if alive else None
