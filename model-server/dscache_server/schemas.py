"""The OpenAI-compatible request and response shapes.

Requests are pydantic models: a body that does not fit is a 400 naming the field.
OpenAI clients send fields we do not implement (penalties, ``logit_bias``,
``user``...); they are accepted and ignored unless refused here (``n`` > 1,
``logprobs``, ``echo``).

Responses are ``TypedDict``s: the JSON keys, their order and their values are
OpenAI's, and ``usage.prompt_tokens_details.cached_tokens`` is the number of prompt
tokens restored from the cache for this request. The streamed chunks are in
``streaming``.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dscache_server.generate import GenerationResult

MAX_STOP_SEQUENCES = 4

#: Which API a request came in on.
Endpoint = Literal["chat", "completions"]


class _Open(BaseModel):
    # Unknown fields are accepted and ignored (see the module docstring).
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    """A part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessageIn(_Open):
    """A message as the client sends it."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """Content flattened to text.

        Raises:
            ValueError: a part that is not text.
        """
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


class SamplingFields(_Open):
    """Fields both completion APIs share."""

    #: The field that holds the prompt, for errors about it.
    PROMPT_FIELD: ClassVar[str]

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

    def requested_max_tokens(self) -> int | None:
        """The completion length the client asked for, if it did."""
        return self.max_tokens

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    """Body of /v1/chat/completions."""

    PROMPT_FIELD: ClassVar[str] = "messages"

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    """Body of /v1/completions."""

    PROMPT_FIELD: ClassVar[str] = "prompt"

    prompt: str | list[int] | list[str]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


# -- responses -------------------------------------------------------------------


class PromptTokensDetails(TypedDict):
    """Where the prompt tokens came from."""

    cached_tokens: int


class Usage(TypedDict):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(TypedDict):
    """The generated message of a chat completion."""

    role: Literal["assistant"]
    content: str


class ChatChoice(TypedDict):
    """The one choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str


class TextChoice(TypedDict):
    """The one choice of a text completion, and of each streamed text chunk."""

    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class ChunkDelta(TypedDict, total=False):
    """What a streamed chat chunk adds: the role first, then content."""

    role: Literal["assistant"]
    content: str


class ChatChunkChoice(TypedDict):
    """The one choice of a streamed chat chunk."""

    index: int
    delta: ChunkDelta
    logprobs: None
    finish_reason: str | None


class _Identified(TypedDict):
    id: str
    created: int
    model: str


class Completion(_Identified):
    """A whole (non-streamed) chat or text completion.

    ``timings`` is dscache's extension (as llama.cpp's server has one): seconds this
    request spent in each phase (``dscache.metricnames.PHASES`` on its path, and
    ``ttft``, the server's own time to the first token). Clients ignore it.
    """

    object: Literal["chat.completion", "text_completion"]
    choices: list[ChatChoice] | list[TextChoice]
    usage: Usage
    timings: dict[str, float]


class Chunk(_Identified):
    """One server-sent event of a stream; the last one may carry only ``usage``
    (and then ``timings``, as in :class:`Completion`)."""

    object: Literal["chat.completion.chunk", "text_completion"]
    choices: list[ChatChunkChoice] | list[TextChoice]
    usage: NotRequired[Usage]
    timings: NotRequired[dict[str, float]]


def usage(result: GenerationResult) -> Usage:
    """The ``usage`` object of a finished request."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's finish reason: ``stop`` (EOS or a stop string), else ``length``."""
    return "stop" if result.finish_reason == "stop" else "length"


def completion_body(
    endpoint: Endpoint, request_id: str, model: str, result: GenerationResult
) -> Completion:
    """The response body of a non-streamed request."""
    choices: list[ChatChoice] | list[TextChoice]
    finish = finish_reason(result)
    if endpoint == "chat":
        message: AssistantMessage = {"role": "assistant", "content": result.text}
        choices = [ChatChoice(index=0, message=message, logprobs=None, finish_reason=finish)]
    else:
        choices = [TextChoice(index=0, text=result.text, logprobs=None, finish_reason=finish)]
    return {
        "id": request_id,
        "object": "chat.completion" if endpoint == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
        "timings": timings(result),
    }


def timings(result: GenerationResult) -> dict[str, float]:
    """The ``timings`` extension: seconds per phase, rounded to microseconds."""
    return {phase: round(seconds, 6) for phase, seconds in result.timings.items()}
