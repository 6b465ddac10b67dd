"""Using a running dev cluster: environment, shell exports, kubectl and helm.

Contract:
    * :meth:`ClusterAccess.env` and :meth:`ClusterAccess.shell_exports` put the
      cluster's own kubectl and helm (same version as the API server) first on
      PATH and point KUBECONFIG at the admin kubeconfig; exports are quoted
      for a POSIX shell, and name ``DSCACHE_PROMETHEUS_URL`` when Prometheus
      runs beside the cluster.
    * :meth:`ClusterAccess.kubectl` and :meth:`ClusterAccess.helm` capture the
      output and, with ``check``, raise :class:`ToolError`, whose message
      includes what the tool printed. A command that names its own
      ``--timeout=<duration>`` gets that long and 30 s more before it is
      killed, whatever ``timeout`` says (``rollout status --timeout=600s`` was
      cut at the default 120 s).
    * :meth:`ClusterAccess.install_chart` is ``helm upgrade --install`` that
      creates the namespace and waits for the release's resources;
      :meth:`ClusterAccess.temporary_namespace` deletes its namespace on exit
      without waiting for it to go.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dscache_operator.schema import parse_duration

from dscache_tools.devcluster.build import Binaries


class ToolError(subprocess.CalledProcessError):
    """kubectl or helm failed; ``str()`` includes what it printed on stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr:\n{self.stderr}\nstdout:\n{self.output}"


@dataclass(eq=False, kw_only=True)
class ClusterAccess:
    """How to reach a cluster: its kubeconfig, its tools and its Prometheus.

    Attributes:
        kubeconfig: Admin kubeconfig.
        binaries: The cluster's binaries; ``tool_dirs`` hold kubectl and helm.
        prometheus_url: The Prometheus beside the cluster (pods reach it), if any.
    """

    kubeconfig: Path
    binaries: Binaries
    prometheus_url: str | None = None

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
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs the matching kubectl against this cluster.

        Args:
            *args: kubectl arguments.
            stdin: Text fed to kubectl (e.g. a manifest for ``apply -f -``).
            check: Raise :class:`ToolError` (a ``CalledProcessError``) on a non-zero exit.
            timeout: Seconds before the command is killed.
        """
        return self._tool(self.binaries.kubectl, args, stdin, check, _with_own(args, timeout))

    def kubectl_json(self, *args: str, timeout: float = 120.0) -> Any:
        """``kubectl <args> -o json``, decoded."""
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def helm(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs the matching helm against this cluster (same arguments as :meth:`kubectl`)."""
        return self._tool(self.binaries.helm, args, stdin, check, _with_own(args, timeout))

    def _tool(
        self, exe: Path, args: tuple[str, ...], stdin: str | None, check: bool, timeout: float
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

    def install_chart(
        self,
        release: str,
        chart: Path,
        namespace: str,
        values: Mapping[str, object] | None = None,
        timeout: str = "120s",
    ) -> None:
        """Installs or upgrades ``chart`` as ``release`` and waits until its resources are ready.

        Args:
            release: The release name.
            chart: The chart's directory.
            namespace: Created when missing.
            values: ``--set`` values (``{"operator.replicas": 0}``).
            timeout: helm's ``--timeout`` for the wait.
        """
        sets = [arg for key, value in (values or {}).items() for arg in ("--set", f"{key}={value}")]
        self.helm(
            "upgrade",
            "--install",
            release,
            str(chart),
            "--namespace",
            namespace,
            "--create-namespace",
            *sets,
            "--wait",
            "--timeout",
            timeout,
        )

    @contextlib.contextmanager
    def temporary_namespace(self, name: str) -> Iterator[str]:
        """Creates namespace ``name`` for the ``with`` block, deletes it (without waiting) after."""
        self.kubectl("create", "namespace", name)
        try:
            yield name
        finally:
            self.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _with_own(args: tuple[str, ...], timeout: float) -> float:
    """``timeout``, or longer: the command's own ``--timeout=<duration>`` (``600s``,
    ``5m``, ``1m30s``: the CRD's duration form) and 30 s more, so the tool gives up
    before it is killed."""
    for arg in args:
        if arg.startswith("--timeout="):
            try:
                own = parse_duration(arg.removeprefix("--timeout="))
            except ValueError:
                continue
            timeout = max(timeout, own + 30.0)
    return timeout
