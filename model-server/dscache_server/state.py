"""The state of one app: its runtime once loaded, its generation slots, whether it drains.

Contract:
    * ``AppState.serving()`` is the one gate of every model route: it returns the
      runtime, the slots and the parsers' thread limiter (made on first use, on
      the serving event loop), or raises a 503 ``not_ready`` (Retry-After 1 while
      loading, 5 while draining; the loader's error as message if loading failed).
    * ``AppState.lifespan`` runs the loader (if any) on a worker thread after
      start-up, so ``/health`` answers while the model loads; on shutdown it marks the
      app draining and closes a runtime it loaded itself.
    * ``authenticate`` is the other gate: the caller's ``Principal``, or the refusal
      (401/400 ``APIError``) of ``auth`` - before a body is read or a slot taken.
    * Routes get the state through the ``StateDep`` dependency (typed), never through
      a global.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, NamedTuple

import anyio
from fastapi import Depends, FastAPI, Request

from dscache.routing import SessionLedger
from dscache_server.auth import AuthError, Principal
from dscache_server.errors import APIError, refused
from dscache_server.runtime import Runtime
from dscache_server.slots import GenerationSlots

log = logging.getLogger(__name__)


class Serving(NamedTuple):
    """What a model route needs: the loaded runtime, the app's slots, and the
    limiter of the worker threads that parse and tokenize request bodies."""

    runtime: Runtime
    slots: GenerationSlots
    parsers: anyio.CapacityLimiter


@dataclass
class AppState:
    """Mutable state of one app.

    Attributes:
        runtime: the runtime once built or loaded.
        loader: builds the runtime at start-up (None: ``runtime`` is given).
        slots: made on first use, on the serving event loop.
        draining: set at shutdown; model routes answer 503 from then on.
        load_error: why loading failed, if it did.
        sessions: the sessions this pod served (router replicas ask it where a
            session lives: :mod:`dscache_router.locate`).
        conversations: the keys of the public tenant's chat requests this pod
            served (``dscache.routing.conversation_key``: where a turn without its
            session id finds its conversation's previous turn).
    """

    runtime: Runtime | None = None
    loader: Callable[[], Runtime] | None = None
    slots: GenerationSlots | None = None
    parsers: anyio.CapacityLimiter | None = None
    draining: bool = False
    load_error: str | None = None
    sessions: SessionLedger = field(default_factory=SessionLedger)
    conversations: SessionLedger = field(default_factory=SessionLedger)

    def inflight(self) -> int:
        """Requests holding or waiting for a generation slot (0 before the first)."""
        s = self.slots
        return 0 if s is None else s.active + s.waiting

    def serving(self) -> Serving:
        """The runtime and slots; raises a 503 ``APIError`` until ready or once draining."""
        rt = self.runtime
        if rt is None or self.draining:
            raise APIError(
                503,
                self.load_error or "the server is loading or draining",
                type_="service_unavailable",
                code="not_ready",
                retry_after=1 if rt is None else 5,
            )
        if self.slots is None or self.parsers is None:
            settings = rt.settings
            self.slots = GenerationSlots(settings.max_concurrency, settings.max_queue, rt.metrics)
            # Tokenizing is CPU work: off the event loop (probes answer meanwhile), on
            # as many threads as there are slots, not one per request.
            self.parsers = anyio.CapacityLimiter(settings.max_concurrency)
        return Serving(rt, self.slots, self.parsers)

    def not_ready_reason(self) -> str | None:
        """Why ``/ready`` is 503 (``loading``, ``draining`` or the load error); None if ready."""
        if self.draining:
            return "draining"
        if self.runtime is None:
            return self.load_error or "loading"
        return None

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        """FastAPI's lifespan: load in the background, drain and close on the way out."""
        task: asyncio.Task[None] | None = None
        if self.runtime is None and self.loader is not None:
            task = asyncio.create_task(self._load(self.loader))
        try:
            yield
        finally:
            self.draining = True
            if task is not None and not task.done():
                task.cancel()
            if self.runtime is not None and self.loader is not None:
                self.runtime.close()

    async def _load(self, loader: Callable[[], Runtime]) -> None:
        try:
            self.runtime = await asyncio.to_thread(loader)
            log.info("model ready")
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("loading the model failed")


def authenticate(rt: Runtime, headers: Mapping[str, str]) -> Principal:
    """Who sent a request with these headers; raises the refusal as an ``APIError``."""
    try:
        return rt.auth.authenticate(headers)
    except AuthError as exc:
        raise refused(exc) from None


def app_state(request: Request) -> AppState:
    """The ``AppState`` of the app serving ``request``."""
    state = request.app.state.dscache
    if not isinstance(state, AppState):
        raise TypeError("the app was not built by dscache_server.app.create_app")
    return state


#: A route parameter that receives the app's state.
StateDep = Annotated[AppState, Depends(app_state)]
