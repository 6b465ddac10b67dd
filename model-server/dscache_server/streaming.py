"""Streamed completions: server-sent events, and the response that holds the slot.

Contract (OpenAI's stream format):
    * Each event is ``data: <compact JSON>\\n\\n``; the stream ends with
      ``data: [DONE]\\n\\n``.
    * A chat stream opens with a chunk whose delta is ``{"role": "assistant",
      "content": ""}``; then one chunk per text delta; then a chunk with an empty
      delta and the finish reason. A text-completion stream has ``text`` in every
      chunk (``""`` in the last one).
    * With ``stream_options.include_usage`` a last chunk with no choices carries
      ``usage``.
    * A generation that fails mid-stream sends the internal-error body as an event,
      then ``[DONE]``. A client that goes away stops the generation at its next token.
    * ``SlotStreamingResponse`` holds the request's generation slot until the last
      byte is sent or the client is gone, whichever comes first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dscache_server.errors import INTERNAL_ERROR
from dscache_server.generate import GenerationRequest, GenerationResult
from dscache_server.runtime import Runtime
from dscache_server.schemas import (
    ChatChunkChoice,
    Chunk,
    ChunkDelta,
    Endpoint,
    TextChoice,
    finish_reason,
    timings,
    usage,
)

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse(obj: object) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class ChunkMaker:
    """Builds the chunks of one stream (same id, model and creation time in each)."""

    request_id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: str | None, finish: str | None, *, first: bool = False) -> Chunk:
        """A chunk adding ``delta`` (None: nothing) and, at the end, the finish reason."""
        choices: list[ChatChunkChoice] | list[TextChoice]
        if self.chat:
            d: ChunkDelta = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choices = [ChatChunkChoice(index=0, delta=d, logprobs=None, finish_reason=finish)]
        else:
            text = delta or ""
            choices = [TextChoice(index=0, text=text, logprobs=None, finish_reason=finish)]
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def last(self, result: GenerationResult) -> Chunk:
        """The chunk with the finish reason."""
        return self.chunk(None if self.chat else "", finish_reason(result))

    def usage(self, result: GenerationResult) -> Chunk:
        """The usage chunk (no choices)."""
        final = self.chunk(None, None)
        final["choices"] = []
        final["usage"] = usage(result)
        final["timings"] = timings(result)
        return final


class _Generation:
    """One request generating on a worker thread, its text deltas on an asyncio queue."""

    def __init__(self, rt: Runtime, req: GenerationRequest) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._req = req
        self._task = asyncio.create_task(self._run(rt))

    def _put(self, delta: str | None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)

    async def _run(self, rt: Runtime) -> GenerationResult:
        try:
            return await rt.generate(self._req, self._put)
        finally:
            self._put(None)  # ends deltas(), also when the generation failed

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas as the worker produces them, until it is done."""
        while (delta := await self._queue.get()) is not None:
            yield delta

    async def result(self) -> GenerationResult:
        """The finished result; raises what the generation raised."""
        return await self._task

    def abandon(self) -> None:
        """Tells a still-running worker to stop at its next token (client gone)."""
        if not self._task.done():
            self._req.cancelled.set()


async def stream_completion(
    rt: Runtime,
    *,
    endpoint: Endpoint,
    request_id: str,
    req: GenerationRequest,
    include_usage: bool,
    started: float,
    on_answer: Callable[[GenerationResult], None] | None = None,
) -> AsyncIterator[bytes]:
    """The events of one streamed completion (see the module's contract);
    ``on_answer`` gets the result before the chunk with the finish reason is sent."""
    chunks = ChunkMaker(request_id, rt.settings.model_name, chat=endpoint == "chat")
    generation = _Generation(rt, req)
    try:
        if chunks.chat:
            yield sse(chunks.chunk("", None, first=True))
        async for delta in generation.deltas():
            yield sse(chunks.chunk(delta, None))
        try:
            result = await generation.result()
        except Exception:
            log.exception("generation failed mid-stream")
            yield sse(INTERNAL_ERROR.body())
            yield DONE
            return
        if on_answer is not None:
            on_answer(result)
        yield sse(chunks.last(result))
        if include_usage:
            yield sse(chunks.usage(result))
        yield DONE
        rt.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
        log.info(
            "done %s cached_tokens=%d completion_tokens=%d (stream) fallback=%s",
            request_id,
            result.cached_tokens,
            result.completion_tokens,
            result.fallback,
        )
    finally:
        generation.abandon()


class SlotStreamingResponse(StreamingResponse):
    """An event stream that owns the generation slot its request holds.

    The route enters the slot on an ``AsyncExitStack`` and hands the stack over
    (``stack.pop_all()``); the response closes it when sending ends, normally or not,
    even if the event generator never started.
    """

    def __init__(
        self, events: AsyncIterator[bytes], *, slot: AsyncExitStack, headers: Mapping[str, str]
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
        )
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Sends the stream, then gives the slot back."""
        async with self._slot:
            await super().__call__(scope, receive, send)
