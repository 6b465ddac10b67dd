"""The client's gRPC connection to the daemon: one channel, its stubs, one ready check.

Contract:
    * Every gRPC failure of a call surfaces as ``SidecarError`` (or a subclass)
      through :func:`call`; callers treat it as a miss and recompute.
    * :meth:`Connection.ready` connects once with one health check under a longer
      deadline; a daemon that is down fails at once (the socket refuses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dscache.v1 import kvcache_pb2_grpc as pb_grpc
from dscache_sidecar.errors import wrap_rpc_error

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
]


def call(method: Callable[..., Any], request: Any, timeout_s: float) -> Any:
    """One unary (or client-streaming) RPC; gRPC failures become ``SidecarError``."""
    try:
        return method(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        raise wrap_rpc_error(exc) from exc


class Connection:
    """The channel to the daemon and its two stubs (KVCache, health).

    Args:
        target: a gRPC target (``unix:/path`` or ``host:port``).
        timeout_s: the deadline of short calls (lookups, leases, releases).
    """

    def __init__(self, target: str, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        #: Deadline of writes and of leases that may fetch from the shared tier.
        self.long_timeout_s = timeout_s * 20
        self._channel = grpc.insecure_channel(target, options=_OPTIONS)
        self.stub = pb_grpc.KVCacheStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._connected = False

    def ready(self) -> None:
        """Connects with one health check under a longer deadline, once.

        Connection setup is not a lookup's cost: without this, the first call of a
        new client spends its whole (short) deadline connecting on a busy machine.
        No connectivity subscription: its polling thread outlives ``close()``.
        """
        if self._connected:
            return
        try:
            self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=max(2.0, 4 * self.timeout_s)
            )
        except grpc.RpcError as exc:
            raise wrap_rpc_error(exc) from exc
        self._connected = True

    def healthy(self) -> bool:
        """True when the daemon answers its health check as SERVING."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        self._channel.close()
