"""The OpenAI-compatible HTTP API.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream``), ``GET /v1/models``, ``GET /metrics``, ``GET /health`` (liveness),
``GET /ready`` (readiness: model loaded and not draining).

Contract:
    * Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
      400 for malformed JSON, bad parameters and prompts over the context; 404 for an
      unknown model; 413 for a body over ``max_request_bytes``; 429 with Retry-After
      when the queue is full; 503 with Retry-After while loading or draining. A bug
      is a 500 in the same shape; nothing takes the process down.
    * ``usage.prompt_tokens_details.cached_tokens`` is the number of prompt tokens
      restored from the cache for this request.
    * The session header (``X-Session-ID``) is read, logged and echoed; the tenant
      comes from the tenant header, else the API key, else ``default``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dscache_server.generate import GenerationRequest, GenerationResult, SamplingParams
from dscache_server.runtime import DEFAULT_TENANT, Runtime, tenant_from_api_key
from dscache_server.scheduler import QueueFullError, Scheduler
from dscache_server.tokenizer import ChatMessage, TemplateError

log = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 4


class APIError(Exception):
    """An error answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        """The JSON response for this error."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=headers)


# -- request schemas -------------------------------------------------------------


class _Base(BaseModel):
    # OpenAI clients send fields we do not implement (penalties, logit_bias, user...);
    # they are accepted and ignored unless listed as unsupported below.
    model_config = ConfigDict(extra="allow")


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    """A message as the client sends it."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """Content flattened to text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"unsupported content part type {part.type!r}")
            parts.append(part.text)
        return "".join(parts)


class StreamOptions(BaseModel):
    """OpenAI's stream_options."""

    include_usage: bool = False


class _Sampling(_Base):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | int | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    def stops(self) -> tuple[str, ...]:
        """Stop strings as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    """Body of /v1/chat/completions."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    """Body of /v1/completions."""

    prompt: str | list[int] | list[str]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


# -- the app ---------------------------------------------------------------------


@dataclass
class AppState:
    """Mutable state of one app: the runtime once loaded, draining flag."""

    runtime: Runtime | None = None
    scheduler: Scheduler | None = None
    draining: bool = False
    load_error: str | None = None


def create_app(
    runtime: Runtime | None = None,
    *,
    loader: Callable[[], Runtime] | None = None,
) -> FastAPI:
    """The FastAPI app; give a built ``runtime``, or a ``loader`` run at start-up.

    With a loader the app answers /health at once and /ready (and completions, with
    503) only once the loader has finished, so an orchestrator can probe it while the
    model loads.
    """
    state = AppState(runtime=runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task: asyncio.Task[None] | None = None
        if state.runtime is None and loader is not None:

            async def load() -> None:
                try:
                    state.runtime = await asyncio.to_thread(loader)
                    log.info("model ready")
                except Exception as exc:
                    state.load_error = f"{type(exc).__name__}: {exc}"
                    log.exception("loading the model failed")

            task = asyncio.create_task(load())
        try:
            yield
        finally:
            state.draining = True
            if task is not None and not task.done():
                task.cancel()
            if state.runtime is not None and loader is not None:
                state.runtime.close()

    app = FastAPI(title="dscache model server", lifespan=lifespan)
    app.state.dscache = state

    def need_runtime() -> tuple[Runtime, Scheduler]:
        rt = state.runtime
        if rt is None or state.draining:
            raise APIError(
                503,
                "the server is loading or draining" if not state.load_error else state.load_error,
                type_="service_unavailable",
                code="not_ready",
                retry_after=1 if rt is None else 5,
            )
        if state.scheduler is None:
            state.scheduler = Scheduler(
                rt.settings.max_concurrency, rt.settings.max_queue, rt.metrics
            )
        return rt, state.scheduler

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc.errors()).response()

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error: %s", exc, exc_info=exc)
        return APIError(500, "internal error", type_="server_error", code="internal").response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        rt = state.runtime
        if rt is None or state.draining:
            reason = "draining" if state.draining else state.load_error or "loading"
            return JSONResponse({"status": reason}, status_code=503, headers={"Retry-After": "1"})
        cache = "disabled" if rt.cache.store is None else "enabled"
        return JSONResponse({"status": "ready", "model": rt.settings.model_name, "cache": cache})

    @app.get("/metrics")
    async def metrics() -> Response:
        rt = state.runtime
        if rt is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        rt, _ = need_runtime()
        return {
            "object": "list",
            "data": [
                {
                    "id": rt.settings.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "dscache",
                    "max_model_len": rt.max_context,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, "completions")

    async def _handle(request: Request, endpoint: str) -> Response:
        started = time.perf_counter()
        session_id = request.headers.get("x-session-id")
        code = "500"
        rt: Runtime | None = None
        try:
            rt, scheduler = need_runtime()
            settings = rt.settings
            session_id = request.headers.get(settings.session_header.lower()) or session_id
            body = await _read_json(request, settings.max_request_bytes)
            req, params_stream, include_usage = _parse(rt, endpoint, body, request, started)
            req.session_id = session_id
            request_id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
            log.info(
                "request %s endpoint=%s session=%s prompt_tokens=%d",
                request_id,
                endpoint,
                session_id,
                len(req.token_ids),
            )
            try:
                slot = scheduler.slot(session_id)
                waited = await slot.__aenter__()
            except QueueFullError:
                raise APIError(
                    429,
                    "the server is busy: request queue is full",
                    type_="rate_limit_error",
                    code="queue_full",
                    retry_after=settings.retry_after_s,
                ) from None
            headers = {settings.session_header: session_id} if session_id else {}
            if params_stream:
                code = "200"
                return StreamingResponse(
                    _stream(
                        rt,
                        endpoint=endpoint,
                        request_id=request_id,
                        req=req,
                        slot=slot,
                        include_usage=include_usage,
                        started=started,
                    ),
                    media_type="text/event-stream",
                    headers={**headers, "Cache-Control": "no-cache"},
                )
            try:
                result = await _run(rt, req, lambda _delta: None)
            finally:
                await slot.__aexit__(None, None, None)
            code = "200"
            log.info(
                "done %s cached_tokens=%d completion_tokens=%d waited=%.3fs fallback=%s",
                request_id,
                result.cached_tokens,
                result.completion_tokens,
                waited,
                result.fallback,
            )
            rt.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
            return JSONResponse(_final_body(rt, endpoint, request_id, result), headers=headers)
        except APIError as exc:
            code = str(exc.status)
            resp = exc.response()
            if session_id:
                name = rt.settings.session_header if rt is not None else "X-Session-ID"
                resp.headers[name] = session_id
            return resp
        finally:
            if rt is not None:
                rt.metrics.requests.labels(endpoint=endpoint, code=code).inc()

    return app


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    raw = await request.body()
    if len(raw) > limit:
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from None


def _validation_error(errors: Any) -> APIError:
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _parse(
    rt: Runtime, endpoint: str, body: Any, request: Request, arrived: float
) -> tuple[GenerationRequest, bool, bool]:
    settings = rt.settings
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    chat_req: ChatCompletionRequest | None = None
    comp_req: CompletionRequest | None = None
    try:
        if endpoint == "chat":
            chat_req = ChatCompletionRequest.model_validate(body)
        else:
            comp_req = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None
    base: _Sampling = chat_req if chat_req is not None else comp_req  # type: ignore[assignment]
    if base.model and base.model != settings.model_name:
        raise APIError(
            404,
            f"the model {base.model!r} does not exist; this server serves {settings.model_name!r}",
            code="model_not_found",
            param="model",
        )
    tok = rt.tokenizer
    try:
        if chat_req is not None:
            messages = [ChatMessage(m.role, m.text()) for m in chat_req.messages]
            ids = tok.apply_chat_template(messages)
        else:
            assert comp_req is not None
            prompt = comp_req.prompt
            if isinstance(prompt, str):
                ids = tok.encode(prompt)
            elif prompt and all(isinstance(p, int) for p in prompt):
                ids = [int(p) for p in prompt]
                vocab = rt.engine.vocab_size
                if any(not 0 <= i < vocab for i in ids):
                    raise APIError(400, "token id out of range", param="prompt")
            elif len(prompt) == 1:
                ids = tok.encode(str(prompt[0]))
            else:
                raise APIError(400, "exactly one prompt per request", param="prompt")
    except (TemplateError, ValueError) as exc:
        raise APIError(400, str(exc), param="messages" if chat_req else "prompt") from None
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    max_tokens = (
        (chat_req.max_completion_tokens if chat_req is not None else None)
        or base.max_tokens
        or settings.default_max_tokens
    )
    if max_tokens > settings.max_tokens_limit:
        raise APIError(
            400, f"max_tokens must be <= {settings.max_tokens_limit}", param="max_tokens"
        )
    limit = rt.max_context
    if len(ids) + 1 > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{len(ids)} tokens",
            code="context_length_exceeded",
            param="messages" if chat_req else "prompt",
        )
    max_tokens = min(max_tokens, limit - len(ids))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=base.temperature,
        top_p=base.top_p,
        seed=base.seed,
        stop=base.stops(),
    )
    tenant = _tenant(rt, request)
    req = GenerationRequest(
        token_ids=ids, params=params, chain=rt.chain_for(tenant), arrived=arrived
    )
    include_usage = bool(base.stream_options and base.stream_options.include_usage)
    return req, base.stream, include_usage


def _tenant(rt: Runtime, request: Request) -> str:
    header = request.headers.get(rt.settings.tenant_header.lower())
    if header:
        return "tenant:" + header
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return tenant_from_api_key(auth[7:].strip())
    return DEFAULT_TENANT


async def _run(
    rt: Runtime, req: GenerationRequest, emit: Callable[[str], None]
) -> GenerationResult:
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(rt.executor, rt.generator.run, req, emit)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        req.cancelled.set()  # the worker stops at its next token
        raise


def _usage(result: GenerationResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def _finish(result: GenerationResult) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def _final_body(
    rt: Runtime, endpoint: str, request_id: str, result: GenerationResult
) -> dict[str, Any]:
    choice: dict[str, Any]
    if endpoint == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None,
            "finish_reason": _finish(result),
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": result.text,
            "logprobs": None,
            "finish_reason": _finish(result),
        }
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": rt.settings.model_name,
        "choices": [choice],
        "usage": _usage(result),
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _stream(
    rt: Runtime,
    *,
    endpoint: str,
    request_id: str,
    req: GenerationRequest,
    slot: Any,
    include_usage: bool,
    started: float,
) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    created = int(time.time())
    model = rt.settings.model_name
    chat = endpoint == "chat"

    def chunk(delta: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any]
        if chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
        }

    def emit(delta: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, delta)

    async def run() -> GenerationResult:
        try:
            return await _run(rt, req, emit)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    task: asyncio.Task[GenerationResult] | None = None
    try:
        task = asyncio.create_task(run())
        if chat:
            yield _sse(chunk("", None, first=True))
        while True:
            delta = await queue.get()
            if delta is None:
                break
            yield _sse(chunk(delta, None))
        try:
            result = await task
        except Exception:
            log.exception("generation failed mid-stream")
            yield _sse(
                {
                    "error": {
                        "message": "internal error",
                        "type": "server_error",
                        "param": None,
                        "code": "internal",
                    }
                }
            )
            yield b"data: [DONE]\n\n"
            return
        yield _sse(chunk(None if chat else "", _finish(result)))
        if include_usage:
            final = chunk(None, None)
            final["choices"] = []
            final["usage"] = _usage(result)
            yield _sse(final)
        yield b"data: [DONE]\n\n"
        rt.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
        log.info(
            "done %s cached_tokens=%d completion_tokens=%d (stream) fallback=%s",
            request_id,
            result.cached_tokens,
            result.completion_tokens,
            result.fallback,
        )
    finally:
        if task is not None and not task.done():
            req.cancelled.set()  # client went away: stop generating
        await slot.__aexit__(None, None, None)
