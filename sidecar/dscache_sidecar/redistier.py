"""The shared tier's engine: a Redis Cluster (or Valkey in cluster mode), via ``redis``.

Contract:
    * :class:`RedisClusterTier` is a :class:`~dscache_sidecar.remote.RemoteTier`.
      It connects when asked (``connect``: the slot map and a socket to every
      node) or else on the first call; a cluster that is down when the sidecar
      starts is an error of that call, not of the start. A read made while
      another call is connecting fails at once with
      :class:`~dscache_sidecar.remote.RemoteTierConnectingError` (a miss to the
      sidecar, not a failure) instead of waiting behind it; a write (the
      sidecar's writer thread) waits for that connect. It pipelines every batch
      (redis-py groups the commands by node: one round trip per node) and never
      retries: the caller decides what a failure costs.
    * Every socket operation is bounded by ``timeout_s``; a failure of any kind is
      a :class:`~dscache_sidecar.remote.RemoteTierError`, after which the client is
      dropped and rebuilt on the next call (it re-reads the slot map).
    * Reads renew a value's TTL (``GETEX``), so blocks that are read stay.

Thread safety: every method may be called from any thread (redis-py's cluster
client keeps a connection pool per node; pipelines are per call).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from dscache_sidecar.remote import RemoteTierConnectingError, RemoteTierError

log = logging.getLogger(__name__)

__all__ = ["RedisClusterTier"]


def _kind(exc: BaseException) -> str:
    if isinstance(exc, (RedisTimeoutError, socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, (ConnectionError, OSError)) or "connect" in type(exc).__name__.lower():
        return "connection"
    return "other"


def _error(exc: BaseException) -> RemoteTierError:
    """What any failure of redis-py (or of the socket under it) becomes."""
    return RemoteTierError(_kind(exc), f"{type(exc).__name__}: {exc}")


class RedisClusterTier:
    """A Redis Cluster as the shared tier's engine.

    Args:
        nodes: startup nodes, ``host:port`` each; the rest are discovered.
        timeout_s: bound of each socket connect, read and write.
        username, password: ACL user and password ("" = none).
        tls: speak TLS; ``ca_file`` (None = system CAs) and ``verify_hostname``.
    """

    engine = "redis-cluster"

    def __init__(
        self,
        nodes: Sequence[str],
        *,
        timeout_s: float = 0.25,
        username: str = "",
        password: str = "",
        tls: bool = False,
        ca_file: Path | None = None,
        verify_hostname: bool = True,
    ) -> None:
        if not nodes:
            raise ValueError("a Redis Cluster tier needs at least one startup node")
        self._nodes = [
            ClusterNode(h, int(p))  # type: ignore[no-untyped-call]
            for h, _, p in (n.rpartition(":") for n in nodes)
        ]
        self._kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "username": username or None,
            "password": password or None,
        }
        if tls:
            self._kwargs.update(
                ssl=True,
                ssl_ca_certs=str(ca_file) if ca_file else None,
                ssl_check_hostname=verify_hostname,
            )
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()  # guards _client; held only to swap it
        self._connecting = threading.Lock()  # held while a client is being built

    def _connected(self, wait: bool = False) -> RedisCluster:
        """The client, built here when there is none and no other call is building
        one. While another call is, this one fails at once (a read: its request is
        waiting, and on a frozen cluster a connect takes seconds per node), or with
        ``wait`` (the background writer) waits for that connect and uses its client,
        failing when it failed (never a second connect in a row)."""
        client = self._client
        if client is not None:
            return client
        if not self._connecting.acquire(blocking=False):
            if not wait:
                raise RemoteTierConnectingError()
            with self._connecting:
                client = self._client
            if client is None:
                raise RemoteTierError("connection", "the connect under way failed")
            return client
        try:
            client = self._client
            if client is None:
                try:
                    client = RedisCluster(
                        startup_nodes=list(self._nodes),
                        retry=Retry(NoBackoff(), 0),
                        require_full_coverage=True,
                        **self._kwargs,
                    )
                except Exception as exc:
                    raise _error(exc) from exc
                with self._lock:
                    self._client = client
            return client
        finally:
            self._connecting.release()

    def _reset(self, failed: RedisCluster | None) -> None:
        """Drops ``failed`` (None: whichever client there is) if it is still the
        client: the next call builds a new one and re-reads the slot map."""
        with self._lock:
            if self._client is None or (failed is not None and self._client is not failed):
                return
            client, self._client = self._client, None
        try:
            client.close()
        except Exception as exc:  # closing a broken client must not raise
            log.debug("closing the Redis Cluster client failed: %s", exc)

    def _pipeline(self, build: Any, wait: bool = False) -> list[Any]:
        """Runs ``build(pipe)`` then the pipeline; any failure is RemoteTierError.
        ``wait``: see :meth:`_connected`."""
        client = self._connected(wait)
        try:
            pipe = client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
            build(pipe)
            results: list[Any] = pipe.execute(raise_on_error=True)
        except Exception as exc:  # redis-py raises more than RedisError on a broken socket
            self._reset(client)
            raise _error(exc) from exc
        return results

    def connect(self) -> None:
        client = self._connected()
        try:
            client.ping(target_nodes=RedisCluster.ALL_NODES)
        except Exception as exc:
            self._reset(client)
            raise _error(exc) from exc

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []

        def build(pipe: Any) -> None:
            for name in names:
                pipe.exists(name)

        return [bool(n) for n in self._pipeline(build)]

    def get(self, names: Sequence[str], ttl_s: int) -> list[bytes | None]:
        if not names:
            return []

        def build(pipe: Any) -> None:
            for name in names:
                pipe.getex(name, ex=ttl_s)

        return [bytes(v) if v is not None else None for v in self._pipeline(build)]

    def put(self, items: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        if not items:
            return

        def build(pipe: Any) -> None:
            for name, value in items:
                pipe.set(name, value, ex=ttl_s)

        self._pipeline(build, wait=True)  # the writer's thread: no request waits

    def delete(self, names: Sequence[str]) -> None:
        if not names:
            return

        def build(pipe: Any) -> None:
            for name in names:
                pipe.delete(name)

        self._pipeline(build)

    def close(self) -> None:
        self._reset(None)
