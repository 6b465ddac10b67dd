"""The operator's Prometheus reads are bounded and reveal no body (issue 30, finding 4).

Real HTTP servers on loopback: one drips bytes forever (a per-read timeout never
fires), one answers with a secret-looking body, one answers with more than the
cap; and a resource naming a URL the admin did not allow is never fetched.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from dscache_operator.analysis import PrometheusError, Step, analyse
from dscache_operator.desired import Owner
from dscache_operator.kube import Kube
from dscache_operator.metrics import OperatorMetrics
from dscache_operator.prometheus import PrometheusClient
from dscache_operator.reconcile import Reconciler
from dscache_operator.settings import OperatorSettings
from dscache_operator.spec import AnalysisSpec, parse_spec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

SECRET = "AKIAIOSFODNN7EXAMPLE-aws-secret-wJalrXUtnFEMI"
STEP = Step("n", canary="b", stable="a", window_s=5, since_step_s=5)

Handler = Callable[[socket.socket], None]


class TinyServer:
    """A loopback TCP server running ``handler`` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.handler = handler
        self.connections = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        # OSError: the client gave up, which is what these tests want.
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)  # the request
            self.handler(conn)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()  # the accept loop ends on the closed socket


def _answer(status: str, body: bytes, ctype: str = "application/json") -> Handler:
    def handle(conn: socket.socket) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        conn.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)

    return handle


def _drip(conn: socket.socket) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    for _ in range(600):  # one byte every 0.1 s, for a minute at most
        conn.sendall(b" ")
        time.sleep(0.1)


@pytest.fixture
def server() -> Iterator[Callable[[Handler], TinyServer]]:
    made: list[TinyServer] = []

    def make(handler: Handler) -> TinyServer:
        made.append(TinyServer(handler))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.mark.slow
def test_a_server_that_drips_bytes_is_cut_off_at_the_total_timeout(
    server: Callable[[Handler], TinyServer],
) -> None:
    drip = server(_drip)
    client = PrometheusClient(drip.url, timeout_s=1.0)
    began = time.monotonic()
    with pytest.raises(PrometheusError, match="no whole answer within 1s"):
        client.scalar("up")
    # Generous bound on a shared machine; a per-read timeout would wait the whole minute.
    assert time.monotonic() - began < 10
    # One analysis (six queries) shares one budget: it ends once, not six times over.
    budgeted = PrometheusClient(drip.url, timeout_s=1.0, budget_s=1.5)
    began = time.monotonic()
    verdict = analyse(budgeted, AnalysisSpec(), STEP)
    assert verdict.result == "NoData"
    assert time.monotonic() - began < 10


def test_a_body_never_reaches_the_verdict_condition_or_event(
    server: Callable[[Handler], TinyServer],
) -> None:
    error = f'{{"status":"error","errorType":"bad_data","error":"{SECRET}"}}'.encode()
    cases = [
        _answer("400 Bad Request", error),
        _answer("200 OK", f'{{"status":"error","errorType":"{SECRET}"}}'.encode()),
        _answer("401 Unauthorized", f"<html>token {SECRET}</html>".encode(), "text/html"),
        _answer("200 OK", SECRET.encode(), "text/plain"),
    ]
    for handler in cases:
        srv = server(handler)
        verdict = analyse(PrometheusClient(srv.url, timeout_s=5), AnalysisSpec(), STEP)
        assert verdict.result == "NoData"
        assert SECRET not in verdict.message and "wJalr" not in verdict.message
        assert srv.url in verdict.message  # it still says which Prometheus failed
    assert (
        "error type bad_data"
        in analyse(
            PrometheusClient(server(cases[0]).url, timeout_s=5), AnalysisSpec(), STEP
        ).message
    )


def test_an_answer_over_the_cap_is_not_read(server: Callable[[Handler], TinyServer]) -> None:
    big = b'{"status":"success","data":{"result":[],"pad":"' + b"x" * (2 << 20) + b'"}}'
    srv = server(_answer("200 OK", big))
    with pytest.raises(PrometheusError, match="larger than 65536 bytes"):
        PrometheusClient(srv.url, timeout_s=5, max_body_bytes=65536).scalar("up")
    ok = server(_answer("200 OK", b'{"status":"success","data":{"result":[{"value":[0,"0.5"]}]}}'))
    assert PrometheusClient(ok.url, timeout_s=5, max_body_bytes=65536).scalar("up") == 0.5


@pytest.mark.slow
def test_a_url_the_admin_did_not_allow_is_never_fetched(
    server: Callable[[Handler], TinyServer],
) -> None:
    allowed = server(_answer("200 OK", b'{"status":"success","data":{"result":[]}}'))
    other = server(_answer("200 OK", b'{"status":"success","data":{"result":[]}}'))
    settings = OperatorSettings(prometheus_url=allowed.url + "/")
    r = Reconciler(Kube.__new__(Kube), settings, OperatorMetrics())
    owner = Owner("chat", "n", "u1")
    status = DeepSeekCacheDeploymentStatus(canary_revision="b", stable_revision="a")
    now = datetime.now(UTC)

    def spec(url: str | None) -> object:
        analysis = {"prometheusUrl": url} if url else {}
        return parse_spec({"model": {"preset": "m"}, "rollout": {"analysis": analysis}})

    refused = r._analyse(owner, spec(other.url), status, now)  # type: ignore[arg-type]
    assert refused.result == "NoData" and "not a Prometheus the admin allows" in refused.message
    assert other.connections == 0
    # The operator's own URL (and the allow-list) are fetched.
    r._analyse(owner, spec(None), status, now)  # type: ignore[arg-type]
    r._analyse(owner, spec(allowed.url), status, now)  # type: ignore[arg-type]
    assert allowed.connections >= 2
    listed = OperatorSettings(prometheus_urls=f"{other.url},http://x:9090")  # type: ignore[arg-type]
    r2 = Reconciler(Kube.__new__(Kube), listed, OperatorMetrics())
    r2._analyse(owner, spec(other.url), status, now)  # type: ignore[arg-type]
    assert other.connections >= 1
