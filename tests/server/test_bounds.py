"""What one client can make the server do to the others: bounds on bodies, on the
event loop, and on sessions.

The real app in uvicorn on a tiny model (no cache: these are about the HTTP side). A
user would notice: a body that never ends past the limit is refused at once instead
of being buffered; liveness answers while a long prompt is tokenized; a session id
another tenant happens to use (or guesses) neither queues behind nor waits for theirs.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer, PieceCache
from srv_helpers import LiveServer, make_runtime

pytestmark = pytest.mark.slow

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}


def _serve(tokenizer: DeepSeekTokenizer, **kw: Any) -> LiveServer:
    return LiveServer(make_runtime(None, tokenizer, **kw))


@pytest.fixture
def server(tokenizer: DeepSeekTokenizer) -> Iterator[LiveServer]:
    srv = _serve(tokenizer, max_request_bytes=4096)
    yield srv
    srv.stop()


def test_a_chunked_body_is_refused_at_its_first_byte_past_the_limit(server: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 1024
        for _ in range(6):  # 6 KiB against a 4 KiB limit, and the body never ends
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        head = conn.recv(4096)  # before: no answer until the body's end (a timeout)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    # The server is as it was: a normal request gets its answer.
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=60
    )
    assert r.status_code == 200, r.text


class _HeldTokenizer(DeepSeekTokenizer):
    """The real tokenizer, held inside ``apply_chat_template`` until ``release`` is set
    (a prompt that takes long to tokenize, without the wait being a guess)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        pieces: PieceCache | None = None,
        scope: str = "",
    ) -> list[int]:
        self.entered.set()
        self.release.wait(30)
        return super().apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, pieces=pieces, scope=scope
        )


def test_probes_answer_while_a_prompt_is_tokenized() -> None:
    held = _HeldTokenizer()
    srv = _serve(held)
    answer: dict[str, httpx.Response] = {}

    def ask() -> None:
        answer["chat"] = httpx.post(
            srv.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            timeout=60,
        )

    worker = threading.Thread(target=ask)
    try:
        worker.start()
        assert held.entered.wait(30)
        # The chat is being tokenized right now: liveness and readiness still answer
        # (before, tokenizing ran on the event loop and every probe waited for it).
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
    finally:
        held.release.set()
        worker.join(60)
        srv.stop()
    assert answer["chat"].status_code == 200, answer["chat"].text


def test_a_session_id_of_another_tenant_never_queues_behind_it(
    tokenizer: DeepSeekTokenizer, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    srv = _serve(tokenizer, api_keys_file=keys, max_concurrency=4, max_tokens_limit=4096)
    session = {"X-Session-ID": "shared-by-chance"}
    streaming, stop = threading.Event(), threading.Event()
    ended: list[float] = []

    def long_turn() -> None:
        # alpha's turn holds its session for a long generation (a stream), until told.
        body = {"prompt": "tell me everything", "max_tokens": 4000, "stream": True}
        headers = {**session, "Authorization": "Bearer sk-alpha"}
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json=body, headers=headers, timeout=300
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    streaming.set()
                if stop.is_set():
                    break
        ended.append(time.monotonic())

    alpha = threading.Thread(target=long_turn)
    try:
        alpha.start()
        assert streaming.wait(60), "alpha's stream did not start"
        # beta, whose client picked the same id, is served meanwhile (before: it waited
        # in alpha's session queue until alpha's turn ended, minutes here).
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "hello", "max_tokens": 1},
            headers={**session, "Authorization": "Bearer sk-beta"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.headers["X-Session-ID"] == "shared-by-chance"
        assert not ended, "beta was answered only after alpha's turn ended"
    finally:
        stop.set()
        alpha.join(60)
        srv.stop()
