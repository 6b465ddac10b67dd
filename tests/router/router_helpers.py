"""What the router tests share: loopback upstream pods, one HTTP call, NGINX's life.

* :class:`Pod`: a loopback HTTP server standing in for a model pod (a test
  double, typed and small); it answers every GET or POST with JSON naming
  itself, the session header and the route key it got, and keeps every
  request's headers. ``.../missing`` answers 404. ``hold()`` makes it keep
  requests open until ``release()``, so a test can build up in-flight load.
* :class:`Nginx`: real NGINX on a loopback port running a rendered
  :class:`RouterConfig`, restarted on each new config.
* :func:`scrape`: the router's ``/dscache/router/metrics``, parsed.
* :func:`call`: one request to the router on loopback; the response, or None
  while nothing answers.
* :func:`wait_for`: polls (tenacity, via the dev cluster's ``wait_until``) and
  fails with the router's log when time runs out.
* :func:`stop`: ends a process, killing it when it does not stop in time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Callable
from http.cookiejar import CookieJar, DefaultCookiePolicy
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
from dscache_router.nginx import DEBIAN_LUA_MODULES, RouterConfig, render_nginx_conf
from dscache_tools.devcluster import wait_until
from dscache_tools.net import free_port
from prometheus_client.parser import text_string_to_metric_families

from dscache import metricnames as names
from dscache.routing import INFLIGHT_HEADER

T = TypeVar("T")


class Pod(ThreadingHTTPServer):
    """A stand-in model pod on a loopback port; ``seen`` lists the session ids it got;
    ``reported`` (when set) is the in-flight count it reports, as a model server does
    on every answer (``X-Dscache-Inflight``)."""

    def __init__(self, name: str) -> None:
        seen: list[str] = []
        headers: list[dict[str, str]] = []
        self.arrived = 0
        self.reported: int | None = None
        self._open = threading.Event()
        self._open.set()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                sid = self.headers.get("X-Session-ID", "")
                seen.append(sid)
                headers.append({k.lower(): v for k, v in self.headers.items()})
                with pod.lock:
                    pod.arrived += 1
                pod._open.wait(30)
                answer = {"pod": name, "sid": sid, "route": self.headers.get("X-Dscache-Route-Key")}
                body = json.dumps(answer).encode()
                self.send_response(404 if self.path.endswith("/missing") else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if pod.reported is not None:
                    self.send_header(INFLIGHT_HEADER, str(pod.reported))
                self.end_headers()
                self.wfile.write(body)

            do_GET = _answer  # noqa: N815 - the stdlib's handler names
            do_POST = _answer  # noqa: N815

            def log_message(self, format: str, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.name = name
        self.seen = seen
        self.headers = headers
        self.address = f"127.0.0.1:{self.server_address[1]}"
        # A short poll: shutdown() waits for the loop to look, and every test closes five.
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()

    def hold(self) -> None:
        """Requests from now on wait (at most 30 s) until :meth:`release`."""
        self._open.clear()

    def release(self) -> None:
        """Lets every waiting request answer."""
        self._open.set()

    def close(self) -> None:
        self.release()
        self.shutdown()
        self.server_close()


#: One client for every call: building an httpx client per request (``httpx.request``)
#: costs 10-20 times the request itself on a busy machine (it loads the CA bundle).
#: No keep-alive: each call is its own connection, as each test's NGINX may be new;
#: no cookie jar: a cookie is sent only where a test sends it, as with httpx.request.
_CLIENT = httpx.Client(
    timeout=10,
    limits=httpx.Limits(max_keepalive_connections=0),
    cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
)


def call(
    port: int,
    path: str,
    headers: dict[str, str] | None = None,
    *,
    method: str = "GET",
    body: bytes | None = None,
) -> httpx.Response | None:
    """``method path`` on ``127.0.0.1:port``; None while nothing answers."""
    try:
        return _CLIENT.request(
            method, f"http://127.0.0.1:{port}{path}", headers=headers, content=body
        )
    except httpx.TransportError:
        return None


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, log: Path) -> T:
    """``probe``'s first truthy answer within ``timeout`` seconds; else fails with ``log``."""
    try:
        return wait_until(what, probe, timeout, 0.05)
    except TimeoutError as exc:
        text = log.read_text()[-3000:] if log.exists() else ""
        raise AssertionError(f"{exc}\n{text}") from exc


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM) -> None:
    """Sends ``sig`` and waits; SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Nginx:
    """Real NGINX on a loopback port, reconfigured by restarting it on a new config."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self, **kwargs: object) -> RouterConfig:
        return RouterConfig.model_validate(
            {
                "listen": f"127.0.0.1:{self.port}",
                "load_modules": DEBIAN_LUA_MODULES,
                "pid_file": str(self.workdir / "nginx.pid"),
                "temp_dir": str(self.workdir),
                "error_log": str(self.workdir / "error.log"),
                "debug_headers": True,
                **kwargs,
            }
        )

    def write(self, cfg: RouterConfig) -> Path:
        path = self.workdir / "nginx.conf"
        path.write_text(render_nginx_conf(cfg))
        return path

    def check(self, cfg: RouterConfig) -> subprocess.CompletedProcess[str]:
        path = self.write(cfg)
        return subprocess.run(
            [self.binary, "-t", "-q", "-p", str(self.workdir), "-c", str(path), "-e", "stderr"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def start(self, cfg: RouterConfig) -> None:
        """Starts NGINX on ``cfg``. The port came from ``free_port``, so another
        process (a router of a test running beside this one) may have taken it
        since, and answered the health check while NGINX was still retrying its
        bind: then it starts again on a new port."""
        for _attempt in range(3):
            self.stop()
            path = self.write(cfg)
            log = self.workdir / "stderr.log"
            with log.open("wb") as err:
                self.proc = subprocess.Popen(
                    [self.binary, "-p", str(self.workdir), "-c", str(path), "-e", "stderr"]
                    + ["-g", "daemon off;"],
                    stderr=err,
                )
            wait_for("nginx serving", lambda: self.get("/dscache/router/health")[0] == 200, 10, log)
            if b"Address already in use" not in log.read_bytes():
                return
            self.port = free_port()
            cfg = cfg.model_copy(update={"listen": f"127.0.0.1:{self.port}"})
        raise RuntimeError(f"nginx found no free port: {log.read_text(errors='replace')[-500:]}")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
        return self.request("GET", path, None, headers)

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str]]:
        """Status and headers (lowercase), the upstream's JSON answer as ``x-<key>`` headers."""
        resp = call(self.port, path, headers, method=method, body=body)
        if resp is None:
            return 0, {}
        out = {k.lower(): v for k, v in resp.headers.items()}
        if resp.content.startswith(b"{"):
            out.update({"x-" + k: str(v) for k, v in resp.json().items() if v is not None})
        return resp.status_code, out

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGQUIT)  # graceful: workers finish their requests
            self.proc = None


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's metrics: ``{(sample name, sorted labels): value}``."""
    resp = call(port, names.ROUTER_METRICS_PATH)
    assert resp is not None and resp.status_code == 200, resp
    assert resp.headers["content-type"].startswith("text/plain")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], Any], name: str, **labels: str
) -> float:
    """One sample's value (0 when absent)."""
    return float(samples.get((name, tuple(sorted(labels.items()))), 0.0))
