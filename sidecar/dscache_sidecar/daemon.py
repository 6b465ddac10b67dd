"""The sidecar daemon: the ``dscache.v1.KVCache`` gRPC service over the store.

Contract:
    * Listens on a unix socket (mode 0600) and optionally on loopback TCP; serves
      the standard ``grpc.health.v1`` service next to ``dscache.v1.KVCache``.
    * A miss is a normal response. Malformed input is INVALID_ARGUMENT; a store
      that cannot make room is RESOURCE_EXHAUSTED. No request can stop the daemon:
      unexpected errors become INTERNAL and are logged.
    * One daemon per data directory: the store's lock
      (:mod:`dscache_sidecar.dirlock`) is taken before anything is opened; when
      another holds it, ``dscache sidecar`` logs one line naming the holder and
      exits with ``EXIT_DATA_DIR_LOCKED`` (3), having changed nothing (not even
      the socket). Invalid settings exit with 2.
    * SIGTERM first serves on while clients are connected to the unix socket
      (at most ``drain_max_s``; :mod:`dscache_sidecar.drain`), so a model server
      stopping beside it in the same pod finishes its last stores; /readyz says
      503 ``draining`` meanwhile. Then (and at once on SIGINT or a second SIGTERM)
      it stops gracefully: in-flight calls finish (up to a grace period), the index
      gets its last access statistics, files are closed.
    * Metrics are served over HTTP at ``/metrics`` (prometheus_client), and the
      health service's verdict at ``/healthz`` and ``/readyz`` on the same port
      (:mod:`dscache_sidecar.probes`), for kubelet HTTP probes.
    * With ``shared_nodes`` set, a shared tier on that Redis Cluster sits behind
      the store (:mod:`dscache_sidecar.shared`); a cluster that is down at start
      is not an error (the tier is tried on use, and skipped while it fails).
    * With ``holdings_refresh_s`` > 0 and the HTTP port on, the same port serves
      ``/dscache/holdings``: a Bloom filter of every key in the index, rebuilt in
      the background (:mod:`dscache_sidecar.holdings_publisher`), to requests that
      carry ``internal_token`` when one is set.
    * With ``fault_injection`` on (a testing aid, never in production), the same
      port serves ``/debug/fault`` and every KVCache call first waits the injected
      delay (:mod:`dscache_sidecar.faults`); off, nothing of it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dscache.v1 import kvcache_pb2_grpc as pb_grpc
from dscache_sidecar.blockstore import BlockStore, StoreFullError
from dscache_sidecar.config import SidecarSettings, settings_from_args
from dscache_sidecar.drain import connected_clients, serve_on
from dscache_sidecar.errors import DataDirLockedError
from dscache_sidecar.faults import FaultInjector
from dscache_sidecar.holdings_publisher import HoldingsPublisher
from dscache_sidecar.kvevents import KVEventPublisher
from dscache_sidecar.metrics import SidecarMetrics
from dscache_sidecar.probes import ProbeServer, SocketHealthCheck, make_app, servicer_status
from dscache_sidecar.redistier import RedisClusterTier
from dscache_sidecar.service import BadRequestError, KVCacheService, UnimplementedError
from dscache_sidecar.shared import SharedTier
from dscache_sidecar.store import KVStore

log = logging.getLogger(__name__)

SERVICE_NAME = "dscache.v1.KVCache"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Exit status of ``dscache sidecar`` when its settings are invalid.
EXIT_BAD_SETTINGS = 2
#: Exit status when another daemon holds the data directory's lock.
EXIT_DATA_DIR_LOCKED = 3


class _DeadlinePassedError(Exception):
    """A call's deadline passed while an injected fault delayed it."""


def _status_for(op: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call ends with; unexpected errors are logged."""
    if isinstance(exc, BadRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, StoreFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, UnimplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc)
    if isinstance(exc, _DeadlinePassedError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    rid = uuid.uuid4().hex[:12]
    log.error("%s failed (request %s)", op, rid, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (request {rid})"


class _ErrorsAndMetrics(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Times every call, maps store errors to status codes, tags a request id;
    with ``faults``, delays every KVCache call by the injected ``delay_s``."""

    def __init__(self, metrics: SidecarMetrics, faults: FaultInjector | None = None) -> None:
        self.metrics = metrics
        self.faults = faults

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        op = handler_call_details.method.rsplit("/", 1)[-1]
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        metrics = self.metrics
        faults = self.faults

        def delay(context: grpc.ServicerContext) -> None:
            if faults is not None and not faults.delay(context.time_remaining()):
                raise _DeadlinePassedError("the deadline passed during an injected delay")

        # Requests are parsed here, not by grpc: a message that does not parse (bad
        # wire format, invalid UTF-8 in a string) is the client's fault and must be
        # INVALID_ARGUMENT, but grpc answers its own parse failures with INTERNAL
        # (test_fuzz.py).
        deserialize = handler.request_deserializer

        def parse(raw: Any) -> Any:
            if deserialize is None:
                return raw
            try:
                return deserialize(raw)
            except Exception as exc:
                raise BadRequestError(f"malformed request message: {exc}") from exc

        def wrap(fn: Callable[..., Any], streaming_response: bool) -> Callable[..., Any]:
            def fail(context: grpc.ServicerContext, exc: BaseException) -> None:
                code, msg = _status_for(op, exc)
                metrics.rpc_errors.labels(op=op, code=code.name).inc()
                context.abort(code, msg)

            if streaming_response:

                def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                    start = time.perf_counter()
                    try:
                        delay(context)
                        yield from fn(parse(request), context)
                    except Exception as exc:
                        fail(context, exc)
                    finally:
                        metrics.rpc_latency.labels(op=op).observe(time.perf_counter() - start)

                return stream

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                start = time.perf_counter()
                try:
                    delay(context)
                    if handler.stream_unary is not None:
                        return fn((parse(r) for r in request), context)
                    return fn(parse(request), context)
                except Exception as exc:
                    fail(context, exc)
                    return None
                finally:
                    metrics.rpc_latency.labels(op=op).observe(time.perf_counter() - start)

            return unary

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                wrap(handler.unary_unary, False),
                None,
                handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                wrap(handler.stream_unary, False),
                None,
                handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                wrap(handler.unary_stream, True),
                None,
                handler.response_serializer,
            )
        return handler


@dataclass
class RunningSidecar:
    """A started daemon: its server, store, and where it listens."""

    server: grpc.Server
    store: BlockStore
    metrics: SidecarMetrics
    health: health.HealthServicer
    socket_path: str
    tcp_port: int | None
    metrics_port: int | None
    http: ProbeServer | None = None
    socket_check: SocketHealthCheck | None = None
    faults: FaultInjector | None = None
    shared: SharedTier | None = None
    holdings: HoldingsPublisher | None = None
    kv_events: KVEventPublisher | None = None

    def drain(self, max_s: float, stop_now: threading.Event) -> str:
        """Serves on while clients are connected to the unix socket, at most
        ``max_s`` or until ``stop_now``; returns why it ended (see
        :func:`~dscache_sidecar.drain.serve_on`). /readyz answers 503 meanwhile
        (and its own channel to the socket is closed, so it is not counted)."""
        if self.socket_check is not None:
            self.socket_check.close(draining=True)
        before, start = self._calls(), time.monotonic()
        why = serve_on(lambda: connected_clients(self.socket_path), max_s, stop_now)
        after = self._calls()
        served = {op: n - before.get(op, 0) for op, n in after.items() if n > before.get(op, 0)}
        log.info(
            "drained (%s) after %.1fs; calls served meanwhile: %s",
            why,
            time.monotonic() - start,
            ", ".join(f"{op} {n:.0f}" for op, n in sorted(served.items())) or "none",
        )
        return why

    def _calls(self) -> dict[str, float]:
        """Calls answered so far, per operation (the latency histogram's counts)."""
        return {
            sample.labels["op"]: sample.value
            for family in self.metrics.rpc_latency.collect()
            for sample in family.samples
            if sample.name.endswith("_count")
        }

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops serving (in-flight calls get ``grace_s``), then closes the store."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        if self.holdings is not None:
            self.holdings.stop()  # it reads the index: before the store closes
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.shared is not None:
            self.shared.close()
        self.store.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        if self.socket_check is not None:
            self.socket_check.close()
        if self.http is not None:
            self.http.close()


def create_server(
    settings: SidecarSettings, metrics: SidecarMetrics | None = None
) -> RunningSidecar:
    """Opens the store and starts serving; ``tcp`` port 0 binds a free port.

    The one place that builds the concrete store; the service sees a ``BlockStore``.
    """
    metrics = metrics if metrics is not None else SidecarMetrics()
    faults = FaultInjector() if settings.fault_injection else None
    if faults is not None:
        log.warning("fault injection is ON (/debug/fault): a testing aid, never for production")
    store = KVStore(settings, metrics, faults=faults)
    store.open()
    shared = _shared_tier(settings, store, metrics)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_workers, thread_name_prefix="kv-rpc"),
        interceptors=[_ErrorsAndMetrics(metrics, faults)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_KVCacheServicer_to_server(KVCacheService(store, settings, metrics, shared), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    sock = str(settings.socket_path)
    os.makedirs(os.path.dirname(sock) or ".", exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    old_umask = os.umask(0o177)  # the socket is created 0600
    try:
        server.add_insecure_port(f"unix:{sock}")
    finally:
        os.umask(old_umask)
    tcp_port: int | None = None
    if settings.tcp is not None:
        tcp_port = server.add_insecure_port(settings.tcp)
    server.start()
    os.chmod(sock, 0o600)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics_port: int | None = None
    http: ProbeServer | None = None
    socket_check: SocketHealthCheck | None = None
    holdings: HoldingsPublisher | None = None
    if settings.metrics_port is not None:
        socket_check = SocketHealthCheck(sock, SERVICE_NAME, timeout_s=settings.readyz_timeout_s)
        if settings.holdings_refresh_s > 0:
            holdings = HoldingsPublisher(store, settings.holdings_refresh_s, metrics)
        app = make_app(
            metrics.registry,
            live=lambda: servicer_status(health_servicer, SERVICE_NAME),
            ready=socket_check,
            faults=faults,
            holdings=holdings.current if holdings is not None else None,
            internal_token=settings.internal_token.get_secret_value(),
        )
        http = ProbeServer(settings.metrics_host, settings.metrics_port, app)
        metrics_port = http.port
        if holdings is not None and not settings.internal_token.get_secret_value():
            log.warning(
                "/dscache/holdings is served without a token (no "
                "DSCACHE_SIDECAR_INTERNAL_TOKEN): whoever reaches port %s can test "
                "which block keys this pod holds",
                metrics_port,
            )
        if holdings is not None:
            holdings.start()
    kv_events = _kv_events(settings, store, metrics)
    log.info(
        "sidecar serving on unix:%s%s, metrics on %s",
        sock,
        f" and {settings.tcp} (port {tcp_port})" if tcp_port else "",
        f"{settings.metrics_host}:{metrics_port}" if metrics_port else "off",
    )
    return RunningSidecar(
        server,
        store,
        metrics,
        health_servicer,
        sock,
        tcp_port,
        metrics_port,
        http,
        socket_check,
        faults,
        shared,
        holdings,
        kv_events,
    )


def _kv_events(
    settings: SidecarSettings, store: KVStore, metrics: SidecarMetrics
) -> KVEventPublisher | None:
    """The KV event publisher, started, where an endpoint is set."""
    if not settings.kv_events_endpoint:
        return None
    token = settings.internal_token.get_secret_value()
    publisher = KVEventPublisher(
        store,
        settings.kv_events_endpoint,
        settings.kv_events_replay_endpoint,
        metrics,
        topic=settings.kv_events_topic,
        medium=settings.kv_events_medium,
        token=token,
        open_to_all=settings.kv_events_open,
        buffer_batches=settings.kv_events_buffer_batches,
        batch_s=settings.kv_events_batch_s,
    )
    publisher.start()
    if not token or settings.kv_events_open:
        log.warning(
            "KV events on %s are served without authentication: whoever reaches it "
            "learns which block keys this node holds",
            publisher.endpoint,
        )
    log.info("KV events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint or "off")
    return publisher


def _shared_tier(
    settings: SidecarSettings, store: KVStore, metrics: SidecarMetrics
) -> SharedTier | None:
    """The shared tier behind ``store`` when ``shared_nodes`` is set, started."""
    nodes = settings.shared_node_list
    if not nodes:
        return None
    tier = RedisClusterTier(
        nodes,
        timeout_s=settings.shared_timeout_s,
        username=settings.shared_username,
        password=settings.shared_password.get_secret_value(),
        tls=settings.shared_tls_on,
        ca_file=settings.shared_tls_ca_file,
        verify_hostname=settings.shared_tls_verify_hostname,
    )
    shared = SharedTier(tier, store, settings, metrics)
    store.set_events(shared)
    shared.start()
    log.info(
        "shared tier: Redis Cluster at %s (%s), names %s:*, %s values, write policy %s",
        ",".join(nodes),
        "TLS" if settings.shared_tls_on else "plain TCP",
        settings.shared_key_prefix,
        "signed" if shared.format.signed else "unsigned",
        settings.shared_write_policy,
    )
    if not shared.format.signed:
        log.warning(
            "the shared tier's values are not signed (no DSCACHE_SIDECAR_SHARED_SIGNING_KEY): "
            "anyone who can write to the cluster can forge a block this pod will load"
        )
    if not settings.shared_tls_on:
        log.warning("the shared tier is spoken to in plain TCP: blocks cross the network readable")
    return shared


def run_from_args(args: argparse.Namespace) -> int:
    """``dscache sidecar``: serve until SIGTERM or SIGINT."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        log.error("invalid sidecar settings: %s", exc)
        return EXIT_BAD_SETTINGS
    try:
        running = create_server(settings)
    except DataDirLockedError as exc:
        log.error("%s", exc)
        return EXIT_DATA_DIR_LOCKED
    print(
        f"dscache sidecar ready: socket={running.socket_path} "
        f"metrics_port={running.metrics_port} tcp_port={running.tcp_port}",
        flush=True,
    )
    done = threading.Event()
    stop_now = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        if done.is_set():
            stop_now.set()  # a second signal: stop now
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    if got[0] == signal.SIGTERM and settings.drain_max_s > 0:
        log.info(
            "SIGTERM: serving on while clients stay connected (at most %.0fs)", settings.drain_max_s
        )
        running.drain(settings.drain_max_s, stop_now)
    else:
        log.info("signal %d: stopping", got[0])
    running.stop()
    log.info("sidecar stopped")
    return 0
