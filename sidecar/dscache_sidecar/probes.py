"""The sidecar's HTTP server: ``/metrics``, ``/healthz``, ``/readyz``, ``/dscache/holdings``.

Kubelet probes are plain HTTP GETs on the metrics port, so a probe spawns no
process (the exec probes they replace started a Python interpreter for every
check, in every pod, every few seconds).

Contract:
    * ``/healthz`` (liveness): what the daemon's ``grpc.health.v1`` service
      reports for ``dscache.v1.KVCache``, asked in-process: ``200 SERVING``, or
      ``503`` with the status name (``NOT_SERVING`` from a graceful stop on).
      No RPC, so a daemon busy with real work is not declared dead.
    * ``/readyz`` (readiness): a real ``Check`` RPC over the daemon's unix
      socket, the path the model server uses, with a deadline
      (``readyz_timeout_s``): ``200 SERVING``, else ``503`` with the status or
      the RPC error. A daemon whose gRPC server stopped answering is not ready,
      nor is one serving its last clients after SIGTERM (``503 draining``).
    * ``/debug/fault`` (``GET``, ``PUT``): the injected faults of
      :mod:`dscache_sidecar.faults` when fault injection is on, else ``404``. A
      body that does not validate is ``400`` with the reason and changes nothing;
      a body over 64 KiB is ``413``; another method is ``405``.
    * ``/dscache/holdings`` (``GET``): the latest holdings filter
      (:mod:`dscache_sidecar.holdings_publisher`), ``200`` with
      ``application/octet-stream`` bytes and the ``X-Dscache-Holdings-Keys`` and
      ``-Generation`` headers; ``503`` before the first build; ``404`` when the
      publisher is off; another method is ``405``. With an internal token
      configured, a request without it (``X-Dscache-Internal-Token``) is ``401``:
      the filter is the pod's held keys, for the router's picker only.
    * Every other path is prometheus_client's WSGI app, exactly what
      ``prometheus_client.start_http_server`` served (content negotiation,
      gzip, ``name[]`` filters).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, make_wsgi_app
from pydantic import ValidationError

from dscache_sidecar.faults import FaultInjector, Faults
from dscache_sidecar.holdings import (
    GENERATION_HEADER,
    HOLDINGS_PATH,
    INTERNAL_TOKEN_HEADER,
    KEYS_HEADER,
    token_matches,
)
from dscache_sidecar.holdings_publisher import Holdings

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

SERVING = "SERVING"
FAULT_PATH = "/debug/fault"
MAX_FAULT_BODY = 64 * 1024


class _Context:
    """The one thing ``HealthServicer.Check`` may do with a context: set NOT_FOUND."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code


def servicer_status(servicer: Any, service: str) -> str:
    """The status ``servicer`` (a ``grpc_health`` HealthServicer) reports for ``service``."""
    context = _Context()
    response = servicer.Check(health_pb2.HealthCheckRequest(service=service), context)
    if context.code is not None:
        return "SERVICE_UNKNOWN"
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


class SocketHealthCheck:
    """``Check`` RPCs over the daemon's unix socket, on one lazily opened channel."""

    def __init__(self, socket_path: str, service: str, timeout_s: float) -> None:
        self.target = f"unix:{socket_path}"
        self.service = service
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._draining = False

    def __call__(self) -> str:
        """The status name, ``ERROR: <code>`` when the RPC failed, or ``draining``
        once the daemon serves only its last clients (no RPC then)."""
        with self._lock:
            if self._draining:
                return "draining"
            if self._channel is None:
                self._channel = grpc.insecure_channel(self.target)
            stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=self.service), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            return f"ERROR: {code.name if code is not None else exc}"
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return name

    def close(self, draining: bool = False) -> None:
        """Closes the channel; with ``draining``, later checks answer ``draining``
        without opening another."""
        with self._lock:
            self._draining = self._draining or draining
            if self._channel is not None:
                self._channel.close()
                self._channel = None


def _respond(
    start_response: StartResponse,
    code: str,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    extra: tuple[tuple[str, str], ...] = (),
) -> Iterable[bytes]:
    headers = [
        ("Content-Type", content_type),
        ("Content-Length", str(len(body))),
        ("Cache-Control", "no-store"),
        *extra,
    ]
    start_response(code, headers)
    return [body]


def _read_body(environ: dict[str, Any]) -> bytes | None:
    """The request body, or None when it is longer than ``MAX_FAULT_BODY``."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > MAX_FAULT_BODY:
        return None
    data: bytes = environ["wsgi.input"].read(length) if length > 0 else b""
    return data


def fault_app(faults: FaultInjector | None) -> WsgiApp:
    """``/debug/fault``: GET shows, PUT replaces the injected faults; 404 when off."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if faults is None:
            return _respond(start_response, "404 Not Found", b"fault injection is off\n")
        method = environ.get("REQUEST_METHOD", "GET")
        if method == "PUT":
            body = _read_body(environ)
            if body is None:
                too_big = f"body over {MAX_FAULT_BODY} bytes\n".encode()
                return _respond(start_response, "413 Content Too Large", too_big)
            try:
                new = Faults.model_validate_json(body or b"null")
            except ValidationError as exc:
                why = f"invalid fault body (want {{delay_s: float >= 0, enospc: bool}}): {exc}\n"
                return _respond(start_response, "400 Bad Request", why.encode())
            faults.set(new)
            log.warning("injected faults now %s", new.model_dump_json())
        elif method != "GET":
            allow = (("Allow", "GET, PUT"),)
            return _respond(start_response, "405 Method Not Allowed", b"GET or PUT\n", extra=allow)
        out = faults.faults.model_dump_json().encode() + b"\n"
        return _respond(start_response, "200 OK", out, "application/json")

    return app


def holdings_app(holdings: Callable[[], Holdings | None] | None, token: str = "") -> WsgiApp:
    """``/dscache/holdings``: GET serves the latest build of ``holdings()`` (304 with no
    body when ``If-None-Match`` names it); 404 when ``holdings`` is None (the
    publisher is off), 503 while it has built nothing; with ``token``, 401 for a
    request that does not carry it as ``X-Dscache-Internal-Token``."""
    token_key = "HTTP_" + INTERNAL_TOKEN_HEADER.upper().replace("-", "_")

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") != "GET":
            allow = (("Allow", "GET"),)
            return _respond(start_response, "405 Method Not Allowed", b"GET\n", extra=allow)
        if token and not token_matches(environ.get(token_key), token):
            why = f"send the internal token as {INTERNAL_TOKEN_HEADER}\n".encode()
            return _respond(start_response, "401 Unauthorized", why)
        if holdings is None:
            return _respond(start_response, "404 Not Found", b"holdings are not published\n")
        built = holdings()
        if built is None:
            not_yet = b"no holdings filter built yet\n"
            return _respond(start_response, "503 Service Unavailable", not_yet)
        extra = (
            (KEYS_HEADER, str(built.keys)),
            (GENERATION_HEADER, str(built.generation)),
            ("ETag", built.etag),
        )
        if built.etag and environ.get("HTTP_IF_NONE_MATCH") == built.etag:
            return _respond(start_response, "304 Not Modified", b"", extra=extra)
        return _respond(start_response, "200 OK", built.body, "application/octet-stream", extra)

    return app


def make_app(
    registry: CollectorRegistry,
    live: Callable[[], str],
    ready: Callable[[], str],
    *,
    faults: FaultInjector | None = None,
    holdings: Callable[[], Holdings | None] | None = None,
    internal_token: str = "",
) -> WsgiApp:
    """The WSGI app: ``/healthz`` from ``live()``, ``/readyz`` from ``ready()``,
    ``/debug/fault`` over ``faults`` (None: fault injection off),
    ``/dscache/holdings`` from ``holdings()`` (None: not published; with
    ``internal_token``, only for requests carrying it), else metrics."""
    metrics = make_wsgi_app(registry)
    debug = fault_app(faults)
    held = holdings_app(holdings, internal_token)
    checks = {"/healthz": live, "/readyz": ready}

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == FAULT_PATH:
            return debug(environ, start_response)
        if path == HOLDINGS_PATH:
            return held(environ, start_response)
        check = checks.get(path)
        if check is None:
            out: Iterable[bytes] = metrics(environ, start_response)
            return out
        status = check()
        code = "200 OK" if status == SERVING else "503 Service Unavailable"
        return _respond(start_response, code, f"{status}\n".encode())

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per probe and scrape is noise


class ProbeServer:
    """The HTTP server of :func:`make_app` on ``host:port`` (port 0: any free one)."""

    def __init__(self, host: str, port: int, app: WsgiApp) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]

        class Server(_ThreadingServer):
            address_family = family

        self.httpd = make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
        self.port = int(self.httpd.server_port)
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="sidecar-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stops serving and frees the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)
