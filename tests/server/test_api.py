"""The HTTP API against the real `openai` client, the real sidecar and a small model."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from dscache_server.app import create_app
from dscache_server.prewarm import prewarm
from dscache_server.runtime import Runtime
from dscache_server.tokenizer import DeepSeekTokenizer
from fastapi.testclient import TestClient
from srv_helpers import LiveServer, make_runtime, random_text, read_chats
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from dscache.cli import main


def client(srv: LiveServer, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=srv.url + "/v1", api_key="test-key", max_retries=0, default_headers=headers
    )


def wait_stored(srv: LiveServer) -> None:
    assert srv.runtime.cache.wait_stored(30)


def test_chat_second_turn_reuses_the_first_turns_prefix(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server()
    c = client(srv, **{"X-Session-ID": "s-chat"})
    history = [
        {"role": "system", "content": random_text(tokenizer, 120, seed=1)},
        {"role": "user", "content": "Summarise the filing."},
    ]
    first = c.chat.completions.create(model="mini-gqa", messages=history, max_tokens=4)
    assert first.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    wait_stored(srv)

    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And the risks?"},
    ]
    raw = c.chat.completions.with_raw_response.create(
        model="mini-gqa", messages=history, max_tokens=4
    )
    assert raw.headers["x-session-id"] == "s-chat"
    second = raw.parse()
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    # Every full block of turn one's prompt is reused (the last token never is).
    assert cached >= (first.usage.prompt_tokens - 1) // 32 * 32 > 0
    assert srv.metric("dscache_server_cache_hits_total", level="session") == 1.0
    assert srv.metric("dscache_server_prompt_tokens_total", source="reused") == cached


def test_streaming_chat_and_completions(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server()
    c = client(srv)
    messages = [{"role": "user", "content": random_text(tokenizer, 100, seed=2)}]
    pieces: list[str] = []
    usage = None
    finish = None
    stream = c.chat.completions.create(
        model="mini-gqa",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens == 6
    assert finish == "length"
    whole = c.chat.completions.create(
        model="mini-gqa", messages=messages, max_tokens=6, temperature=0
    )
    # Greedy: streaming and non-streaming produce the same text.
    assert "".join(pieces) == whole.choices[0].message.content
    wait_stored(srv)

    prompt = random_text(tokenizer, 100, seed=3)
    first = c.completions.create(model="mini-gqa", prompt=prompt, max_tokens=3)
    assert first.usage is not None and first.choices[0].finish_reason in ("length", "stop")
    wait_stored(srv)
    texts = [
        ch.choices[0].text
        for ch in c.completions.create(
            model="mini-gqa", prompt=prompt + " more", max_tokens=3, stream=True
        )
        if ch.choices
    ]
    assert isinstance("".join(texts), str)
    again = c.completions.create(model="mini-gqa", prompt=prompt + " more", max_tokens=3)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 64


def test_answers_report_where_their_time_went(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    """Every answer carries ``timings`` (seconds per phase), streamed or not, and the
    same phases go to ``dscache_server_request_phase_seconds``; the second turn's
    lookup reads the sidecar's index directly (no RPC)."""
    srv = live_server()
    text = random_text(tokenizer, 150, seed=12)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 3}
    whole = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    phases = {"tokenize", "queue", "lookup", "lease", "map_verify", "prefill", "ttft"}
    assert phases <= whole["timings"].keys()
    assert whole["timings"]["prefill"] > 0
    wait_stored(srv)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=stream_body, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    t = last["timings"]
    assert phases <= t.keys()
    path = sum(t[p] for p in ("tokenize", "queue", "lookup", "lease", "map_verify", "prefill"))
    assert path <= t["ttft"] + 1e-3
    assert srv.metric("dscache_server_request_phase_seconds_count", phase="prefill") == 2
    assert srv.metric("dscache_server_request_phase_seconds_count", phase="store") >= 1
    assert srv.metric("dscache_server_cache_lookups_total", path="direct") >= 1
    assert srv.metric("dscache_server_cache_lookups_total", path="rpc") == 0


def test_models_health_ready_metrics(live_server: Callable[..., LiveServer]) -> None:
    srv = live_server()
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["mini-gqa"]
    assert httpx.get(srv.url + "/health").status_code == 200
    ready = httpx.get(srv.url + "/ready")
    assert ready.status_code == 200 and ready.json()["cache"] == "enabled"
    text = httpx.get(srv.url + "/metrics").text
    assert "dscache_server_ttft_seconds" in text
    assert "dscache_server_cache_fallbacks_total" in text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
            "stop",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "x"}, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(
    live_server: Callable[..., LiveServer], body: dict[str, object], param: str
) -> None:
    srv = live_server()
    r = httpx.post(srv.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_malformed_json_unknown_model_oversize(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server(max_context_tokens=256, max_request_bytes=64 * 1024)
    url = srv.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, json=[1, 2])
    assert r.status_code == 400
    r = httpx.post(url, json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    long = random_text(tokenizer, 300, seed=4)
    with pytest.raises(openai.BadRequestError) as exc:
        client(srv).chat.completions.create(
            model="mini-gqa", messages=[{"role": "user", "content": long}]
        )
    assert exc.value.code == "context_length_exceeded"
    r = httpx.post(url, content=b"x" * (70 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [10**9]})
    assert r.status_code == 400
    assert srv.metric("dscache_server_requests_total", endpoint="chat", code="400") >= 3


def test_full_queue_answers_429_with_retry_after(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server(max_concurrency=1, max_queue=1)
    body = {
        "messages": [{"role": "user", "content": random_text(tokenizer, 20, seed=5)}],
        "max_tokens": 12,
    }

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as ac:
            tasks = [ac.post(srv.url + "/v1/chat/completions", json=body) for _ in range(4)]
            return list(await asyncio.gather(*tasks))

    codes = sorted(r.status_code for r in asyncio.run(burst()))
    assert codes[0] == 200
    assert 429 in codes
    limited = [r for r in asyncio.run(burst()) if r.status_code == 429]
    for r in limited:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"


def test_one_sessions_requests_are_not_reordered(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server(max_concurrency=2, max_queue=8)
    done: list[int] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as ac:

            async def send(i: int, n: int) -> None:
                r = await ac.post(
                    srv.url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": f"turn {i}"}], "max_tokens": n},
                    headers={"X-Session-ID": "ordered"},
                )
                assert r.status_code == 200
                done.append(i)

            # The first turn is the slowest; with two slots it would finish last
            # unless the session keeps its order.
            tasks = []
            for i, n in enumerate((12, 1, 1)):
                tasks.append(asyncio.create_task(send(i, n)))
                await asyncio.sleep(0.05)
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert done == [0, 1, 2]


def test_session_header_is_echoed_on_errors_and_streams(
    live_server: Callable[..., LiveServer],
) -> None:
    srv = live_server()
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": []},
        headers={"X-Session-ID": "abc"},
    )
    assert r.headers["x-session-id"] == "abc"
    with httpx.stream(
        "POST",
        srv.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2},
        headers={"X-Session-ID": "abc"},
    ) as resp:
        assert resp.headers["x-session-id"] == "abc"
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_prewarm_command_stores_prefixes(
    live_server: Callable[..., LiveServer], prompts_file: Callable[..., Path], tmp_path: Path
) -> None:
    srv = live_server()
    prompts = prompts_file(seed=50, n=2)
    assert main(["prewarm", "--target", srv.url, "--prompts", str(prompts)]) == 0
    wait_stored(srv)
    again = prewarm(srv.url, read_chats(prompts), progress=False)
    assert again.sent == 2 and again.failed == 0
    assert again.cached_tokens >= 2 * 64
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["prewarm", "--target", srv.url, "--prompts", str(bad)]) == 2


def test_a_stream_the_client_abandons_gives_back_its_slot(
    live_server: Callable[..., LiveServer],
) -> None:
    srv = live_server(max_concurrency=1, max_queue=0)
    url = srv.url + "/v1/chat/completions"
    # Greedy on this prompt, the small model runs to the length limit (no EOS).
    long = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 4000,
        "temperature": 0,
    }
    with httpx.stream("POST", url, json=long, timeout=60) as resp:
        assert resp.status_code == 200
        events = resp.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(events).startswith("data: ")  # generating now, holding the only slot
        busy = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]})
        assert busy.status_code == 429
    # The client went away: the slot comes back without the 4000 tokens being generated.
    poll = Retrying(
        stop=stop_after_delay(30),
        wait=wait_fixed(0.1),
        retry=retry_if_result(lambda code: code != 200),
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else 0,
    )
    short = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert poll(lambda: httpx.post(url, json=short, timeout=60).status_code) == 200
    assert srv.metric("dscache_server_generated_tokens_total") < 4000


@pytest.mark.slow
def test_not_ready_until_the_loader_has_run(tokenizer: DeepSeekTokenizer) -> None:
    loaded = threading.Event()

    def loader() -> Runtime:
        assert loaded.wait(60)
        return make_runtime(None, tokenizer)

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(create_app(loader=loader)) as c:
        assert c.get("/health").status_code == 200
        ready = c.get("/ready")
        assert (ready.status_code, ready.json()["status"]) == (503, "loading")
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "not_ready"
        loaded.set()
        poll = Retrying(
            stop=stop_after_delay(60),
            wait=wait_fixed(0.1),
            retry=retry_if_result(lambda code: code != 200),
        )
        assert poll(lambda: c.get("/ready").status_code) == 200
        assert c.get("/ready").json()["cache"] == "disabled"
        assert c.post("/v1/chat/completions", json=chat).status_code == 200


def test_a_failed_load_is_reported_by_ready() -> None:
    def loader() -> Runtime:
        raise ValueError("no such model")

    with TestClient(create_app(loader=loader)) as c:
        poll = Retrying(
            stop=stop_after_delay(30),
            wait=wait_fixed(0.05),
            retry=retry_if_result(lambda status: status == "loading"),
        )
        assert poll(lambda: c.get("/ready").json()["status"]) == "ValueError: no such model"
        r = c.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["message"] == "ValueError: no such model"
