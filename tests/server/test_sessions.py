"""Where a session lives (:mod:`dscache_router.locate`): the pod's ledger, the lookup
the router replicas share, and the picker's ``/locate`` route."""

from __future__ import annotations

import asyncio
import json

import httpx
from dscache_router.locate import locate
from dscache_router.picker import Picker, PickerSettings
from dscache_router.serve import create_app
from dscache_server.tokenizer import DeepSeekTokenizer
from fastapi.testclient import TestClient

from dscache.routing import SessionLedger, answered_key, conversation_key, previous_turn_keys


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


def test_locate_takes_the_pod_that_served_the_session_last_and_ignores_failing_pods() -> None:
    answers = {
        "a:1": (200, {"age_s": 30.0, "inflight": 2}),
        "b:1": (200, {"age_s": 1.5, "inflight": 0}),
        "c:1": (500, {"age_s": 0.1, "inflight": 9}),
        "d:1": (404, {"inflight": 4}),
        "e:1": (200, b"not json"),
    }
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        pod = f"{request.url.host}:{request.url.port}"
        asked.append(request.url.raw_path.decode())
        assert request.headers["X-Dscache-Internal-Token"] == "t"
        if pod == "f:1":
            raise httpx.ConnectTimeout("slow pod")
        status, body = answers[pod]
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(status, content=content)

    async def run() -> tuple[str | None, dict[str, int]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            pods = [*answers, "f:1"]
            return await locate(client, pods, "conv/7 x", {"X-Dscache-Internal-Token": "t"})

    pod, inflight = asyncio.run(run())
    assert pod == "b:1"
    assert inflight == {"a:1": 2, "b:1": 0, "d:1": 4}
    assert set(asked) == {"/dscache/sessions/conv%2F7%20x"}  # the id is one path segment


def test_the_pickers_locate_route_refuses_a_bad_query_and_answers_404_when_no_pod_knows() -> None:
    picker = Picker(PickerSettings(locate_timeout_s=0.5), DeepSeekTokenizer())
    with TestClient(create_app(picker)) as client:
        for query in ("", "?key=s", "?pods=127.0.0.1:1", "?key=s&pods=evil.example/x:80"):
            assert client.get("/locate" + query).status_code == 400, query
        # Nothing listens there: no pod knows the session.
        assert client.get("/locate?key=s&pods=127.0.0.1:1").status_code == 404
        text = client.get("/metrics").text
    assert 'dscache_picker_locates_total{result="failed"} 4.0' in text
    assert 'dscache_picker_locates_total{result="unknown"} 1.0' in text


def test_a_conversation_key_is_its_messages_roles_and_contents_and_nothing_else() -> None:
    turn = [
        {"role": "system", "content": "Desk 3."},
        {"role": "user", "content": "Revenue?"},
        {"role": "assistant", "content": "Up 6%.", "refusal": None},
        {"role": "user", "content": "Why?"},
    ]
    # The previous turn's keys: its messages with the answer they got (as the pod
    # that answered records them; the answer's other fields do not matter), then the
    # request alone.
    assert previous_turn_keys(turn) == (
        answered_key(turn[:2], "Up 6%."),
        conversation_key(turn[:2]),
    )
    assert answered_key(turn[:2], "Up 6%.") == conversation_key(turn[:3])
    assert answered_key(turn[:2], "Up 7%.") != conversation_key(turn[:3])
    # Other fields and key order do not matter; a role or a character does.
    same = [{"content": m["content"], "role": m["role"], "name": "x"} for m in turn[:2]]
    assert conversation_key(same) == conversation_key(turn[:2])
    swapped = [{"role": "user", "content": "Desk 3."}, turn[1]]
    assert conversation_key(swapped) != conversation_key(turn[:2])
    assert conversation_key([turn[0], {"role": "user", "content": "Revenue!"}]) != (
        conversation_key(turn[:2])
    )
    # Split differently, the same text is another conversation.
    merged = [{"role": "system", "content": "Desk 3.Revenue?"}]
    assert conversation_key(merged) != conversation_key(turn[:2])
    # No previous turn (a first turn, or an assistant message first); not messages.
    assert previous_turn_keys(turn[:2]) == ()
    assert previous_turn_keys([turn[2], turn[3]]) == ()
    assert conversation_key(["text"]) is None and previous_turn_keys("text") == ()
    assert answered_key("text", "Up 6%.") is None
