"""vLLM pods in the routing protocol (``dscache_vllm.ledger``): the session ledger the
router pods' pickers ask, and the in-flight count on every answer.

The app inside is a small FastAPI app standing in for vLLM's OpenAI server (the
middleware sees only ASGI); ``tests/vllm/test_serve.py`` runs the middleware in a
real ``dscache vllm serve``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from dscache_router.locate import locate
from dscache_vllm.ledger import CHAT_PATH, SessionLedgerMiddleware, write_keyinfo
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from dscache.routing import (
    CONVERSATIONS_PATH,
    INFLIGHT_HEADER,
    KEYINFO_PATH,
    SESSIONS_PATH,
    SessionLedger,
    answered_key,
    conversation_key,
    previous_turn_keys,
)

TOKEN = "internal-secret"


def vllm_like(release: asyncio.Event | None = None) -> FastAPI:
    """Answers chat completions (a stream when asked, held open until ``release``),
    refuses a model it does not serve, and has /health and /metrics."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, object]) -> object:
        if body.get("model") != "m":
            raise HTTPException(404, "no such model")
        finish = str(body.get("finish", "stop"))  # what the answer ends with
        if body.get("stream"):

            async def chunks() -> AsyncIterator[bytes]:
                # As vLLM streams: the role first, two deltas in one write, an event
                # split over two writes, the finish reason in a chunk of its own.
                yield chunk({"role": "assistant", "content": ""}, None)
                yield chunk({"content": "o"}, None) + chunk({"content": "k"}, None)
                split = chunk({"content": " then"}, None)
                yield split[:20]
                yield split[20:]
                if release is not None:
                    await release.wait()
                yield chunk({}, finish)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        message = {"role": "assistant", "content": "ok"}
        return {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, object]) -> dict[str, object]:
        return {"kv_transfer_params": body.get("kv_transfer_params")}  # what vLLM got

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def chunk(delta: dict[str, str], finish: str | None) -> bytes:
    """One event of a chat completion stream, as vLLM writes it."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return (
        b"data: "
        + json.dumps({"object": "chat.completion.chunk", "choices": [choice]}).encode()
        + b"\n\n"
    )


def client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pod")  # type: ignore[arg-type]


def chat(session: str | None, model: str = "m") -> dict[str, object]:
    headers = {"X-Session-ID": session} if session else {}
    return {"json": {"model": model, "messages": []}, "headers": headers}


async def test_a_served_session_is_known_and_a_refused_one_is_not() -> None:
    clock = [100.0]
    ledger = SessionLedger(clock=lambda: clock[0])
    app = SessionLedgerMiddleware(vllm_like(), internal_token=TOKEN, ledger=ledger)
    auth = {"X-Dscache-Internal-Token": TOKEN}
    async with client(app) as c:
        ok = await c.post("/v1/chat/completions", **chat("s-1"))  # type: ignore[arg-type]
        assert ok.status_code == 200 and ok.headers[INFLIGHT_HEADER] == "1"
        refused = await c.post("/v1/chat/completions", **chat("s-2", model="other"))  # type: ignore[arg-type]
        assert refused.status_code == 404 and refused.headers[INFLIGHT_HEADER] == "1"
        clock[0] += 7.5
        known = await c.get(SESSIONS_PATH + "s-1", headers=auth)
        assert known.status_code == 200 and known.json() == {"age_s": 7.5, "inflight": 0}
        unknown = await c.get(SESSIONS_PATH + "s-2", headers=auth)
        assert unknown.status_code == 404 and unknown.json() == {"inflight": 0}
        # Other routes pass through untouched.
        health = await c.get("/health")
        assert health.json() == {"status": "ok"} and INFLIGHT_HEADER not in health.headers


async def test_the_ledger_needs_the_internal_token_when_one_is_set() -> None:
    app = SessionLedgerMiddleware(vllm_like(), internal_token=TOKEN)
    async with client(app) as c:
        await c.post("/v1/chat/completions", **chat("s-1"))  # type: ignore[arg-type]
        for headers in ({}, {"X-Dscache-Internal-Token": "guess"}):
            r = await c.get(SESSIONS_PATH + "s-1", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token"
        assert (await c.get(SESSIONS_PATH + "s-1")).status_code == 401
    open_app = SessionLedgerMiddleware(vllm_like(), internal_token="")
    async with client(open_app) as c:
        await c.post("/v1/chat/completions", **chat("s-1"))  # type: ignore[arg-type]
        assert (await c.get(SESSIONS_PATH + "s-1")).status_code == 200


async def test_a_stream_counts_as_in_flight_until_its_last_byte() -> None:
    release = asyncio.Event()
    app = SessionLedgerMiddleware(vllm_like(release), internal_token="")
    async with client(app) as c:
        body = {"model": "m", "messages": [], "stream": True}

        async def stream() -> str:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                first = r.headers[INFLIGHT_HEADER]
                async for _ in r.aiter_bytes():
                    pass
                return first

        streaming = asyncio.create_task(stream())
        while app.inflight == 0:
            await asyncio.sleep(0.01)
        second = await c.post("/v1/chat/completions", **chat(None))  # type: ignore[arg-type]
        assert second.headers[INFLIGHT_HEADER] == "2"  # the open stream and itself
        answer = (await c.get(SESSIONS_PATH + "nobody")).json()
        assert answer == {"inflight": 1}
        release.set()
        assert await streaming == "1"
        assert app.inflight == 0


async def test_the_picker_finds_the_vllm_pod_that_served_a_session() -> None:
    pods = {
        name: SessionLedgerMiddleware(vllm_like(), internal_token=TOKEN)
        for name in ("a:8000", "b:8000")
    }
    async with client(pods["b:8000"]) as c:
        await c.post("/v1/chat/completions", **chat("conv-7"))  # type: ignore[arg-type]

    async def route(request: httpx.Request) -> httpx.Response:
        app = pods[f"{request.url.host}:{request.url.port}"]
        async with client(app) as c:
            r = await c.get(request.url.path, headers=dict(request.headers))
            return httpx.Response(r.status_code, content=r.content, headers=r.headers)

    async with httpx.AsyncClient(transport=httpx.MockTransport(route)) as picker:
        auth = {"X-Dscache-Internal-Token": TOKEN}
        where, inflight = await locate(picker, list(pods), "conv-7", auth)
        assert where == "b:8000" and inflight == {"a:8000": 0, "b:8000": 0}
        assert (await locate(picker, list(pods), "conv-8", auth))[0] is None


@pytest.mark.parametrize("session", ["x" * 257, ""])
async def test_an_overlong_or_empty_session_id_is_not_recorded(session: str) -> None:
    app = SessionLedgerMiddleware(vllm_like(), internal_token="")
    async with client(app) as c:
        await c.post("/v1/chat/completions", **chat(session))  # type: ignore[arg-type]
    assert len(app.ledger) == 0


async def test_the_key_info_is_served_once_the_connector_wrote_it(tmp_path: Path) -> None:
    path = tmp_path / "server.keyinfo"
    app = SessionLedgerMiddleware(vllm_like(), internal_token=TOKEN, keyinfo_file=str(path))
    auth = {"X-Dscache-Internal-Token": TOKEN}
    async with client(app) as c:
        loading = await c.get(KEYINFO_PATH, headers=auth)
        assert loading.status_code == 503 and loading.json() == {"status": "loading"}
        write_keyinfo(str(path), model="m", block_tokens=256, fingerprint="ab" * 32, root="cd" * 32)
        assert (await c.get(KEYINFO_PATH)).status_code == 401
        info = (await c.get(KEYINFO_PATH, headers=auth)).json()
        assert info == {
            "model": "m",
            "block_tokens": 256,
            "fingerprint": "ab" * 32,
            "root": "cd" * 32,
        }
        path.unlink()  # read once: the facts of a running engine do not change
        assert (await c.get(KEYINFO_PATH, headers=auth)).json() == info
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left behind


async def test_the_next_turn_header_reaches_the_connector_in_kv_transfer_params() -> None:
    app = SessionLedgerMiddleware(vllm_like(), internal_token="")
    async with client(app) as c:
        for value, kind in (("ended", "ended"), (" Expected ", "expected")):
            r = await c.post(
                "/v1/completions",
                json={"prompt": "hi", "kv_transfer_params": {"other": 1}},
                headers={"X-Dscache-Next-Turn": value},
            )
            assert r.json() == {"kv_transfer_params": {"other": 1, "dscache_next_turn": kind}}
        plain = await c.post("/v1/completions", json={"prompt": "hi"})
        assert plain.json() == {"kv_transfer_params": None}  # no header: untouched
        bad = await c.post(
            "/v1/completions", json={"prompt": "hi"}, headers={"X-Dscache-Next-Turn": "soon"}
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_next_turn"
        assert app.inflight == 0
        # Not a JSON object: vLLM gets it as it was sent, and answers it.
        raw = await c.post(
            "/v1/completions",
            content=b"[1, 2]",
            headers={"X-Dscache-Next-Turn": "ended", "content-type": "application/json"},
        )
        assert raw.status_code == 422


async def test_a_public_chat_is_in_the_conversation_ledger_and_a_tenants_is_not() -> None:
    app = SessionLedgerMiddleware(vllm_like(), internal_token=TOKEN)
    auth = {"X-Dscache-Internal-Token": TOKEN}
    first = [{"role": "user", "content": "Revenue by segment?"}]
    mine = [{"role": "user", "content": "My own question."}]
    key, theirs = conversation_key(first), conversation_key(mine)
    assert key is not None and theirs is not None
    async with client(app) as c:
        ok = await c.post("/v1/chat/completions", json={"model": "m", "messages": first})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"
        # With credentials (a tenant's; the picker keys only public requests): not
        # recorded; refused by vLLM: not recorded.
        await c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": mine},
            headers={"Authorization": "Bearer sk-1"},
        )
        refused = await c.post("/v1/chat/completions", json={"model": "x", "messages": mine})
        assert refused.status_code == 404
        assert (await c.get(CONVERSATIONS_PATH + key)).status_code == 401  # the picker's
        assert (await c.get(CONVERSATIONS_PATH + key, headers=auth)).status_code == 200
        assert (await c.get(CONVERSATIONS_PATH + theirs, headers=auth)).status_code == 404
        # The next turn, its answer sent back as it was given, finds this pod by both
        # keys the picker asks: the messages with the answer, and without.
        nxt = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Why?"}]
        keys = previous_turn_keys(nxt)
        assert keys == (answered_key(first, "ok"), key)
        for asked in keys:
            pod, _ = await locate(c, ["pod"], asked, auth, path=CONVERSATIONS_PATH)
            assert pod == "pod"
        # The body reached vLLM whole, and with a next-turn header, changed as before.
        r = await c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": nxt},
            headers={"X-Dscache-Next-Turn": "ended"},
        )
        assert r.status_code == 200
        assert (
            await c.get(CONVERSATIONS_PATH + str(conversation_key(nxt)), headers=auth)
        ).status_code == 200
        assert app.inflight == 0


async def sent(app: SessionLedgerMiddleware, body: dict[str, Any], key: str | None) -> list[bool]:
    """Calls ``app`` (ASGI, as a server would) with a public chat request: for each
    piece of the answer's body as it is sent, whether ``key`` was in the pod's
    conversation ledger by then, and its bytes."""
    pieces: list[tuple[bytes, bool]] = []
    raw = json.dumps(body).encode()
    delivered = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if not delivered.is_set():
            delivered.set()
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client stays until the answer ends
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            known = key is not None and app.conversations.age(key) is not None
            pieces.append((bytes(message.get("body", b"")), known))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT_PATH,
        "raw_path": CHAT_PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("pod", 80),
    }
    await app(scope, receive, send)
    return [known for data, known in pieces if data]


async def test_an_answer_is_recorded_with_its_messages_before_it_finishes_reaching_the_client() -> (
    None
):
    # Two users open alike; only the answers they got tell their next turns apart.
    app = SessionLedgerMiddleware(vllm_like(), internal_token="")
    opening = [{"role": "user", "content": "Revenue by segment?"}]
    streamed = {"model": "m", "messages": opening, "stream": True}
    # Unknown while the answer streams (a client that stopped reading has no answer
    # to send back), known from the piece that ends it, before [DONE].
    known = await sent(app, streamed, answered_key(opening, "ok then"))
    assert known == [False, False, False, False, True, True]
    assert app.conversations.age(str(answered_key(opening, "ok"))) is None
    # A JSON answer: known before its body is sent, with the message's content.
    again = [{"role": "user", "content": "And costs?"}]
    assert await sent(app, {"model": "m", "messages": again}, answered_key(again, "ok")) == [True]
    # An answer cut short (aborted, failed) is no answer the client sends back: only
    # the request's own key is known.
    cut = [{"role": "user", "content": "Margins?"}]
    for finish in ("abort", "error"):
        body = {"model": "m", "messages": cut, "finish": finish}
        assert set(await sent(app, {**body, "stream": True}, answered_key(cut, "ok then"))) == {
            False
        }
        assert await sent(app, body, answered_key(cut, "ok")) == [False]
    assert app.conversations.age(str(conversation_key(cut))) is not None
