"""The docker client side of the image build: finding a client, running it against an engine.

Contract:
    * :func:`docker_client` finds a client with BuildKit built in (Debian's
      ``/usr/bin/docker`` 20.10, or one named by ``DSCACHE_DOCKER``); a newer
      client without the buildx plugin is an :class:`.specs.ImageError`.
    * :class:`DockerClient` talks only to the engine at its socket, with a
      private client config: a user's ``DOCKER_CONTEXT`` or TLS settings never
      apply.
    * :meth:`DockerClient.run_logged` keeps a build's output in a log, reports
      the current build step every minute and, when interrupted, kills the
      client (dockerd then cancels the build).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from dscache_tools.devcluster.images.specs import ImageArchive, ImageError
from dscache_tools.devcluster.procs import Progress, tail, wait_with_heartbeat

logger = logging.getLogger(__name__)

#: Seconds between "still building" messages.
_HEARTBEAT_S = 60.0
_STEP_RE = re.compile(r"^#\d+ \[[^\]]+\] .*$")


def existing(path: str) -> str | None:
    """``path`` when it is an executable file, else None."""
    return path if os.access(path, os.X_OK) else None


def need_root(what: str) -> None:
    """Raises :class:`.specs.ImageError` unless this process runs as root."""
    if os.geteuid() != 0:
        raise ImageError(f"{what} needs root: run as root (or through sudo)")


def docker_client() -> str:
    """A docker client with BuildKit built in.

    Debian's docker.io client (``/usr/bin/docker``, 20.10) builds with BuildKit
    itself; clients from 23.0 on hand ``docker build`` to the buildx plugin.
    """
    override = os.environ.get("DSCACHE_DOCKER")
    if override:
        return override
    found = existing("/usr/bin/docker") or shutil.which("docker")
    if found is None:
        raise ImageError(
            "no docker client: apt-get install docker.io (scripts/build-images.sh does)"
        )
    return found


class DockerClient:
    """A docker client bound to the engine listening on ``socket``.

    Args:
        directory: The engine's directory; the client config is ``client/`` in it.
        socket: The engine's unix socket.
        say: Receives progress lines; defaults to the module logger.
    """

    def __init__(self, directory: Path, socket: Path, say: Progress | None = None) -> None:
        self.directory = directory
        self.socket = socket
        self._say: Progress = say or (lambda line: logger.info("%s", line))
        self._client = docker_client()

    def env(self) -> dict[str, str]:
        """Environment for a docker client talking to this engine (BuildKit on, private config)."""
        env = dict(os.environ)
        env.update(
            {
                "DOCKER_HOST": f"unix://{self.socket}",
                "DOCKER_BUILDKIT": "1",
                "DOCKER_CONFIG": str(self.directory / "client"),
            }
        )
        env.pop("DOCKER_CONTEXT", None)
        env.pop("DOCKER_TLS_VERIFY", None)
        return env

    def check_buildx(self) -> None:
        """Raises :class:`.specs.ImageError` when the client needs a buildx plugin it lacks."""
        version = self.run(["version", "--format", "{{.Client.Version}}"]).strip()
        match = re.match(r"(\d+)\.", version)
        if match and int(match[1]) >= 23:
            buildx = subprocess.run(
                [self._client, "buildx", "version"],
                env=self.env(),
                capture_output=True,
                check=False,
            )
            if buildx.returncode != 0:
                raise ImageError(
                    f"{self._client} {version} builds only through the buildx plugin, which is "
                    "missing: use Debian's /usr/bin/docker (docker.io) or set DSCACHE_DOCKER"
                )

    def run(self, args: Sequence[str], check: bool = True, timeout: float | None = None) -> str:
        """Runs ``docker <args>`` against this engine and returns its stdout.

        Raises:
            ImageError: The command failed and ``check`` is set.
        """
        done = subprocess.run(
            [self._client, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise ImageError(
                f"docker {' '.join(args[:3])} failed (exit {done.returncode}): "
                f"{done.stderr.strip()[-2000:]}"
            )
        return done.stdout

    def ensure_loaded(self, archive: ImageArchive) -> None:
        """Makes ``archive.ref`` name the archive's image here (``docker load`` when not)."""
        present = self.run(
            ["image", "inspect", "--format", "{{.Id}}", archive.ref], check=False
        ).strip()
        if present != archive.image_id:
            self._say(f"docker load {archive.path}")
            self.run(["load", "--input", str(archive.path)])

    def run_logged(self, args: Sequence[str], log_path: Path, what: str, say: Progress) -> None:
        """Runs a long docker command with its output in ``log_path`` and a heartbeat."""
        started = time.monotonic()
        with log_path.open("w") as log:
            log.write(" ".join([self._client, *args]) + "\n")
            log.flush()
            proc = subprocess.Popen(
                [self._client, *args],
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

            def beat() -> None:
                step = _last_step(log_path)
                say(
                    f"{what}: still building ({time.monotonic() - started:.0f} s)"
                    + (f": {step}" if step else "")
                )

            # Interrupted: the client's end of the build goes; dockerd cancels the solve.
            code = wait_with_heartbeat(proc, _HEARTBEAT_S, beat)
        if code != 0:
            raise ImageError(
                f"{what}: docker {args[0]} failed (exit {code}); {log_path}:\n{tail(log_path, 40)}"
            )


_STEP_RE = re.compile(r"^#\d+ \[[^\]]+\] .*$")


def _last_step(log_path: Path) -> str:
    """The last ``#N [stage k/n] INSTRUCTION`` line of a plain-progress build log, shortened."""
    steps = [line for line in tail(log_path, 400).splitlines() if _STEP_RE.match(line)]
    return steps[-1][:120] if steps else ""
