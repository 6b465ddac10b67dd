"""One completion request, from its body to its response: the generation slot's owner.

Contract:
    * The caller is authenticated (``state.authenticate``) before its body is read;
      a refused request never reads a body nor waits for a slot.
    * The body is parsed and tokenized on a worker thread (at most
      ``max_concurrency`` at once), never on the event loop: probes and other
      requests are answered while a long prompt is tokenized.
    * The slot is taken after the request is parsed, so a bad request never waits;
      a full queue is a 429 ``queue_full`` with Retry-After (``retry_after_s``).
    * A session is its tenant's: two tenants that send the same session id are two
      sessions (one never waits for, nor counts in, the other's).
    * The slot is entered in one place (``_answer``) on an ``AsyncExitStack``: a plain
      response gives it back when the generation ends; a stream hands the stack to
      its ``SlotStreamingResponse``, which gives it back when sending ends.
    * A parsed request's prompt is counted by the live template miner
      (``Runtime.record_template``, its session as its conversation) before it waits
      for a slot.
    * The next-turn header (``next_turn_header``: ``expected`` or ``ended``; anything
      else is a 400 ``invalid_next_turn``) becomes a signal to the sidecar's
      eviction policy once the prompt's blocks are stored; a request that has to
      wait for a slot first tells the sidecar its prefix is ``queued``.
    * The session header is read, logged and echoed on every answer, errors included;
      an authenticated request records its session in the pod's ledger
      (``AppState.sessions``: router replicas ask it where the session lives), a
      valid chat request of the public tenant records its messages' key
      (``AppState.conversations``: where a turn without its id finds its
      conversation's last pod, ``dscache.routing.conversation_key``) and, once
      its answer ran to its end (stop or length) and before the answer's last
      byte is sent, the key of its messages with that answer
      (``dscache.routing.answered_key``), and
      every answer carries the pod's in-flight count (``X-Dscache-Inflight``);
      every answer is counted in ``requests_total{endpoint, code, tenant}`` once the
      model is loaded (a bug counts as 500; a refused request as tenant ``other``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dscache.routing import INFLIGHT_HEADER, SessionLedger, answered_key, conversation_key
from dscache_server.auth import DEFAULT_TENANT, OTHER_LABEL, Principal
from dscache_server.errors import APIError
from dscache_server.generate import COMPLETED, GenerationResult
from dscache_server.parse import ParsedRequest, parse_request, read_json
from dscache_server.schemas import Endpoint, completion_body
from dscache_server.slots import QueueFullError, tenant_session
from dscache_server.state import AppState, Serving, authenticate
from dscache_server.streaming import SlotStreamingResponse, stream_completion

log = logging.getLogger(__name__)

#: The session header's name before the settings are known (model not loaded yet).
DEFAULT_SESSION_HEADER = "X-Session-ID"


async def handle_completion(request: Request, endpoint: Endpoint, state: AppState) -> Response:
    """Answers a chat or text completion request, counted and with its session echoed."""
    started = time.perf_counter()
    session_id = request.headers.get(DEFAULT_SESSION_HEADER.lower())
    try:
        serving = state.serving()
    except APIError as exc:
        return _echo(exc.response(), DEFAULT_SESSION_HEADER, session_id)
    rt = serving.runtime
    header = rt.settings.session_header
    session_id = request.headers.get(header.lower()) or session_id
    code = "500"
    tenant = OTHER_LABEL
    try:
        principal = authenticate(rt, request.headers)
        tenant = principal.label
        state.sessions.seen(session_id)  # a refused caller places no session
        response = await _answer(
            request,
            endpoint,
            serving,
            principal=principal,
            session_id=session_id,
            started=started,
            conversations=state.conversations,
        )
        code = "200"
    except APIError as exc:
        code = str(exc.status)
        response = _echo(exc.response(), header, session_id)
    finally:
        rt.metrics.requests.labels(endpoint=endpoint, code=code, tenant=tenant).inc()
    # A stream's count is taken as it starts (its own request included).
    response.headers[INFLIGHT_HEADER] = str(state.inflight())
    return response


_NEXT_TURNS = ("expected", "ended")


def _next_turn(value: str | None) -> str:
    """The next-turn header's value: "expected", "ended" or "" (absent)."""
    if not value:
        return ""
    v = value.strip().lower()
    if v not in _NEXT_TURNS:
        raise APIError(
            400,
            f"next-turn header must be one of {', '.join(_NEXT_TURNS)}, got {value[:64]!r}",
            code="invalid_next_turn",
        )
    return v


def _echo(response: Response, header: str, session_id: str | None) -> Response:
    if session_id:
        response.headers[header] = session_id
    return response


async def _answer(
    request: Request,
    endpoint: Endpoint,
    serving: Serving,
    *,
    principal: Principal,
    session_id: str | None,
    started: float,
    conversations: SessionLedger,
) -> Response:
    rt, slots, parsers = serving
    settings = rt.settings
    next_turn = _next_turn(request.headers.get(settings.next_turn_header.lower()))
    body = await read_json(request, settings.max_request_bytes)
    session = tenant_session(principal.tenant, session_id)

    def parse() -> ParsedRequest:
        t0 = time.perf_counter()
        parsed = parse_request(rt, endpoint, body, principal, started)
        parsed.generation.timings["tokenize"] = time.perf_counter() - t0
        parsed.generation.session_id = session
        parsed.generation.next_turn = next_turn
        rt.record_template(parsed.generation, principal.tenant)
        return parsed

    parsed = await anyio.to_thread.run_sync(parse, limiter=parsers)
    remember: Callable[[GenerationResult], None] | None = None
    if endpoint == "chat" and principal.tenant == DEFAULT_TENANT and isinstance(body, dict):
        messages = body.get("messages")
        conversations.seen(conversation_key(messages))

        def remember(result: GenerationResult) -> None:
            if result.finish_reason in COMPLETED:
                conversations.seen(answered_key(messages, result.text))

    request_id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
    log.info(
        "request %s endpoint=%s session=%s prompt_tokens=%d",
        request_id,
        endpoint,
        session_id,
        len(parsed.generation.token_ids),
    )
    headers = {settings.session_header: session_id} if session_id else {}
    if slots.active >= slots.max_concurrency or slots.waiting > 0:
        gen = parsed.generation  # it will wait: keep its prefix until it is served
        await anyio.to_thread.run_sync(
            rt.cache.signal, gen.chain, gen.token_ids, "queued", limiter=parsers
        )
    async with AsyncExitStack() as slot:
        try:
            waited = await slot.enter_async_context(slots.slot(session))
        except QueueFullError:
            raise APIError(
                429,
                "the server is busy: request queue is full",
                type_="rate_limit_error",
                code="queue_full",
                retry_after=settings.retry_after_s,
            ) from None
        parsed.generation.timings["queue"] = waited
        if parsed.stream:
            events = stream_completion(
                rt,
                endpoint=endpoint,
                request_id=request_id,
                req=parsed.generation,
                include_usage=parsed.include_usage,
                started=started,
                on_answer=remember,
            )
            return SlotStreamingResponse(events, slot=slot.pop_all(), headers=headers)
        result = await rt.generate(parsed.generation)
    if remember is not None:
        remember(result)
    log.info(
        "done %s cached_tokens=%d completion_tokens=%d waited=%.3fs fallback=%s",
        request_id,
        result.cached_tokens,
        result.completion_tokens,
        waited,
        result.fallback,
    )
    rt.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
    body_out = completion_body(endpoint, request_id, settings.model_name, result)
    return JSONResponse(body_out, headers=headers)
