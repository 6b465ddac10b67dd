"""A model pod deleted while it answers keeps the answer's blocks.

Kubernetes sends SIGTERM to a deleted pod's containers at once. Here, as there:
a real ``dscache server`` process and its real sidecar get SIGTERM together the
moment the first streamed chunk of an answer arrives. The server finishes the
answer and stores its blocks on the way out; the sidecar serves those calls
before it stops (before, it refused them and the blocks were lost: 0 of 4 kept
in a trial, 4 of 4 with the drain). After a restart the blocks are on disk.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from dscache_sidecar.client import SidecarClient
from dscache_tools.net import free_port
from dscache_tools.polling import wait_until
from dscache_tools.procs import http_ok
from dscache_tools.sidecarproc import SidecarProcess
from srv_helpers import REPO

pytestmark = pytest.mark.slow  # a server process and a sidecar process


def _blocks(d: SidecarProcess) -> int:
    with SidecarClient(d.socket, timeout_s=5) as c:
        return int(c.stats().blocks)


def test_an_answer_in_flight_at_sigterm_is_stored_before_the_pod_goes(tmp_path: Path) -> None:
    d = SidecarProcess(tmp_path / "data", "--segment-init", "sparse", "--drain-max", "60")
    d.start()
    port = free_port()
    with (tmp_path / "server.log").open("wb") as out:
        server = subprocess.Popen(
            [
                sys.executable, "-m", "dscache.cli", "server",
                "--model", "tiny-gqa", "--host", "127.0.0.1", "--port", str(port),
                "--threads", "1",
                "--sidecar-socket", d.socket, "--sidecar-data-dir", str(d.data_dir),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )  # fmt: skip
    try:
        ready = f"http://127.0.0.1:{port}/ready"
        wait_until("the server ready", lambda: http_ok(ready), 300, interval=0.2)
        before = _blocks(d)  # its start-up calibration's own
        text = " ".join(f"Line {k} of the filing says {k * 7 % 13} things." for k in range(120))
        body = {
            "model": "tiny-gqa",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 64,
            "stream": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.readline()  # the first chunk: the prefill is done, the answer in flight
            assert d.child is not None
            server.send_signal(signal.SIGTERM)  # the pod is deleted: both at once
            d.child.signal(signal.SIGTERM)
            rest = resp.read()
        assert b"[DONE]" in rest, "the answer in flight was cut: " + rest[-300:].decode()
        # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
        assert server.wait(60) in (0, -signal.SIGTERM)
        assert d.proc is not None and d.proc.wait(60) == 0
        log = d.log.read_text()
        assert "drained (no clients)" in log, log[-2000:]
        # The stores came after the SIGTERM, so the test exercised the drain.
        assert re.search(r"calls served meanwhile: .*Commit [1-9]", log), log[-2000:]
        d.start()
        assert _blocks(d) > before, "the answer's blocks were lost with the pod"
        assert d.terminate() == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        d.stop()
