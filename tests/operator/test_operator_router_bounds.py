"""The router forwards only the API, and bounds what a client can hold (issue 30, 2 and 7).

Real NGINX running the operator's rendered config, a loopback stand-in pod
behind it: a model pod's ``/metrics`` and ``/dscache/*`` are never reached
through the client-facing port; requests in progress are capped (a JSON 503
with ``Retry-After`` past the cap); a client that stops sending its body is cut
off by the body timeout instead of holding its buffer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from needs import need_nginx
from router.router_helpers import Nginx, Pod, call, wait_for

pytestmark = pytest.mark.slow

NOT_FORWARDED = [
    "/metrics",
    "/dscache/keyinfo",
    "/dscache/holdings",
    "/dscache/templates",
    "/dscache/templates/filter",
    "/health",
    "/ready",
    "/v1/../metrics",
    "/%2e%2e/metrics",
]


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    os.chmod(tmp_path, 0o755)  # NGINX's workers may drop to 'nobody'
    n = Nginx(need_nginx(), tmp_path)
    yield n
    n.stop()


@pytest.fixture
def pod() -> Iterator[Pod]:
    p = Pod("p0")
    yield p
    p.close()


def test_only_the_api_is_forwarded(nginx: Nginx, pod: Pod) -> None:
    nginx.start(nginx.config(stable=(pod.address,)))
    for path in NOT_FORWARDED:
        resp = call(nginx.port, path)
        assert resp is not None and resp.status_code in (400, 404), path
        if resp.status_code == 404:
            assert resp.json()["error"]["code"] == "not_found"
    assert pod.arrived == 0, pod.headers
    resp = call(nginx.port, "/v1/models")
    assert resp is not None and resp.status_code == 200 and resp.json()["pod"] == "p0"
    # The router's own endpoints are NGINX's, not a pod's.
    assert call(nginx.port, "/dscache/router/health") is not None
    assert pod.arrived == 1


def test_requests_in_progress_are_capped_with_a_json_503(nginx: Nginx, pod: Pod) -> None:
    nginx.start(nginx.config(stable=(pod.address,), max_connections=2))
    pod.hold()
    held = [
        threading.Thread(target=call, args=(nginx.port, "/v1/models", {"X-Session-ID": f"s{i}"}))
        for i in range(2)
    ]
    for t in held:
        t.start()
    wait_for(
        "two requests at the pod", lambda: pod.arrived == 2 or None, 10, nginx.workdir / "error.log"
    )
    over = call(nginx.port, "/v1/models", {"X-Session-ID": "third"})
    assert over is not None and over.status_code == 503
    assert over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "overloaded"
    assert pod.arrived == 2  # the third never reached the pod
    pod.release()
    for t in held:
        t.join(10)
    again = call(nginx.port, "/v1/models", {"X-Session-ID": "later"})
    assert again is not None and again.status_code == 200


def test_a_client_that_stops_sending_its_body_is_cut_off(nginx: Nginx, pod: Pod) -> None:
    nginx.start(nginx.config(stable=(pod.address,), client_body_timeout_s=1))
    with socket.create_connection(("127.0.0.1", nginx.port), timeout=30) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            b'{"messages": ['
        )
        began = time.monotonic()
        answer = b""
        # Until NGINX closes (reset_timedout_connection: a reset, no 408 to a slow client).
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(4096):
                answer += chunk
        waited = time.monotonic() - began
    # A generous bound on a shared machine; NGINX's default body timeout is 60 s.
    assert waited < 20, waited
    assert answer == b"" or b" 408 " in answer.split(b"\r\n", 1)[0], answer[:200]
    assert pod.arrived == 0
