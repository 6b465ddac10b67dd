"""The operator's cluster-test harness: a real Prometheus and the real operator as processes.

Kept out of conftest.py so the tests can import the types.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fakes.server_metrics import FakeServerMetrics

from dscache.devcluster import DevCluster

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _need(binary: str, package: str) -> str:
    path = shutil.which(binary) or (
        f"/usr/bin/{binary}" if Path(f"/usr/bin/{binary}").exists() else None
    )
    if path is None:
        message = f"needs `{binary}` (apt-get install {package})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class PrometheusProcess:
    """A real Prometheus scraping ``metrics`` every second."""

    def __init__(self, workdir: Path, metrics: FakeServerMetrics) -> None:
        self.metrics = metrics
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: dscache-server\n"
            "    honor_labels: true\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{metrics.port}']}}]\n"
        )
        self.log = workdir / "prometheus.log"
        self._log = self.log.open("w")
        self.proc = subprocess.Popen(
            [
                _need("prometheus", "prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        # Ready, and the target scraped once (discovery applies targets every 5 s).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self._scraped():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus did not start: {self.log.read_text()[-2000:]}")

    def _scraped(self) -> bool:
        url = f"{self.url}/api/v1/query?query=up"
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(json.loads(r.read())["data"]["result"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class OperatorProcess:
    """``dscache operator`` as a child process; ``restart()`` and ``kill()`` for the tests."""

    def __init__(
        self,
        cluster: DevCluster,
        workdir: Path,
        prometheus_url: str,
        kubeconfig: Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.prometheus_url = prometheus_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start()

    @property
    def log(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def start(self) -> None:
        env = self.cluster.env()
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        paths = [str(ROOT / "operator"), str(ROOT / "sidecar"), str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
        self.starts += 1
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dscache.cli",
                    "operator",
                    "--all-namespaces",
                    "--tick-seconds",
                    "1",
                    "--prometheus-url",
                    self.prometheus_url,
                    "--health-port",
                    "0",
                    "--metrics-port",
                    "0",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""
