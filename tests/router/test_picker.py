"""The router's picker: the pod holding a request's longest prefix, bounded by load."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import httpx
import pytest
from dscache_router.picker import (
    HolderQuery,
    Picker,
    PickError,
    PickerSettings,
    PickQuery,
    shingles,
)
from dscache_router.serve import create_app
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_sidecar.holdings import HoldingsFilter
from dscache_sidecar.holdings_publisher import Holdings
from dscache_sidecar.probes import holdings_app

from dscache.keys import block_keys
from dscache.routing import conversation_key, previous_turn_keys

BT = 16  # small blocks: a few sentences make several
ROOT = bytes(range(32))
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"

DOC = " ".join(
    f"Revenue of segment {i} grew {i % 7} percent in fiscal {2000 + i}." for i in range(40)
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tokenizer() -> DeepSeekTokenizer:
    return DeepSeekTokenizer()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def picker(tokenizer: DeepSeekTokenizer, clock: Clock) -> Iterator[Picker]:
    p = Picker(PickerSettings(memory_s=60.0), tokenizer, clock=clock)
    for pod in (A, B, C):
        p.set_keyinfo(pod, ROOT, BT)
    yield p


def chat(*turns: str) -> list[dict[str, str]]:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return [{"role": roles[i], "content": t} for i, t in enumerate(turns)]


def keys_of(tokenizer: DeepSeekTokenizer, messages: list[dict[str, str]]) -> list[bytes]:
    ids = tokenizer.apply_chat_template([ChatMessage(m["role"], m["content"]) for m in messages])
    return block_keys(ROOT, ids, BT)


def query(
    messages: list[dict[str, str]] | None,
    pods: str = f"{A}/0,{B}/0,{C}/0",
    *,
    cap: int = 0,
    key: str = "k",
    pinned: str = "",
    credentials: bool = False,
) -> PickQuery:
    body = json.dumps({"messages": messages}).encode() if messages is not None else b"{}"
    args = {"pods": pods, "cap": str(cap), "key": key, "source": "header", "pinned": pinned}
    return PickQuery.parse(args, body, credentials)


def test_the_pod_holding_the_longest_prefix_takes_the_request(
    picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    turn1 = chat(DOC, "What grew most?")
    turn2 = chat(DOC, "What grew most?", "Segment 6.", "And least?")
    keys2 = keys_of(tokenizer, turn2)
    # C holds the whole first turn's prompt; B holds only the document's first blocks.
    picker.set_holdings(C, HoldingsFilter.of(keys_of(tokenizer, turn1), 1000))
    picker.set_holdings(B, HoldingsFilter.of(keys2[:2], 1000))
    choice = picker.pick(query(turn2))
    assert (choice.pod, choice.reason) == (C, "prefix")
    assert choice.blocks == len(keys_of(tokenizer, turn1)) > 2


def test_alike_first_turns_tied_on_a_prefix_meet_on_one_pod_whichever_replica_places_them(
    tokenizer: DeepSeekTokenizer, clock: Clock
) -> None:
    # Every pod holds the shared document (prewarmed); the question fits in the last,
    # unstored block. Two router replicas' pickers, each session with its own id
    # (its own ring order): the same first turn goes to one pod from both, so that a
    # later turn that lost its id finds every conversation alike to it in one place.
    replicas = [Picker(PickerSettings(memory_s=60.0), tokenizer, clock=clock) for _ in "ab"]
    doc = keys_of(tokenizer, chat(DOC, "?"))
    for p in replicas:
        for pod in (A, B, C):
            p.set_keyinfo(pod, ROOT, BT)
            p.set_holdings(pod, HoldingsFilter.of(doc, 1000))
    orders = [f"{A}/0,{B}/0,{C}/0", f"{C}/0,{B}/0,{A}/0", f"{B}/0,{A}/0,{C}/0"]
    first = chat(DOC, "What grew most?")
    chosen = {
        p.pick(query(first, order, key=f"session-{i}-{j}")).pod
        for i, p in enumerate(replicas)
        for j, order in enumerate(orders)
    }
    assert len(chosen) == 1
    # Different first turns spread over the tied pods, as the ring would spread them
    # (each after the last is forgotten: the picker's own memory is not the point).
    spread = set()
    for y in range(2000, 2030):
        clock.now += 61
        question = chat(DOC, f"What grew in fiscal {y}?")
        spread.add(replicas[0].pick(query(question, orders[0], key=str(y))).pod)
    assert spread == {A, B, C}


def holder_query(
    messages: list[dict[str, str]], pods: str = f"{A},{B},{C}", *, credentials: bool = False
) -> HolderQuery:
    body = json.dumps({"messages": messages}).encode()
    return HolderQuery.parse({"pods": pods, "lead": "2"}, body, credentials)


def test_the_holder_is_the_pod_with_the_conversation_past_its_opening(
    picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    turn1 = chat(DOC, "What grew most?")
    answer = "Segment 6 grew the most, six percent in fiscal 2006, ahead of all the others."
    turn2 = chat(DOC, "What grew most?", answer, "And least?")
    # A and B hold the opening (the document and first question: shared, prewarmed
    # on every pod of both tracks); only C holds the conversation's answer and past.
    opening = keys_of(tokenizer, turn1)
    picker.set_holdings(A, HoldingsFilter.of(opening, 1000))
    picker.set_holdings(B, HoldingsFilter.of(opening, 1000))
    assert picker.holder(holder_query(turn2)) is None  # no pod holds more than the opening
    # C served the first turn: it holds its prompt and answer (not the new question).
    picker.set_holdings(C, HoldingsFilter.of(keys_of(tokenizer, turn2)[:-1], 1000))
    assert picker.holder(holder_query(turn2)) == C
    # It goes there from now on: its keys count as held on C (the picker's memory).
    picker.set_holdings(C, HoldingsFilter.of([], 1000))
    assert picker.holder(holder_query(turn2)) == C
    assert picker.metrics.holders.labels("found")._value.get() == 2


@pytest.mark.parametrize(
    ("placed", "pods", "home"),
    [
        ({A: 1, B: 2}, f"{A},{B}", B),  # B is the likelier home; a blind tie-break takes A
        ({A: 2, B: 2}, f"{B},{A}", B),  # a true tie: the first in the list
        ({A: 3, B: 2}, f"{B},{A}", A),
        ({A: 1, B: 2, "other": 5}, f"{A},{B}", B),  # A's other 5 share only the opening
    ],
)
def test_pods_holding_the_same_conversation_tie_to_the_one_more_of_them_went_to(
    tokenizer: DeepSeekTokenizer, clock: Clock, placed: dict[str, int], pods: str, home: str
) -> None:
    # Conversations alike to their first answer (same opening, question and greedy
    # answer) were placed on A and B; a second turn without its id names none of
    # them, and both pods hold its whole history.
    picker = Picker(PickerSettings(memory_s=60.0), tokenizer, clock=clock)
    for pod in (A, B):
        picker.set_keyinfo(pod, ROOT, BT)

    def turn(*texts: str) -> list[dict[str, str]]:  # the opening: two system messages
        said = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
        return [{"role": "system", "content": "You are an analyst."}, chat(DOC)[0], *said]

    question = "What grew most over the forty years, and by how much in each fiscal year?"
    answer = "Segment 6 grew the most, six percent in fiscal 2006, ahead of all the others."
    for pod, n in placed.items():
        first = turn(question) if pod != "other" else turn("Which one shrank, and when?")
        for _ in range(n):
            picker.pick(query(first, pods=f"{A}/0,{B}/0", pinned=pod if pod != "other" else A))
    turn2 = turn(question, answer, "And least?")
    for pod in (A, B):
        picker.set_holdings(pod, HoldingsFilter.of(keys_of(tokenizer, turn2)[:-1], 1000))
    assert picker.holder(holder_query(turn2, pods=pods)) == home


def test_where_the_blocks_cannot_tell_the_pod_that_served_the_previous_turn_takes_it(
    picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    # A short answer and question fit in a block no pod stores whole: every pod holds
    # the opening and nothing past it, so the blocks name no holder. The pods'
    # conversation ledgers know which one served the turn before.
    answer = "Segment 6."
    turn2 = chat(DOC, "What grew most?", answer, "And least?")
    opening = keys_of(tokenizer, chat(DOC, "What grew most?"))
    for pod in (A, B, C):
        picker.set_holdings(pod, HoldingsFilter.of(opening, 1000))
    asked: list[Sequence[str]] = []

    def served(keys: Sequence[str]) -> str | None:
        asked.append(keys)
        return B

    assert picker.holder(holder_query(turn2)) is None  # without the ledgers: the weights
    assert picker.holder(holder_query(turn2), served) == B
    # Asked by the previous turn's messages with its answer, then without.
    assert asked == [previous_turn_keys(turn2)]
    assert asked == [(conversation_key(turn2[:3]), conversation_key(turn2[:2]))]
    assert picker.metrics.conversations.labels("found")._value.get() == 1
    # A ledger naming a pod the router did not list (gone, another deployment's): no.
    assert picker.holder(holder_query(turn2, pods=f"{A},{C}"), served) is None
    assert picker.metrics.conversations.labels("unknown")._value.get() == 1
    # Each answer's time, the ledgers' round trip included, for the router's timeout.
    answers = picker.metrics.registry.get_sample_value("dscache_picker_holder_seconds_count")
    assert answers == 3


def test_the_ledgers_break_a_tie_but_never_overrule_a_longer_prefix(
    picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    answer = "Segment 6 grew the most, six percent in fiscal 2006, ahead of all the others."
    turn2 = chat(DOC, "What grew most?", answer, "And least?")
    history = keys_of(tokenizer, turn2)  # its blocks but the last, partial one
    # Only A holds the whole history (C the opening and part of the answer): A, and
    # the ledgers are not asked (a lookup saved).
    picker.set_holdings(A, HoldingsFilter.of(history, 1000))
    picker.set_holdings(C, HoldingsFilter.of(history[:-1], 1000))

    def never(_keys: Sequence[str]) -> str | None:
        raise AssertionError("the blocks settled it")

    assert picker.holder(holder_query(turn2), never) == A
    # A and C hold the same history (conversations alike to their first answer):
    # the pod that served this one's previous turn.
    picker.set_holdings(C, HoldingsFilter.of(history, 1000))
    again = chat(DOC, "What grew most?", answer, "Which one shrank the most, and in which year?")
    assert picker.holder(holder_query(again), lambda _keys: C) == C
    # And C from now on: the turn counts as held there (the picker's memory).
    assert picker.holder(holder_query(again), never) == C


def test_an_opening_alone_names_no_holder_so_the_weights_place_it(
    picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    # A first turn (nothing past its opening), whoever holds it: the canary weight
    # decides where a new conversation goes, not which pod was prewarmed with it.
    first = chat(DOC, "What grew most?")
    picker.set_holdings(A, HoldingsFilter.of(keys_of(tokenizer, first), 1000))
    assert picker.holder(holder_query(first)) is None
    # Nor does a request with credentials (its keys are its tenant's), nor one that
    # is no chat.
    later = chat(DOC, "What grew most?", "Segment 6.", "And least?")
    picker.set_holdings(A, HoldingsFilter.of(keys_of(tokenizer, later), 1000))
    assert picker.holder(holder_query(later, credentials=True)) is None
    text = HolderQuery.parse({"pods": A}, json.dumps({"prompt": DOC}).encode(), False)
    assert picker.holder(text) is None
    assert picker.holder(holder_query(later)) == A


@pytest.mark.parametrize(
    "args",
    [{"pods": ""}, {"pods": A, "lead": "0"}, {"pods": A, "lead": "x"}, {"pods": A, "lead": "65"}],
)
def test_a_malformed_holder_query_is_refused(args: dict[str, str]) -> None:
    with pytest.raises(PickError):
        HolderQuery.parse(args, b"{}", False)


def test_a_pod_over_the_load_bound_is_passed_over_for_the_next_best(
    picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    msgs = chat(DOC, "Summarise.")
    keys = keys_of(tokenizer, msgs)
    picker.set_holdings(A, HoldingsFilter.of(keys, 1000))
    picker.set_holdings(B, HoldingsFilter.of(keys[:3], 1000))
    # A is at the bound (3 in flight, cap 3): never everyone to one pod.
    choice = picker.pick(query(msgs, f"{A}/3,{B}/1,{C}/0", cap=3))
    assert (choice.pod, choice.reason, choice.blocks) == (B, "prefix", 3)
    # Every pod at the bound: the ring's first, marked as such.
    over = picker.pick(query(msgs, f"{C}/5,{A}/5", cap=3))
    assert (over.pod, over.reason) == (C, "overloaded")


def test_without_a_held_prefix_the_ring_order_decides(picker: Picker) -> None:
    choice = picker.pick(query(chat("Hello there, a short chat."), f"{B}/0,{A}/0,{C}/0"))
    assert (choice.pod, choice.reason) == (B, "hash")


def test_a_pinned_session_keeps_its_pod_and_its_blocks_are_remembered_there(
    picker: Picker, tokenizer: DeepSeekTokenizer, clock: Clock
) -> None:
    msgs = chat(DOC, "First question?")
    assert picker.pick(query(msgs, pinned=B)).reason == "pinned"
    # The id-less next turn finds its history on B before any filter says so.
    follow = chat(DOC, "First question?", "An answer.", "Second question?")
    choice = picker.pick(query(follow, key="p-other"))
    assert (choice.pod, choice.reason) == (B, "prefix")
    # The picker's own memory fades: after memory_s only the filters count.
    clock.now += 61.0
    assert picker.pick(query(chat(DOC, "Third?"), key="p-x")).reason in ("hash", "similar")


def test_a_similar_request_follows_its_conversation_without_blocks(
    tokenizer: DeepSeekTokenizer,
) -> None:
    p = Picker(PickerSettings(similarity_threshold=0.5), tokenizer)  # no keyinfo: no keys at all
    talk = "we discussed the quarterly filings of the northern utility and its debt covenants " * 3
    first = p.pick(query(chat(talk, "what about the dividend policy"), f"{B}/0,{A}/0", key="s1"))
    assert first.reason == "hash" and first.pod == B
    # The same conversation one turn later, id-less: hashed elsewhere, follows its content.
    later = chat(talk, "what about the dividend policy", "It is stable.", "and buybacks")
    choice = p.pick(query(later, f"{A}/0,{B}/0", key="p-1"))
    assert (choice.pod, choice.reason) == (B, "similar")
    # An unrelated chat does not.
    other = p.pick(
        query(chat("tell me a poem about autumn leaves and rain"), f"{A}/0,{B}/0", key="x")
    )
    assert (other.pod, other.reason) == (A, "hash")


def test_a_request_with_credentials_gets_no_prefix_match(
    picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    msgs = chat(DOC, "Q?")
    picker.set_holdings(C, HoldingsFilter.of(keys_of(tokenizer, msgs), 1000))
    # Its tenant's keys are not the anonymous chain's: a match would be a lie.
    assert picker.pick(query(msgs, f"{A}/0,{C}/0", credentials=True)).reason != "prefix"


def test_domain_terms_count_as_extra_shingles() -> None:
    plain = shingles("ebitda rose", 2, {})
    weighted = shingles("ebitda rose", 2, {"ebitda": 3})
    assert len(weighted) == len(plain) + 3


@pytest.mark.parametrize(
    "args",
    [
        {"pods": ""},
        {"pods": "10.0.0.1:8000"},
        {"pods": "10.0.0.1:8000/x"},
        {"pods": "10.0.0.1:8000/1", "cap": "-1"},
    ],
)
def test_a_malformed_query_is_refused(args: dict[str, str]) -> None:
    with pytest.raises(PickError):
        PickQuery.parse(args, b"", False)


async def test_the_http_app_answers_a_pod_or_400(picker: Picker) -> None:
    app = create_app(picker)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://picker") as client:
        body = json.dumps({"messages": chat("Hi.")})
        r = await client.post("/pick", params={"pods": f"{C}/0,{A}/0", "cap": "2"}, content=body)
        assert r.status_code == 200
        assert r.text == C and r.headers["x-dscache-pick-reason"] == "hash"
        bad = await client.post("/pick", params={"pods": "nonsense"}, content=body)
        assert bad.status_code == 400 and "ADDRESS/INFLIGHT" in bad.json()["error"]
        # A body that is no request at all still gets a pod.
        junk = await client.post("/pick", params={"pods": f"{A}/0"}, content=b"\xff\x00")
        assert junk.status_code == 200 and junk.text == A
        metrics = await client.get("/metrics")
        assert 'dscache_picker_decisions_total{reason="hash"} 2.0' in metrics.text
        # Which pod holds a conversation: none here (404), and a bad query is a 400.
        later = json.dumps({"messages": chat(DOC, "Q?", "A.", "Q2?")})
        none = await client.post("/holder", params={"pods": f"{A},{B}"}, content=later)
        assert none.status_code == 404
        bad = await client.post("/holder", params={"pods": "no pod"}, content=later)
        assert bad.status_code == 400 and "HOST:PORT" in bad.json()["error"]
        metrics = await client.get("/metrics")
        assert 'dscache_picker_holders_total{result="unknown"} 1.0' in metrics.text
        assert 'dscache_picker_holders_total{result="failed"} 1.0' in metrics.text


def test_an_unchanged_holdings_filter_is_not_downloaded_again(
    tokenizer: DeepSeekTokenizer, clock: Clock
) -> None:
    """The sidecar's own endpoint (real WSGI app, real HTTP) answers 304 to the tag it gave."""
    first = HoldingsFilter.of(keys_of(tokenizer, chat(DOC)), capacity=1024)
    builds = [Holdings(1, 1, first.to_bytes(), '"boot-1"')]
    statuses: list[str] = []
    app = holdings_app(lambda: builds[-1])

    def counted(environ: dict[str, object], start_response: object) -> object:
        def start(status: str, headers: list[tuple[str, str]], *rest: object) -> object:
            statuses.append(status.split(maxsplit=1)[0])
            return start_response(status, headers, *rest)  # type: ignore[operator]

        return app(environ, start)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = make_server("127.0.0.1", 0, counted, handler_class=Quiet)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{server.server_port}/dscache/holdings"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        p = Picker(PickerSettings(holdings={A: url}), tokenizer, clock=clock)
        p.set_keyinfo(A, ROOT, BT)
        with httpx.Client(timeout=5) as client:
            p.refresh(client)
            clock.now += 1
            p.refresh(client)  # same build: 304, the filter kept and fresh
            assert statuses == ["200", "304"]
            assert p.pick(query(chat(DOC), pods=f"{A}/0")).reason == "prefix"
            other = DOC.replace("Revenue", "Cost")
            second = HoldingsFilter.of(keys_of(tokenizer, chat(other)), capacity=1024)
            builds.append(Holdings(2, 1, second.to_bytes(), '"boot-2"'))
            p.refresh(client)  # a new build: downloaded whole
            assert statuses == ["200", "304", "200"]
            assert p.pick(query(chat(other), pods=f"{A}/0")).reason == "prefix"
    finally:
        server.shutdown()
        server.server_close()


def test_a_pod_no_pick_names_any_more_is_forgotten(
    picker: Picker, tokenizer: DeepSeekTokenizer, clock: Clock
) -> None:
    picker.set_holdings(A, HoldingsFilter.of(keys_of(tokenizer, chat(DOC)), capacity=1024))
    assert picker.pick(query(chat(DOC))).pod == A
    # A's pod is deleted; for a while every pick names only B and C.
    for _ in range(3):
        clock.now += picker.settings.forget_s / 2
        picker.pick(query(chat("Hi."), pods=f"{B}/0,{C}/0"))
    assert picker.forget_gone() == [A]
    assert sorted(picker.pods()) == [B, C]
    assert picker.metrics.pods._value.get() == 2  # type: ignore[attr-defined]
    # A new pod that gets A's address starts cold: the old pod's filter is not its own.
    again = picker.pick(query(chat(DOC), pods=f"{A}/0,{B}/0"))
    assert (again.pod, again.reason) == (A, "hash")


async def test_a_pick_body_is_read_no_further_than_the_limit(
    picker: Picker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dscache_router import serve

    monkeypatch.setattr(serve, "MAX_BODY", 64 << 10)
    sent: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        for _ in range(1000):  # 16 MiB in all, never announced (chunked)
            sent.append(1)
            yield b"x" * (16 << 10)

    app = create_app(picker)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://picker") as client:
        r = await client.post("/pick", params={"pods": f"{A}/0"}, content=endless())
    assert r.status_code == 413
    assert len(sent) < 10  # before: all 1000 chunks were read, then refused


def _serve_wsgi(app: Any) -> tuple[str, Callable[[], None]]:
    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_port}", stop


def test_a_filter_over_the_limit_is_not_taken(
    tokenizer: DeepSeekTokenizer, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dscache_router import picker as picker_module

    big = HoldingsFilter.of(keys_of(tokenizer, chat(DOC)), capacity=200_000).to_bytes()
    monkeypatch.setattr(picker_module, "MAX_FILTER_BYTES", len(big) // 4)
    url, stop = _serve_wsgi(holdings_app(lambda: Holdings(1, 1, big, '"b1"')))
    try:
        p = Picker(PickerSettings(holdings={A: url + "/dscache/holdings"}), tokenizer, clock=clock)
        p.set_keyinfo(A, ROOT, BT)
        with httpx.Client(timeout=5) as client:
            p.refresh(client)
        # A pod (or anything at its address) cannot make the picker hold a filter of any size.
        assert p.pick(query(chat(DOC), pods=f"{A}/0")).reason == "hash"
        assert p.metrics.fetch_errors.labels("holdings")._value.get() == 1  # type: ignore[attr-defined]
    finally:
        stop()


def test_the_picker_shows_its_internal_token_to_read_a_filter(
    tokenizer: DeepSeekTokenizer, clock: Clock
) -> None:
    held = HoldingsFilter.of(keys_of(tokenizer, chat(DOC)), capacity=1024).to_bytes()
    app = holdings_app(lambda: Holdings(1, 1, held, '"b1"'), token="picker-1")
    url, stop = _serve_wsgi(app)
    try:
        for token, reason in (("", "hash"), ("a guess", "hash"), ("picker-1", "prefix")):
            settings = PickerSettings(holdings={A: url + "/dscache/holdings"}, internal_token=token)
            p = Picker(settings, tokenizer, clock=clock)
            p.set_keyinfo(A, ROOT, BT)
            with httpx.Client(timeout=5) as client:
                p.refresh(client)
            assert p.pick(query(chat(DOC), pods=f"{A}/0")).reason == reason, token
    finally:
        stop()
