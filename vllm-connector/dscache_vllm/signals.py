"""Serving-path signals for the sidecar's eviction policy, from vLLM.

A client says whether a conversation goes on (``X-Dscache-Next-Turn: ended`` or
``expected``, as to the reference server); :mod:`dscache_vllm.ledger` carries the
header's value into the request as ``kv_transfer_params[NEXT_TURN_PARAM]``, and
the scheduler-side connector, when vLLM finishes the request, hands the blocks it
stored for it to :class:`DelayedSignals`.

Contract:
    * :meth:`DelayedSignals.send` never blocks and never raises: the signal goes on
      a bounded queue (a full one drops it, counted as a failure) and a daemon
      thread sends it ``delay_s`` after the request finished (the worker process
      is still writing the request's last blocks then; a signal marks only stored
      blocks), through the sidecar's ``Signal`` RPC.
    * Each signal sent is counted in ``dscache_vllm_signals_total{kind}``; one that
      failed or was dropped in ``dscache_vllm_signal_failures_total``. A sidecar
      without the RPC or without a policy that takes signals simply marks nothing.
    * :meth:`close` stops the thread once the signals already queued are sent
      (waiting 5 s at most); later ones are ignored.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from dscache_vllm.metrics import ConnectorMetrics

log = logging.getLogger("dscache_vllm.signals")

#: The key of ``kv_transfer_params`` that carries a request's next-turn signal.
NEXT_TURN_PARAM = "dscache_next_turn"
#: The signals a client may send about its conversation's next turn.
NEXT_TURNS = ("ended", "expected")


class Signalling(Protocol):
    """The part of the sidecar client the signals need."""

    def signal(self, tenant: str, keys: Sequence[bytes], kind: str, ttl_ms: int = 0) -> int: ...


_Item = tuple[float, str, list[bytes], str]


class DelayedSignals:
    """Sends signals off vLLM's scheduling loop, a moment after their request ended."""

    def __init__(
        self,
        client: Signalling,
        metrics: ConnectorMetrics,
        *,
        delay_s: float = 1.0,
        max_pending: int = 4096,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._delay_s = delay_s
        self._queue: queue.Queue[_Item | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def send(self, tenant: str, keys: Sequence[bytes], kind: str) -> None:
        """Queues ``kind`` for ``keys`` of ``tenant`` (see the module contract)."""
        if not keys or self._closed:
            return
        self._start()
        try:
            self._queue.put_nowait((time.monotonic() + self._delay_s, tenant, list(keys), kind))
        except queue.Full:
            self._metrics.signal_failed()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dscache-signals", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            due, tenant, keys, kind = item
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                self._client.signal(tenant, keys, kind)
            except Exception as exc:  # best effort: the policy works without signals
                log.debug("dscache signal %s failed: %s", kind, exc)
                self._metrics.signal_failed()
            else:
                self._metrics.signalled(kind)

    def close(self) -> None:
        """Stops the sending thread after what is queued (see the module contract)."""
        self._closed = True
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        while True:  # make room for the stop mark
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
        thread.join(timeout=5.0)
