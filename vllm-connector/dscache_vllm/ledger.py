"""vLLM pods in the routing protocol: the session ledger, the in-flight count and the
key facts the picker routes by.

Several router pods agree on where a session lives by asking the model pods
(``dscache.routing``: ``SESSIONS_PATH``, ``INFLIGHT_HEADER``). The reference server
answers both itself; this ASGI middleware makes vLLM's OpenAI server answer them,
so a vLLM session stays on its track and pod whichever router pod it reaches.
``dscache vllm serve`` adds it (vLLM's ``--middleware``).

Contract:
    * A completion request (``POST`` to :data:`COMPLETION_PATHS`) that carries the
      session header (``DSCACHE_VLLM_SESSION_HEADER``, default ``X-Session-ID``: the
      header the router sends a real session id in) is recorded in the pod's
      :class:`~dscache.routing.SessionLedger` when vLLM's answer starts with a
      status below 400: a refused or failed request places no session.
    * A completion request with ``X-Dscache-Next-Turn: ended`` or ``expected``
      (``DSCACHE_VLLM_NEXT_TURN_HEADER`` names another header) reaches vLLM with
      ``kv_transfer_params[NEXT_TURN_PARAM]`` set to it (other keys of the
      client's ``kv_transfer_params`` kept), so the connector signals the
      sidecar's eviction policy when the request ends (:mod:`dscache_vllm.signals`);
      another value is a 400 (``invalid_next_turn``), as on the reference server. A
      body that is not a JSON object goes to vLLM unchanged (vLLM answers it).
    * A chat completion request without ``Authorization`` (the public tenant's: the
      only requests the picker keys) records its messages'
      :func:`~dscache.routing.conversation_key` in the pod's conversation ledger
      on the same terms, answered at ``CONVERSATIONS_PATH + key`` as sessions are:
      where a turn that lost its session id finds its conversation's previous turn.
      Once vLLM's answer to it ran to its end (finish reason ``stop`` or
      ``length``, read from the JSON body or the event stream as it is sent), the
      :func:`~dscache.routing.answered_key` of its messages with that answer too,
      before the bytes that finish it reach the client: the key its next turn is
      found by first. The answer read is its first choice's; a body over
      :data:`MAX_ANSWER_BYTES` is passed on without being read.
    * Every answer to a completion request carries ``INFLIGHT_HEADER``: the
      completion requests this server has started and not finished (a stream counts
      until its last byte), itself included, as the router's load bound reads it.
    * ``GET SESSIONS_PATH + id`` answers 200 ``{"age_s", "inflight"}`` or 404
      ``{"inflight"}``, as the model server does. With ``DSCACHE_VLLM_INTERNAL_TOKEN``
      set it needs that token in ``X-Dscache-Internal-Token`` (401 otherwise,
      compared through SHA-256 digests in constant time); without, it is open and
      says so once at start.
    * ``GET KEYINFO_PATH`` (same token) answers the key facts the picker needs to
      route by the prefix a pod holds, as the model server does: ``{"model",
      "block_tokens", "fingerprint", "root"}`` of requests without a
      ``cache_salt``. vLLM's scheduler-side connector writes them to the file named
      by :data:`KEYINFO_FILE_ENV` when it starts (:func:`write_keyinfo`); until
      then, 503 ``{"status": "loading"}``.
    * Anything else passes through untouched; the middleware never fails a request
      of vLLM's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from dscache_sidecar.holdings import INTERNAL_TOKEN_HEADER, token_matches

from dscache.routing import (
    CONVERSATIONS_PATH,
    INFLIGHT_HEADER,
    KEYINFO_PATH,
    SESSIONS_PATH,
    SessionLedger,
    answered_key,
    conversation_key,
)
from dscache_vllm.signals import NEXT_TURN_PARAM, NEXT_TURNS

log = logging.getLogger("dscache_vllm.ledger")

#: vLLM's completion routes whose sessions the ledger records.
CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATHS = frozenset({CHAT_PATH, "/v1/completions"})
#: The header carrying the session id, as the router sends it (``routing`` upstream header).
SESSION_HEADER_ENV = "DSCACHE_VLLM_SESSION_HEADER"
DEFAULT_SESSION_HEADER = "X-Session-ID"
#: The token the router's picker sends for the session route.
INTERNAL_TOKEN_ENV = "DSCACHE_VLLM_INTERNAL_TOKEN"  # noqa: S105 - a variable's name
#: The client's word on its conversation's next turn (the reference server's header).
NEXT_TURN_HEADER_ENV = "DSCACHE_VLLM_NEXT_TURN_HEADER"
DEFAULT_NEXT_TURN_HEADER = "X-Dscache-Next-Turn"
#: Where the scheduler-side connector leaves the key facts for this server's route.
KEYINFO_FILE_ENV = "DSCACHE_VLLM_KEYINFO_FILE"
#: The longest answer body (or event stream) the conversation ledger reads.
MAX_ANSWER_BYTES = 4 << 20
#: Finish reasons of an answer that ran to its end (what the client sends back).
FINISHED = frozenset({"stop", "length"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class SessionLedgerMiddleware:
    """The routing protocol's two pod-side parts, for vLLM (see the module contract)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        session_header: str | None = None,
        internal_token: str | None = None,
        ledger: SessionLedger | None = None,
        keyinfo_file: str | None = None,
    ) -> None:
        self.app = app
        self.ledger = ledger if ledger is not None else SessionLedger()
        self.conversations = SessionLedger()
        header = session_header or os.environ.get(SESSION_HEADER_ENV) or DEFAULT_SESSION_HEADER
        self._session_header = header.lower().encode("latin-1")
        self._token_header = INTERNAL_TOKEN_HEADER.lower().encode("latin-1")
        turn = os.environ.get(NEXT_TURN_HEADER_ENV) or DEFAULT_NEXT_TURN_HEADER
        self._next_turn_header = turn.lower().encode("latin-1")
        token = internal_token if internal_token is not None else os.environ.get(INTERNAL_TOKEN_ENV)
        self._token = token or None
        self._keyinfo_file = keyinfo_file or os.environ.get(KEYINFO_FILE_ENV)
        self._keyinfo: dict[str, Any] | None = None
        self.inflight = 0
        if self._token is None:
            log.warning(
                "%s is not set: %s and %s answer anyone who asks which sessions this pod "
                "served and how its keys are made",
                INTERNAL_TOKEN_ENV,
                SESSIONS_PATH,
                KEYINFO_PATH,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "")
        if method == "GET" and path.startswith(SESSIONS_PATH):
            if await self._allowed(scope, send, "the session ledger"):
                await self._answer(send, self.ledger, path[len(SESSIONS_PATH) :])
        elif method == "GET" and path.startswith(CONVERSATIONS_PATH):
            if await self._allowed(scope, send, "the conversation ledger"):
                await self._answer(send, self.conversations, path[len(CONVERSATIONS_PATH) :])
        elif method == "GET" and path == KEYINFO_PATH:
            if await self._allowed(scope, send, "the key info"):
                await self._answer_keyinfo(send)
        elif method == "POST" and path in COMPLETION_PATHS:
            await self._completion(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        session = self._header(scope, self._session_header)
        turn = self._header(scope, self._next_turn_header)
        if turn is not None:
            kind = turn.strip().lower()
            if kind not in NEXT_TURNS:
                message = (
                    f"next-turn header must be one of {', '.join(NEXT_TURNS)}, got {turn[:64]!r}"
                )
                body = {"error": {"message": message, "code": "invalid_next_turn"}}
                await _json(send, 400, body)
                return
        public_chat = (
            scope.get("path") == CHAT_PATH and self._header(scope, b"authorization") is None
        )
        chat_key, tap = None, None
        if turn is not None or public_chat:
            data, read = await _json_body(receive)
            if turn is not None:
                scope, read = _with_next_turn(scope, read, data, turn.strip().lower())
            receive = _replay(read, receive)
            if public_chat and isinstance(data, dict):
                messages = data.get("messages")
                chat_key = conversation_key(messages)
                if chat_key is not None:
                    tap = _AnswerTap(
                        lambda answer: self.conversations.seen(answered_key(messages, answer))
                    )
        self.inflight += 1

        async def started(message: Message) -> None:
            if message.get("type") == "http.response.start":
                if int(message.get("status", 500)) < 400:
                    self.ledger.seen(session)
                    self.conversations.seen(chat_key)
                    if tap is not None:
                        tap.start(message)
                headers = [*message.get("headers", ())]
                headers.append((INFLIGHT_HEADER.lower().encode(), str(self.inflight).encode()))
                message = {**message, "headers": headers}
            elif message.get("type") == "http.response.body" and tap is not None:
                tap.body(message)
            await send(message)

        try:
            await self.app(scope, receive, started)
        finally:
            self.inflight -= 1

    async def _allowed(self, scope: Scope, send: Send, what: str) -> bool:
        """Whether the caller may read ``what`` (else it got its 401)."""
        if self._token is None:
            return True
        if token_matches(self._header(scope, self._token_header), self._token):
            return True
        message = f"{what} is for the router's picker: send the internal token as "
        body = {
            "error": {"message": message + INTERNAL_TOKEN_HEADER, "code": "invalid_internal_token"}
        }
        await _json(send, 401, body)
        return False

    async def _answer(self, send: Send, ledger: SessionLedger, key: str) -> None:
        age = ledger.age(key)
        if age is None:
            await _json(send, 404, {"inflight": self.inflight})
        else:
            await _json(send, 200, {"age_s": round(age, 3), "inflight": self.inflight})

    async def _answer_keyinfo(self, send: Send) -> None:
        if self._keyinfo is None and self._keyinfo_file:
            # Written once by the connector; read until it is there.
            with contextlib.suppress(OSError, ValueError):
                self._keyinfo = json.loads(Path(self._keyinfo_file).read_text())
        if self._keyinfo is None:
            await _json(send, 503, {"status": "loading"})
        else:
            await _json(send, 200, self._keyinfo)

    @staticmethod
    def _header(scope: Scope, name: bytes) -> str | None:
        for key, value in scope.get("headers", ()):
            if key.lower() == name:
                return str(value.decode("latin-1"))
        return None


class _AnswerTap:
    """Reads the first choice's answer out of a chat completion's response as vLLM
    sends it (a JSON body, or an event stream of chunks), and hands it to
    ``on_answer`` once it ran to its end (see the module contract)."""

    def __init__(self, on_answer: Callable[[str], None]) -> None:
        self._on_answer = on_answer
        self._live = False
        self._stream = False
        self._pending = b""
        self._read = 0
        self._parts: list[str] = []

    def start(self, message: Message) -> None:
        """The response's start (a status below 400): what kind of body follows."""
        for key, value in message.get("headers", ()):
            if key.lower() == b"content-type":
                self._stream = value.lower().startswith(b"text/event-stream")
        self._live = True

    def body(self, message: Message) -> None:
        """One piece of the body, read before it is sent on."""
        if not self._live:
            return
        chunk = bytes(message.get("body", b""))
        self._read += len(chunk)
        if self._read > MAX_ANSWER_BYTES:
            self._live = False
            return
        self._pending += chunk
        if self._stream:
            *events, self._pending = self._pending.split(b"\n\n")
            for event in events:
                self._event(event)
        elif not message.get("more_body", False):
            choice = _first_choice(_loads(self._pending))
            said = choice.get("message") if choice is not None else None
            if choice is not None and isinstance(said, dict):
                self._finish(choice, said.get("content"))

    def _event(self, event: bytes) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:") or not self._live:
                continue
            choice = _first_choice(_loads(line[5:].strip()))
            if choice is None:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self._parts.append(delta["content"])
            if choice.get("finish_reason") is not None:
                self._finish(choice, "".join(self._parts))

    def _finish(self, choice: dict[str, Any], answer: Any) -> None:
        self._live = False
        if choice.get("finish_reason") in FINISHED and isinstance(answer, str):
            self._on_answer(answer)


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _first_choice(body: Any) -> dict[str, Any] | None:
    """The choice with index 0 of a completion (or chunk) body, or None."""
    choices = body.get("choices") if isinstance(body, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


async def _json_body(receive: Receive) -> tuple[Any, list[Message]]:
    """The request's body parsed (None when it is not JSON, or the client left before
    sending it whole) and the messages read, for vLLM to get again (``_replay``)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message.get("type") != "http.request":  # the client left: let vLLM see it
            return None, [message]
        chunks.append(bytes(message.get("body", b"")))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    return data, [{"type": "http.request", "body": body, "more_body": False}]


def _with_next_turn(
    scope: Scope, read: list[Message], data: Any, kind: str
) -> tuple[Scope, list[Message]]:
    """The request with ``kv_transfer_params[NEXT_TURN_PARAM] = kind`` in its JSON body
    ``data`` (unchanged when the body is not a JSON object)."""
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if isinstance(data, dict) and (params is None or isinstance(params, dict)):
        params = {**(params or {}), NEXT_TURN_PARAM: kind}
        body = json.dumps({**data, "kv_transfer_params": params}).encode()
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = {**scope, "headers": headers}
        return scope, [{"type": "http.request", "body": body, "more_body": False}]
    return scope, read


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that first gives ``messages``, then what the client sends next."""
    pending = list(messages)

    async def again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return again


def write_keyinfo(path: str, *, model: str, block_tokens: int, fingerprint: str, root: str) -> None:
    """Leaves the key facts for :data:`KEYINFO_PATH` in ``path`` (atomically: the
    route never reads half a file)."""
    target = Path(path)
    body = {"model": model, "block_tokens": block_tokens, "fingerprint": fingerprint, "root": root}
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, target)


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
