"""Router replicas that agree: two real NGINX routers, each with its own picker, in front
of the same real model servers, as two router pods behind one Service.

What a user notices: whichever replica a conversation's next turn reaches, it goes to
the pod that served the conversation (so its history is there), on the track it
started on, even when that replica started after the conversation did, or never saw
it and would have placed it elsewhere; and so does a turn that lost its session id
on the way (a gateway that drops the header), placed by what the pods hold. (Each replica's load bound counting the
other replicas' requests: ``test_router_balance``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dscache_router.ring import Ring
from dscache_tools.demo.stack import LocalStack, Router, StackOptions
from dscache_tools.polling import poll
from needs import need_nginx
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import scrape

from dscache import metricnames as names

pytestmark = pytest.mark.slow

WORDS = ["ledger", "accrual", "covenant", "dividend", "margin", "liquidity", "tranche", "hedge"]


def document(seed: int, words: int = 300) -> str:
    return " ".join(
        f"{WORDS[(seed * 5 + i * i) % len(WORDS)]}{(seed + i) % 89}" for i in range(words)
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    need_nginx()
    workdir: Path = tmp_path_factory.mktemp("replicas-e2e")
    with LocalStack(workdir, StackOptions(model="mini-gqa", threads=1)) as st:
        # Each with its sidecar: the pickers learn what every pod holds from its filter.
        stable = st.start_servers(2, cache=True)
        canary = st.start_servers(1, cache=True)
        st.start_router(stable, canary, routing="kv", session_memory_s=600)
        st.start_router_replica()
        yield st


def _turn(
    router: Router,
    text: str,
    session: str | None,
    headers: dict[str, str] | None = None,
    max_tokens: int = 2,
) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    sent = {**(headers or {}), **({"X-Session-ID": session} if session else {})}
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, headers=sent, timeout=300)
    assert resp.status_code == 200, resp.text
    # The pod's own load report is the routers' business, not the client's.
    assert "x-dscache-inflight" not in resp.headers
    return resp


def _results(router: Router, counter: str) -> dict[str, float]:
    """The router's ``counter`` by its ``result`` label."""
    samples = scrape(router.port)
    family = counter + "_total"
    return {dict(labels)["result"]: v for (name, labels), v in samples.items() if name == family}


def _locates(router: Router) -> dict[str, float]:
    return _results(router, names.ROUTER_LOCATES)


def test_a_session_keeps_its_track_on_a_replica_started_after_the_weight_changed(
    stack: LocalStack,
) -> None:
    a = stack.router
    assert a is not None
    stack.set_canary_weight(0)
    first = _turn(a, document(1), "track-1")
    assert first.headers["X-Dscache-Track"] == "stable"
    pod = first.headers["X-Dscache-Upstream"]
    stack.set_canary_weight(100)  # every new session now takes the canary
    late = stack.start_router_replica()  # scale-out: it has seen nothing
    second = _turn(late, document(1) + " And the risks?", "track-1")
    assert (second.headers["X-Dscache-Track"], second.headers["X-Dscache-Upstream"]) == (
        "stable",
        pod,
    )
    # The weight still places new sessions on that replica.
    assert _turn(late, document(2), "track-2").headers["X-Dscache-Track"] == "canary"
    assert _locates(late)["found"] >= 1


def test_a_session_placed_by_one_replicas_memory_stays_on_its_pod_through_the_other(
    stack: LocalStack,
) -> None:
    a, b = stack.router, stack.replicas[0]
    assert a is not None
    stack.set_canary_weight(0)
    # Replica a sees a request without a session first: its picker remembers it.
    seen = _turn(a, document(7), None)
    similar_pod = seen.headers["X-Dscache-Upstream"]
    stable = [s.address for s in stack.servers[:2]]
    # A session whose own hash names the other stable pod, with a credential (so no
    # replica matches cached prefixes: only a's memory of the similar request places
    # it on similar_pod).
    session = next(
        f"sim-{i}" for i in range(1000) if Ring(stable).walk(f"sim-{i}")[0] != similar_pod
    )
    key = {"Authorization": "Bearer any"}
    first = _turn(a, "Note. " + document(7), session, key)
    assert first.headers["X-Dscache-Upstream"] == similar_pod
    before = _locates(b)["found"]
    for turn in range(3):  # b never saw it: it asks the pods, then remembers
        resp = _turn(b, "Note. " + document(7) + f" Question {turn}?", session, key)
        assert resp.headers["X-Dscache-Upstream"] == similar_pod, turn
    assert _locates(b)["found"] == before + 1


def _chat(router: Router, messages: list[dict[str, str]], session: str | None) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 2, "temperature": 0.0}
    headers = {"X-Session-ID": session} if session else {}
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp


def _holders(router: Router) -> dict[str, float]:
    return _results(router, names.ROUTER_HOLDERS)


def _opening(desk: int) -> list[dict[str, str]]:
    """How every conversation of a desk opens (a shared document)."""
    return [
        {"role": "system", "content": f"Analyst desk {desk}."},
        {"role": "user", "content": document(desk)},
    ]


def _next_turn(
    history: list[dict[str, str]], answer: httpx.Response, question: str
) -> list[dict[str, str]]:
    """The conversation's next turn, its answer sent back as it was given."""
    content = answer.json()["choices"][0]["message"]["content"]
    return [
        *history,
        {"role": "assistant", "content": content},
        {"role": "user", "content": question},
    ]


def test_a_turn_without_its_id_follows_its_conversation_through_another_replica(
    stack: LocalStack,
) -> None:
    a, b = stack.router, stack.replicas[0]
    assert a is not None and b.picker is not None
    stack.set_canary_weight(0)
    # Every conversation of this desk opens the same way (a shared document: what a
    # prompt key stands for); this one went on past it on one replica, with its id.
    opening = _opening(31)
    history = [
        *opening,
        {"role": "assistant", "content": document(131, 150)},
        {"role": "user", "content": "And the covenants? " + document(231, 150)},
    ]
    first = _chat(a, history, "desk-31")
    assert first.headers["X-Dscache-Track"] == "stable"
    pod = first.headers["X-Dscache-Upstream"]
    nxt = _next_turn(history, first, "Which tranche is at risk?")
    # Its pod's sidecar publishes the history's blocks; b's picker fetches the filter.
    pods = ",".join(s.address for s in stack.servers)
    picker = f"http://{b.picker}/holder"

    def known() -> bool:
        r = httpx.post(picker, params={"pods": pods, "lead": "2"}, json={"messages": nxt})
        return r.status_code == 200 and r.text == pod

    assert poll(known, timeout=60), "b's picker never learned where the history is"
    stack.set_canary_weight(100)  # every new conversation now takes the canary
    # A new conversation of the desk reaches b first: its opening is held on the
    # stable pod, but nothing of it past the opening, so it follows the weight (and b
    # now remembers the desk's opening on the canary).
    fresh = [*opening, {"role": "user", "content": "Summarise the filing."}]
    assert _chat(b, fresh, None).headers["X-Dscache-Track"] == "canary"
    before = _holders(b).get("found", 0)
    # The next turn reaches b without its id (a gateway dropped it): b keys it by its
    # opening, which it remembers on the canary; it still goes where its history is.
    resp = _chat(b, nxt, None)
    assert resp.headers["X-Dscache-Key-Source"] == "prompt"
    assert (resp.headers["X-Dscache-Track"], resp.headers["X-Dscache-Upstream"]) == ("stable", pod)
    assert _holders(b)["found"] == before + 1


def test_a_short_turn_without_its_id_goes_where_its_previous_turn_went(
    stack: LocalStack,
) -> None:
    # A conversation of short turns: its answer and next question fit in the last
    # block, which no pod stores whole, so past the shared opening the pods hold
    # nothing that tells where it went. The pods' conversation ledgers do.
    a, b = stack.router, stack.replicas[0]
    assert a is not None and b.picker is not None
    stack.set_canary_weight(0)
    opening = _opening(47)
    first = _chat(a, opening, None)  # no id, a first turn: the weight places it
    assert first.headers["X-Dscache-Track"] == "stable"
    pod = first.headers["X-Dscache-Upstream"]
    stack.set_canary_weight(100)  # a new conversation would now take the canary
    nxt = _next_turn(opening, first, "Why?")

    def found() -> float:
        families = text_string_to_metric_families(httpx.get(f"http://{b.picker}/metrics").text)
        return next(
            sample.value
            for family in families
            for sample in family.samples
            if sample.name == "dscache_picker_conversations_total"
            and sample.labels == {"result": "found"}
        )

    before = found()
    resp = _chat(b, nxt, None)  # through the other replica, without its id
    assert resp.headers["X-Dscache-Key-Source"] == "prompt"
    assert (resp.headers["X-Dscache-Track"], resp.headers["X-Dscache-Upstream"]) == ("stable", pod)
    assert found() == before + 1  # the ledgers placed it, not the blocks
