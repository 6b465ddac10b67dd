"""Where a session lives (:mod:`dscache_server.sessions`): the pod's ledger, the lookup
the router replicas share, and the picker's ``/locate`` route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
from dscache_server.picker import Picker, PickerSettings
from dscache_server.pickerserve import create_app
from dscache_server.sessions import Located, SessionLedger, locate
from dscache_server.tokenizer import DeepSeekTokenizer
from fastapi.testclient import TestClient

from dscache.routing import prompt_mark, turn_marks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_ledger_remembers_a_session_until_its_ttl_and_within_its_bound() -> None:
    clock = Clock()
    ledger = SessionLedger(max_sessions=3, ttl_s=60.0, clock=clock)
    ledger.seen("a")
    clock.now += 10
    assert ledger.age("a") == 10.0 and ledger.age("b") is None
    ledger.seen(None)
    ledger.seen("x" * 1000)  # an overlong id is not recorded
    assert len(ledger) == 1
    for sid in ("b", "c", "d"):  # the least recent goes first
        ledger.seen(sid)
    assert ledger.age("a") is None and ledger.age("d") == 0.0
    clock.now += 61
    assert ledger.age("d") is None


def test_the_ledger_finds_the_latest_turn_it_served_among_a_conversations_marks() -> None:
    clock = Clock()
    ledger = SessionLedger(max_sessions=2, ttl_s=60.0, clock=clock)
    turns = [[1, 2, ASSISTANT], [1, 2, ASSISTANT, 5, 6, ASSISTANT]]
    ledger.served(turns[0])
    clock.now += 5
    marks = turn_marks([*turns[1], 7, 8, ASSISTANT], ASSISTANT)
    assert len(marks) == 3
    assert ledger.deepest(marks) == (0, 5.0)
    ledger.served(turns[1])
    assert ledger.deepest(marks) == (1, 0.0)
    assert ledger.deepest(marks[:1]) == (0, 5.0)
    assert ledger.deepest([prompt_mark([9])]) is None
    ledger.served([3])
    ledger.served([4])  # bounded: the least recent mark goes first
    assert ledger.deepest(marks) is None
    clock.now += 61
    assert ledger.deepest([prompt_mark([4])]) is None


ASSISTANT = 7777


def _pods(answers: dict[str, tuple[int, object]]) -> Callable[[httpx.Request], httpx.Response]:
    """A transport: each pod's (status, body) for POST /dscache/locate; a pod whose
    status is 404 with no in-flight count is an older one, answered on its GET route."""

    def handler(request: httpx.Request) -> httpx.Response:
        pod = f"{request.url.host}:{request.url.port}"
        assert request.headers["X-Dscache-Internal-Token"] == "t"
        if pod == "slow:1":
            raise httpx.ConnectTimeout("slow pod")
        status, body = answers[pod]
        if request.method == "GET":
            assert request.url.raw_path == b"/dscache/sessions/conv%2F7%20x"
            status, body = 200, {"age_s": 0.5, "inflight": 1}
        else:
            assert request.url.path == "/dscache/locate"
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(status, content=content)

    return handler


def _locate(
    answers: dict[str, tuple[int, object]], session: str | None, marks: list[bytes]
) -> Located:
    async def run() -> Located:
        transport = httpx.MockTransport(_pods(answers))
        async with httpx.AsyncClient(transport=transport) as client:
            pods = [*answers, "slow:1"]
            return await locate(
                client, pods, session, marks, headers={"X-Dscache-Internal-Token": "t"}
            )

    return asyncio.run(run())


def _answer(session_age: float | None, turn: int | None, turn_age: float | None, n: int) -> object:
    return {"session_age_s": session_age, "turn": turn, "turn_age_s": turn_age, "inflight": n}


def test_locate_prefers_the_sessions_pod_then_the_latest_turns_and_ignores_failing_pods() -> None:
    marks = turn_marks([1, ASSISTANT, 2, ASSISTANT, 3, ASSISTANT], ASSISTANT)
    answers: dict[str, tuple[int, object]] = {
        "a:1": (200, _answer(30.0, 2, 30.0, 2)),
        "b:1": (200, _answer(1.5, 0, 1.5, 0)),
        "c:1": (500, _answer(0.1, 2, 0.1, 9)),
        "d:1": (200, _answer(None, 2, 3.0, 4)),
        "e:1": (200, b"not json"),
        "f:1": (200, _answer(None, 9, 0.1, 1)),  # an index it was not sent: ignored
    }
    found = _locate(answers, "conv/7 x", marks)
    assert (found.pod, found.by) == ("b:1", "session")  # the session's own pod, latest
    assert found.inflight == {"a:1": 2, "b:1": 0, "d:1": 4, "f:1": 1}
    # Without the id (or no pod knows it): the pod that served the latest turn, of two
    # the more recent.
    found = _locate(answers, None, marks)
    assert (found.pod, found.by) == ("d:1", "shared")  # a:1 served that turn too
    alone = _locate({"b:1": answers["b:1"], "d:1": answers["d:1"]}, None, marks)
    assert (alone.pod, alone.by) == ("d:1", "turn")
    nobody = {"a:1": (200, _answer(None, None, None, 0))}
    assert _locate(nobody, "conv/7 x", marks) == Located(inflight={"a:1": 0})


def test_locate_asks_an_older_pod_for_the_session_on_its_get_route() -> None:
    old = {"old:1": (404, {"detail": "Not Found"})}
    found = _locate(old, "conv/7 x", [])
    assert (found.pod, found.by, found.inflight) == ("old:1", "session", {"old:1": 1})
    assert _locate(old, None, [prompt_mark([1])]).pod is None  # it knows no turns


def test_the_pickers_locate_route_refuses_a_bad_query_and_answers_404_when_no_pod_knows() -> None:
    picker = Picker(PickerSettings(locate_timeout_s=0.5), DeepSeekTokenizer())
    with TestClient(create_app(picker)) as client:
        for query in ("", "?key=s", "?pods=127.0.0.1:1", "?key=s&pods=evil.example/x:80"):
            assert client.get("/locate" + query).status_code == 400, query
        # Nothing listens there: no pod knows the session, nor the conversation.
        assert client.get("/locate?key=s&pods=127.0.0.1:1").status_code == 404
        chat = {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"},
            ]
        }
        assert client.post("/locate?pods=127.0.0.1:1", json=chat).status_code == 404
        assert client.post("/locate?pods=127.0.0.1:1", content=b"[]").status_code == 404
        text = client.get("/metrics").text
    # The first turn's mark, not the request's own (a prompt sent again is not a turn).
    assert len(picker.turn_marks(json.dumps(chat).encode())) == 1
    assert picker.turn_marks(b"{not json") == []
    assert 'dscache_picker_locates_total{result="failed"} 4.0' in text
    assert 'dscache_picker_locates_total{result="unknown"} 3.0' in text
