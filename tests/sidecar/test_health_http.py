"""The sidecar's HTTP health endpoints, which the kubelet probes instead of spawning Python.

``/healthz`` says what the daemon's gRPC health service says; ``/readyz`` asks it
over the unix socket the model server uses; ``/metrics`` is what it always was.
Against the real daemon: as a subprocess (as a pod runs it) and in-process (to
drive it into the states a probe must see).
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from sidecar_helpers import DaemonProcess, Sidecar


def _get(port: int, path: str, accept: str | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if accept:
        req.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def _metrics_port(daemon: DaemonProcess) -> int:
    m = re.search(r"metrics_port=(\d+)", daemon.log.read_text())
    assert m, daemon.log.read_text()
    return int(m.group(1))


def test_the_daemon_answers_probes_and_metrics_on_one_port(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory()
    d.start()
    port = _metrics_port(d)
    assert _get(port, "/healthz")[::2] == (200, "SERVING\n")
    assert _get(port, "/readyz")[::2] == (200, "SERVING\n")
    # /metrics as prometheus_client serves it: text format, or OpenMetrics on request.
    status, ctype, body = _get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    assert "dscache_sidecar_lookups_total" in body
    _, ctype, body = _get(port, "/metrics", accept="application/openmetrics-text")
    assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith("# EOF")
    assert d.terminate() == 0


def test_probes_follow_the_health_service(make_sidecar: Callable[..., Sidecar]) -> None:
    s = make_sidecar()
    assert s.running is not None and s.running.metrics_port is not None
    port = s.running.metrics_port
    assert _get(port, "/readyz")[0] == 200
    # The gRPC server stops answering: not ready (the socket check fails), still alive.
    s.running.server.stop(0).wait()
    status, _, body = _get(port, "/readyz")
    assert status == 503 and body.startswith("ERROR: UNAVAILABLE"), body
    assert _get(port, "/healthz")[::2] == (200, "SERVING\n")
    # A graceful stop: the health service says NOT_SERVING, and so does /healthz.
    s.running.health.enter_graceful_shutdown()
    assert _get(port, "/healthz")[::2] == (503, "NOT_SERVING\n")
    assert _get(port, "/metrics")[0] == 200  # metrics stay up to the end


def test_stopping_frees_the_port(tmp_path: Path) -> None:
    s = Sidecar(tmp_path / "data")
    assert s.running is not None and s.running.metrics_port is not None
    port = s.running.metrics_port
    assert _get(port, "/healthz")[0] == 200
    s.stop()
    deadline = time.monotonic() + 10
    while True:
        try:
            _get(port, "/healthz")
        except OSError:
            break  # refused: nothing listens any more
        assert time.monotonic() < deadline, "the HTTP server outlived the daemon"
        time.sleep(0.05)
    with pytest.raises(OSError):
        _get(port, "/healthz")
