"""``dscache sidecar`` as a real child process: the one launcher of tests and benchmarks.

Contract:
    * :meth:`SidecarProcess.start` runs ``python -m dscache.cli sidecar`` on
      ``data_dir`` (socket ``data_dir/sidecar.sock``, metrics on a free loopback
      port, no restart quarantine, plus the caller's extra flags) and returns
      once the standard gRPC health check answers SERVING and the child has
      printed its ready line (ports included); a child that exits first raises
      with the tail of its log. SIGTERM's drain lasts at most 5 s (``--drain-max``;
      a later flag in ``extra`` wins).
    * :meth:`kill` is the crash case (SIGKILL), :meth:`terminate` the clean one
      (SIGTERM, the exit code); :meth:`stop` is idempotent and never leaves a
      child behind (SIGKILL after a grace period). The child runs under the
      tooling's supervisor (:mod:`dscache_tools.procs`), in a session of its own.
    * The log (stdout and stderr) goes to ``<data_dir>.log`` beside the data
      directory, appended across restarts; :attr:`http_port` is the HTTP port
      (metrics, probes, ``/debug/fault``) of the latest start, read from it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from dscache_sidecar.client import SidecarClient

from dscache_tools.polling import wait_until
from dscache_tools.procs import Child, start_child

_READY = "dscache sidecar ready:"


class SidecarProcess:
    """One sidecar daemon as a subprocess that can be killed and started again."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        """Prepares (does not start) a daemon.

        Args:
            data_dir: the store's directory (created).
            extra: more ``dscache sidecar`` flags.
        """
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.socket = str(data_dir / "sidecar.sock")
        self.extra = extra
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self.child: Child | None = None
        self._ready_lines = 0

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The latest start's process (None before the first)."""
        return self.child.proc if self.child is not None else None

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        return [
            sys.executable, "-m", "dscache.cli", "sidecar",
            "--data-dir", str(self.data_dir),
            "--socket", self.socket,
            "--metrics-port", "0",
            "--metrics-host", "127.0.0.1",
            "--restart-quarantine", "0",
            # A client a test leaves connected holds SIGTERM's drain: 5 s, not 20.
            "--drain-max", "5",
            *self.extra,
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        """Starts the daemon and waits until it is healthy.

        Raises:
            RuntimeError: the daemon exited before it became healthy.
            TimeoutError: it did not become healthy within ``timeout`` s.
        """
        # Health answers from inside create_server, the ready line (with the
        # HTTP port) is printed just after it returns: wait for both, or a
        # caller reading http_port races the print.
        self._ready_lines = self._count_ready_lines()
        self.child = start_child("sidecar", self.command(), self.log)
        wait_until(f"the sidecar on {self.socket}", self._healthy, timeout, interval=0.05)

    def _count_ready_lines(self) -> int:
        return self.log.read_text().count(_READY) if self.log.exists() else 0

    def _healthy(self) -> bool:
        if not self.running():
            raise RuntimeError(f"sidecar exited: {self.log.read_text()[-3000:]}")
        if not Path(self.socket).exists() or self._count_ready_lines() <= self._ready_lines:
            return False
        probe = SidecarClient(self.socket, timeout_s=1)
        try:
            return probe.healthy()
        finally:
            probe.close()

    @property
    def http_port(self) -> int:
        """The HTTP port (``/metrics``, probes, ``/debug/fault``) the latest start printed."""
        ports = re.findall(r"metrics_port=(\d+)", self.log.read_text())
        if not ports:
            raise RuntimeError(f"the sidecar printed no metrics port: {self.log}")
        return int(ports[-1])

    def running(self) -> bool:
        """Whether the child is alive."""
        return self.child is not None and self.child.alive()

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.child is not None and self.running():
            self.child.kill()

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and the exit code: the clean case.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` s.
        """
        assert self.child is not None, "never started"
        if self.running():
            self.child.signal(signal.SIGTERM)
        return self.child.proc.wait(timeout)

    def stop(self) -> None:
        """Stops the child if it runs: SIGTERM, then SIGKILL after 20 s."""
        if self.child is not None and self.running():
            self.child.stop(grace_s=20.0)
