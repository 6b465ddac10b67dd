"""From an HTTP request to a ``GenerationRequest`` the engine can run.

Contract:
    * A body over ``max_request_bytes`` is a 413 (checked on ``Content-Length``
      before reading, and on the bytes as they arrive: a chunked body is refused at
      its first byte past the limit); a body that is not a JSON object is a
      400 ``invalid_json``; a field that does not fit the schema is a 400
      ``invalid_value`` naming it; another model name is a 404 ``model_not_found``;
      a prompt that leaves no room for one token is a 400 ``context_length_exceeded``.
    * ``max_tokens`` is capped so that prompt + completion fit the context.
    * The tenant is the caller's :class:`~dscache_server.auth.Principal` (from
      authentication, ``auth``, checked before the body is read); it selects the
      key chain, so tenants never share a block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request
from pydantic import ValidationError

from dscache_server.auth import Principal
from dscache_server.errors import APIError, validation_error
from dscache_server.generate import GenerationRequest, SamplingParams
from dscache_server.runtime import Runtime
from dscache_server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    SamplingFields,
)
from dscache_server.tokenizer import ChatMessage, TemplateError

#: A JSON value as ``json.loads`` returns it.
JSON = dict[str, object] | list[object] | str | int | float | bool | None


@dataclass(frozen=True)
class ParsedRequest:
    """A request ready to run, and how to answer it."""

    generation: GenerationRequest
    stream: bool
    include_usage: bool


async def read_json(request: Request, limit: int) -> JSON:
    """The body as JSON; 413 over ``limit`` bytes, 400 when it is not JSON.

    The size is checked as the body arrives: a chunked body (no ``Content-Length``)
    is refused at its first byte past ``limit``, never buffered whole first.
    """
    length = request.headers.get("content-length")
    too_large = APIError(413, f"request body over {limit} bytes", code="request_too_large")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise too_large
    raw = bytes(buf)
    try:
        body: JSON = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from None
    return body


def parse_request(
    rt: Runtime, endpoint: Endpoint, body: JSON, principal: Principal, arrived: float
) -> ParsedRequest:
    """Validates ``body`` for ``endpoint`` and tokenizes its prompt.

    Raises:
        APIError: the request cannot be served (see the module's contract).
    """
    api = _validate(endpoint, body)
    settings = rt.settings
    if api.model and api.model != settings.model_name:
        raise APIError(
            404,
            f"the model {api.model!r} does not exist; this server serves {settings.model_name!r}",
            code="model_not_found",
            param="model",
        )
    ids, text = _prompt_ids(rt, api, principal.tenant)
    params = SamplingParams(
        max_tokens=_max_tokens(rt, api, len(ids)),
        temperature=api.temperature,
        top_p=api.top_p,
        seed=api.seed,
        stop=api.stops(),
    )
    generation = GenerationRequest(
        token_ids=ids,
        params=params,
        chain=rt.chain_for(principal.tenant),
        tenant_label=principal.label,
        arrived=arrived,
        # Answers are remembered for chats and text prompts (token ids are sent as ids).
        answer_scope=(
            principal.tenant if isinstance(api, ChatCompletionRequest) or text is not None else None
        ),
        prompt_text=text,
    )
    return ParsedRequest(generation, api.stream, api.include_usage())


def _validate(endpoint: Endpoint, body: JSON) -> ChatCompletionRequest | CompletionRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    schema = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _prompt_ids(
    rt: Runtime, api: ChatCompletionRequest | CompletionRequest, tenant: str
) -> tuple[list[int], str | None]:
    """The prompt's ids, and a text completion's prompt text (None otherwise)."""
    text: str | None = None
    try:
        if isinstance(api, ChatCompletionRequest):
            messages = [ChatMessage(m.role, m.text()) for m in api.messages]
            ids = rt.tokenizer.apply_chat_template(messages, pieces=rt.pieces, scope=tenant)
        else:
            ids, text = _completion_ids(rt, api.prompt, tenant)
    except (TemplateError, ValueError) as exc:
        raise APIError(400, str(exc), param=api.PROMPT_FIELD) from None
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(api, ChatCompletionRequest) or text is not None:
        # Text: the cache may hold it under another tokenization (a previous
        # answer's generated ids, stored by another process): follow that one.
        ids = rt.respell(ids, tenant)
    return ids, text


def _completion_ids(
    rt: Runtime, prompt: str | list[int] | list[str], tenant: str
) -> tuple[list[int], str | None]:
    if prompt and not isinstance(prompt, str) and all(isinstance(p, int) for p in prompt):
        ids = [int(p) for p in prompt]
        vocab = rt.engine.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, "token id out of range", param="prompt")
        return ids, None
    if not isinstance(prompt, str):
        if len(prompt) != 1:
            raise APIError(400, "exactly one prompt per request", param="prompt")
        prompt = str(prompt[0])
    # A text that continues one this server completed keeps the ids it had.
    return rt.continuations.ids(tenant, prompt, rt.tokenizer.encode), prompt


def _max_tokens(rt: Runtime, api: SamplingFields, prompt_tokens: int) -> int:
    settings = rt.settings
    max_tokens = api.requested_max_tokens() or settings.default_max_tokens
    if max_tokens > settings.max_tokens_limit:
        raise APIError(
            400, f"max_tokens must be <= {settings.max_tokens_limit}", param="max_tokens"
        )
    limit = rt.max_context
    if prompt_tokens + 1 > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{prompt_tokens} tokens",
            code="context_length_exceeded",
            param=api.PROMPT_FIELD,
        )
    return min(max_tokens, limit - prompt_tokens)
