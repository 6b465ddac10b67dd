"""Bounded concurrency with a bounded queue, and per-session ordering.

Contract:
    * At most ``max_concurrency`` requests hold a slot; at most ``max_queue`` more
      wait. A request that would wait beyond that is refused at once with
      ``QueueFullError`` (the API answers 429 with Retry-After), never queued unboundedly.
    * Requests of one session get their slots in arrival order: each session has a
      FIFO lock (asyncio's locks wake waiters in order) taken before the global
      slot, so turn N+1 never overtakes turn N and finds turn N's prefix stored.
      A session is named by :func:`tenant_session`: the client's id within its
      tenant, so a guessed id never queues behind (nor times) another tenant's.
    * A waiter that is cancelled (client gone) leaves the queue without a trace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from dscache_server.metrics import ServerMetrics


def tenant_session(tenant: str, session_id: str | None) -> str | None:
    """The session a request belongs to: its client's session id, within its tenant."""
    if not session_id:
        return None
    return f"{tenant}\x1f{session_id}"


class QueueFullError(Exception):
    """No slot and no room to wait."""


@dataclass
class _SessionLock:
    lock: asyncio.Lock
    users: int = 0


class GenerationSlots:
    """Hands out generation slots; one per event loop."""

    def __init__(self, max_concurrency: int, max_queue: int, metrics: ServerMetrics) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._metrics = metrics
        self._slots = asyncio.Semaphore(max_concurrency)
        self._sessions: dict[str, _SessionLock] = {}
        self.waiting = 0
        self.active = 0

    def _would_wait(self, session_id: str | None) -> bool:
        if self.active >= self.max_concurrency or self.waiting > 0:
            return True
        entry = self._sessions.get(session_id) if session_id else None
        return entry is not None and entry.lock.locked()

    @asynccontextmanager
    async def slot(self, session_id: str | None) -> AsyncIterator[float]:
        """Waits for a slot (in session order); yields the seconds waited.

        Raises:
            QueueFullError: the queue is full.
        """
        if self._would_wait(session_id) and self.waiting >= self.max_queue:
            raise QueueFullError
        loop = asyncio.get_running_loop()
        started = loop.time()
        entry: _SessionLock | None = None
        if session_id:
            entry = self._sessions.setdefault(session_id, _SessionLock(asyncio.Lock()))
            entry.users += 1
        self.waiting += 1
        self._metrics.queue_depth.set(self.waiting)
        got_session = got_slot = False
        try:
            if entry is not None:
                await entry.lock.acquire()
                got_session = True
            await self._slots.acquire()
            got_slot = True
            self.waiting -= 1
            self._metrics.queue_depth.set(self.waiting)
            self.active += 1
            self._metrics.inflight.set(self.active)
            waited = loop.time() - started
            self._metrics.queue_wait.observe(waited)
            yield waited
        finally:
            if got_slot:
                self.active -= 1
                self._metrics.inflight.set(self.active)
                self._slots.release()
            else:
                self.waiting -= 1
                self._metrics.queue_depth.set(self.waiting)
            if entry is not None:
                if got_session:
                    entry.lock.release()
                entry.users -= 1
                if entry.users == 0 and session_id is not None:
                    self._sessions.pop(session_id, None)
