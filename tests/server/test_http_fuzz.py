"""The HTTP API under hostile input: random bodies (wrong types, huge and negative
numbers, unknown fields), a 10 MB body, a client that drips its body, one that
hangs up mid-body. Every answer is 200 or an OpenAI-format 4xx, never a 500, and
no generation slot is held by anyone who is not generating.

A real server (uvicorn in a thread) on a real engine and a real sidecar.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from srv_helpers import LiveServer

# Values of every JSON type, nested a little: what a confused or hostile client sends.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _SCALARS},
    optional={"content": st.text(max_size=60) | _JSON, "name": _JSON},
)
_FIELDS = {
    "model": st.sampled_from(["mini-gqa", "other"]) | _SCALARS,
    "max_tokens": st.integers(min_value=-5, max_value=4) | _SCALARS,
    "temperature": st.floats(min_value=-1, max_value=3) | _SCALARS,
    "top_p": _SCALARS,
    "seed": _SCALARS,
    "stop": _JSON,
    "stream": st.booleans() | _SCALARS,
    "stream_options": _JSON,
    "n": _SCALARS,
    "unknown_field": _JSON,
}
_CHAT = st.fixed_dictionaries(
    {}, optional={"messages": st.lists(_MESSAGE, max_size=3) | _JSON, **_FIELDS}
)
_COMPLETION = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=60) | st.lists(st.integers(-10, 10**10), max_size=6) | _JSON,
        **_FIELDS,
    },
)


@pytest.fixture(scope="module")
def fuzz_server(live_server_module: Callable[..., LiveServer]) -> LiveServer:
    return live_server_module(max_context_tokens=96, default_max_tokens=2, max_concurrency=2)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def _check(r: httpx.Response) -> None:
    assert r.status_code in {200, 400, 404, 413}, (r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["message"]


def _idle(srv: LiveServer) -> bool:
    return (
        srv.metric("dscache_server_inflight_requests") == 0
        and srv.metric("dscache_server_queue_depth") == 0
    )


_FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_FUZZ
@given(body=_CHAT)
def test_random_chat_bodies_get_200_or_an_openai_4xx(
    fuzz_server: LiveServer, http: httpx.Client, body: dict[str, Any]
) -> None:
    _check(http.post(fuzz_server.url + "/v1/chat/completions", json=body))
    assert _idle(fuzz_server)


@_FUZZ
@given(body=_COMPLETION | _JSON)
def test_random_completion_bodies_get_200_or_an_openai_4xx(
    fuzz_server: LiveServer, http: httpx.Client, body: Any
) -> None:
    _check(http.post(fuzz_server.url + "/v1/completions", json=body))
    assert _idle(fuzz_server)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=200))
def test_bytes_that_are_not_json_get_400(fuzz_server: LiveServer, raw: bytes) -> None:
    r = httpx.post(
        fuzz_server.url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    _check(r)


def test_a_10_mb_body_gets_413_and_the_server_goes_on(fuzz_server: LiveServer) -> None:
    url = fuzz_server.url + "/v1/chat/completions"
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (10 * 1024 * 1024) + b'"}]}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert ok.status_code == 200
    assert _idle(fuzz_server)


def _open_body(port: int, length: int) -> socket.socket:
    """A POST whose headers promise ``length`` body bytes, none of which are sent yet."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\n" + f"Content-Length: {length}\r\n\r\n".encode()
    )
    return s


def test_a_slow_client_holds_no_slot_and_one_that_hangs_up_leaks_nothing(
    live_server: Callable[..., LiveServer],
) -> None:
    srv = live_server(max_concurrency=1, max_queue=0, default_max_tokens=2)
    url = srv.url + "/v1/chat/completions"
    body = b'{"messages": [{"role": "user", "content": "hello there"}]}'
    slow = [_open_body(srv.port, len(body)) for _ in range(3)]
    try:
        # Three clients drip their bodies, a byte at a time: with one slot and no
        # queue, a normal request still gets the slot (nobody holds it while reading).
        for i in range(5):
            for s in slow:
                s.sendall(body[i : i + 1])
            r = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]}, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(0.05)
        # One finishes its body and is answered; the others hang up mid-body.
        slow[0].sendall(body[5:])
        assert slow[0].recv(12).startswith(b"HTTP/1.1 200")
    finally:
        for s in slow:
            s.close()
    # A hung-up request never ran: the one slot is free, nothing waits.
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]}, timeout=60)
    assert r.status_code == 200
    assert _idle(srv)
    assert srv.metric("dscache_server_requests_total", endpoint="chat", code="200") == 7
