"""Live template mining: the server lists the prompt prefixes many requests share.

What a user relies on: the listed templates are the block-aligned prefixes several
conversations share, ranked by the prefill caching them saves (no shared block
counted twice), the longest one of a chain only when it covers as many requests;
tenants never pool counts; memory stays bounded however many distinct prompts come
and a frequent template survives them; only the gateway reads the token ids; the
filter is the sidecar's holdings format; several servers' lists merge, and a dead
server is skipped.
"""

from __future__ import annotations

import argparse
import hashlib
from collections import Counter
from collections.abc import Callable, Sequence

import httpx
import pytest
from dscache_server.config import add_server_arguments, settings_from_args
from dscache_server.templatelog import MinedTemplate, TemplateLog, fetch_templates, merge
from dscache_server.templaterank import Counted, select
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_sidecar.holdings import KEYS_HEADER, HoldingsFilter
from dscache_tools.net import free_port
from pydantic import ValidationError
from srv_helpers import BLOCK_TOKENS, LiveServer, random_text

from dscache.keys import block_keys

BT = 4
GATEWAY = "gw-templates-1"


def _root(tenant: str) -> bytes:
    return hashlib.sha256(tenant.encode()).digest()


def _record(
    miner: TemplateLog, ids: Sequence[int], conversation: str | None, tenant: str = "default"
) -> None:
    miner.record(tenant, conversation, ids, block_keys(_root(tenant), ids, miner.block_tokens))


def _toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def _got(templates: list[MinedTemplate]) -> list[tuple[int, int, int, int]]:
    return [(t.prefix_tokens, t.count, t.conversations, t.saved_tokens) for t in templates]


# -- counting and ranking


def _history(miner: TemplateLog) -> None:
    """Two groups sharing a 2-block policy (A: 8 shared blocks, B: 4) and one
    conversation whose two turns share 3 blocks with each other only."""
    policy = _toks(100, 2 * BT)
    for i in range(4):
        _record(miner, policy + _toks(200, 6 * BT) + _toks(1000 + 10 * i, 5), f"a{i}")
    for i in range(3):
        _record(miner, policy + _toks(300, 2 * BT) + _toks(2000 + 10 * i, 6), f"b{i}")
    solo = _toks(400, 3 * BT)
    _record(miner, [*solo, 1], "solo")
    _record(miner, [*solo, 2, 3, 4, 5, 6], "solo")


def test_templates_are_shared_prefixes_ranked_by_saved_prefill() -> None:
    miner = TemplateLog(block_tokens=BT, max_blocks=8)
    _history(miner)
    ta, tb, shared = 8 * BT, 4 * BT, 2 * BT
    # Group A's document saves most; the policy all 7 share is listed because more
    # requests share it than either longer template, and its blocks are not counted
    # again in the groups' savings; the solo conversation is not a template.
    assert _got(miner.top(10)) == [
        (ta, 4, 4, 3 * (ta - shared)),
        (shared, 7, 7, 6 * shared),
        (tb, 3, 3, 2 * (tb - shared)),
    ]
    best = miner.top(10)[0]
    assert best.tokens == (*_toks(100, 2 * BT), *_toks(200, 6 * BT))  # max_blocks: 8, not 9
    assert best.key == block_keys(_root("default"), best.tokens, BT)[-1].hex()
    # Cut to one, the best saves its whole length.
    assert _got(miner.top(1)) == [(ta, 4, 4, 3 * ta)]
    assert miner.requests == 9


def test_a_prefix_is_listed_only_when_more_requests_share_it_than_a_longer_one() -> None:
    miner = TemplateLog(block_tokens=BT)
    prompt = _toks(0, 3 * BT)
    for i in range(3):
        _record(miner, prompt + [500 + i], f"c{i}")
    assert _got(miner.top(10)) == [
        (3 * BT, 3, 3, 2 * 3 * BT)
    ]  # its 1- and 2-block heads add nothing
    _record(miner, [*prompt[:BT], 900, 901, 902, 903], "c9")
    assert _got(miner.top(10)) == [(3 * BT, 3, 3, 2 * 2 * BT), (BT, 4, 4, 3 * BT)]


def test_a_prefix_is_dropped_when_a_longer_one_may_have_as_many_requests() -> None:
    def listed(error: int) -> list[int]:
        up = Counted(b"p", (), 4, count=10, conversations=10, error=error)
        down = Counted(b"c", (b"p",), 8, count=8, conversations=8)
        return [r.prefix.tokens for r in select([up, down], 10)]

    assert listed(error=1) == [4, 8]  # surely more than 8 requests: both listed
    assert listed(error=2) == [8]  # maybe only 8: the longer one covers it


def test_conversations_are_counted_distinct_and_capped() -> None:
    miner = TemplateLog(block_tokens=BT)
    prompt = _toks(0, 2 * BT)
    for _ in range(5):
        _record(miner, prompt, "same")
    assert miner.top(10) == []  # one conversation's own history: not a template
    _record(miner, prompt, "other")
    assert _got(miner.top(10)) == [(2 * BT, 6, 2, 5 * 2 * BT)]

    anonymous = TemplateLog(block_tokens=BT)
    for _ in range(2):
        _record(anonymous, prompt, None)  # each its own conversation
    assert _got(anonymous.top(10)) == [(2 * BT, 2, 2, 2 * BT)]

    crowd = TemplateLog(block_tokens=BT)
    for i in range(70):
        _record(crowd, prompt, f"s{i}")
    assert _got(crowd.top(10)) == [(2 * BT, 70, 64, 69 * 2 * BT)]


def test_tenants_never_pool_counts() -> None:
    miner = TemplateLog(block_tokens=BT)
    prompt = _toks(0, 2 * BT)
    _record(miner, prompt, "a1", tenant="tenant:a")
    _record(miner, prompt, "a2", tenant="tenant:a")
    _record(miner, prompt, "b1", tenant="tenant:b")
    (only,) = miner.top(10)
    assert (only.tenant, only.count, only.tenant_header) == ("tenant:a", 2, "a")
    assert miner.top(10, tenant="tenant:a") == [only]
    assert miner.top(10, tenant="tenant:b") == []
    _record(miner, prompt, "b2", tenant="tenant:b")
    both = miner.top(10)
    assert {t.tenant for t in both} == {"tenant:a", "tenant:b"}
    assert len({t.key for t in both}) == 2  # the same tokens, other keys
    assert miner.keys(10) == [
        k for t in both for k in block_keys(_root(t.tenant), t.tokens, BT)
    ]  # every prefix of every template, best first


def test_memory_is_bounded_and_a_frequent_template_survives_a_flood_of_one_offs() -> None:
    capacity, blocks = 16, 2
    miner = TemplateLog(block_tokens=BT, capacity=capacity, max_blocks=blocks)
    template = _toks(0, blocks * BT)
    true: Counter[tuple[int, ...]] = Counter()
    for i in range(600):
        ids = template if i % 3 == 0 else _toks(10_000 + 100 * i, blocks * BT)
        _record(miner, ids, f"conv{i}")
        for depth in range(1, blocks + 1):
            true[tuple(ids[: depth * BT])] += 1
        assert len(miner) <= capacity
    bound = 600 * blocks // capacity  # N recorded prefixes / capacity
    (found,) = miner.top(10)  # the one-offs never pass for templates
    assert found.tokens == tuple(template)
    assert true[found.tokens] <= found.count <= true[found.tokens] + bound
    assert miner.requests == 600


def test_a_template_that_becomes_frequent_later_displaces_old_ones() -> None:
    capacity = 16
    miner = TemplateLog(block_tokens=BT, capacity=capacity, max_blocks=1)
    for i in range(capacity - 1):  # yesterday's templates fill the log
        for n in range(40):
            _record(miner, _toks(100 * i, BT), f"old{i}-{n}")
    new = _toks(90_000, BT)
    for i in range(1200):
        ids = new if i % 3 == 0 else _toks(100_000 + 10 * i, BT)
        _record(miner, ids, f"new{i}")
    bound = (600 + 1200) // capacity
    best = miner.top(1)[0]
    assert best.tokens == tuple(new)
    assert 400 <= best.count <= 400 + bound


def test_a_request_without_a_full_block_is_not_recorded() -> None:
    miner = TemplateLog(block_tokens=BT)
    assert not miner.record("default", "c", [1, 2, 3], [])
    assert miner.requests == 0 and len(miner) == 0


# -- the JSON shape and merging


def _template(tenant: str, tokens: Sequence[int], count: int, conversations: int) -> MinedTemplate:
    key = block_keys(_root(tenant), tokens, BT)[-1].hex()
    return MinedTemplate(tenant, key, tuple(tokens), len(tokens), count, conversations, 0)


def test_merged_lists_sum_the_same_template_and_rank_again() -> None:
    up, down = _toks(0, BT), _toks(0, 2 * BT)
    first = [_template("default", up, 5, 5), _template("default", down, 3, 3)]
    second = [_template("default", down, 1, 1), _template("tenant:x", down, 2, 2)]
    got = merge([first, second], 10)
    assert [(t.tenant, t.prefix_tokens, t.count, t.saved_tokens) for t in got] == [
        ("default", BT, 5, 4 * BT),
        ("default", 2 * BT, 4, 3 * BT),  # what it adds to the listed shorter one
        ("tenant:x", 2 * BT, 2, 2 * BT),  # another tenant: never merged
    ]
    # One more request on the longer one: it covers the shorter one's requests.
    got = merge([first, second, [_template("default", down, 1, 1)]], 10)
    assert (got[0].prefix_tokens, got[0].count) == (2 * BT, 5)
    assert BT not in [t.prefix_tokens for t in got if t.tenant == "default"]


def test_a_template_round_trips_and_bad_input_is_refused() -> None:
    t = _template("tenant:acme", _toks(7, 2 * BT), 3, 2)
    assert MinedTemplate.from_dict(t.to_dict()) == t
    assert (t.tenant_header, _template("default", _toks(7, BT), 2, 2).tenant_header) == (
        "acme",
        None,
    )
    good = t.to_dict()
    for bad in [
        {**good, "tenant": "apikey:abc"},
        {**good, "tenant": 7},
        {**good, "key": "zz" * 32},
        {**good, "key": "ab"},
        {**good, "tokens": []},
        {**good, "tokens": [1, -1, 2, 3, 4, 5, 6, 7]},
        {**good, "tokens": [True] * 8},
        {**good, "prefix_tokens": 9},
        {**good, "count": 0},
        {**good, "conversations": 4},
        {**good, "saved_tokens": "many"},
        {k: v for k, v in good.items() if k != "count"},
        [good],
    ]:
        with pytest.raises(ValueError):
            MinedTemplate.from_dict(bad)


# -- the server


def _chat(
    srv: LiveServer, system: str, question: str, session: str, **headers: str
) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1},
        headers={"X-Session-ID": session, **headers},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def _ids(tokenizer: DeepSeekTokenizer, system: str, question: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [ChatMessage("system", system), ChatMessage("user", question)]
    )


def _listing(srv: LiveServer, query: str = "", **headers: str) -> httpx.Response:
    return httpx.get(srv.url + "/dscache/templates" + query, headers=headers, timeout=30)


def _refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_the_server_lists_the_shared_system_prompt_to_the_gateway_only(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server(gateway_secret=GATEWAY)
    system = random_text(tokenizer, 150, seed=41)
    # Questions that differ from their first token on: the system prompt is all
    # the requests share.
    questions = ["Alpha: what changed?", "Beta: who signed?", "Gamma: when is it due?"]
    for i, q in enumerate(questions):
        _chat(srv, system, q, session=f"s{i}")
    _chat(srv, system, "Delta?", session="s0")  # a second request: no new conversation
    gateway = {"X-Dscache-Tenant": "acme", "X-Dscache-Gateway-Token": GATEWAY}
    for i in range(2):
        _chat(srv, system, questions[i], session=f"acme{i}", **gateway)
    _chat(srv, system, questions[2], session="k", Authorization="Bearer sk-own")  # not recorded

    _refused(_listing(srv), 401, "invalid_gateway_token")
    _refused(_listing(srv, **{"X-Dscache-Gateway-Token": "nope"}), 401, "invalid_gateway_token")
    token = {"X-Dscache-Gateway-Token": GATEWAY}
    for query in ("?top=0", "?top=1001", "?top=ten"):
        _refused(_listing(srv, query, **token), 400, "invalid_value")
    r = _listing(srv, **token)
    assert r.status_code == 200, r.text
    doc = r.json()
    rt = srv.runtime
    assert doc["model"] == "mini-gqa" and doc["block_tokens"] == BLOCK_TOKENS
    assert doc["fingerprint"] == rt.fingerprint.digest().hex()

    prompts = [_ids(tokenizer, system, q) for q in [*questions, "Delta?"]]
    common = next(i for i, column in enumerate(zip(*prompts, strict=False)) if len(set(column)) > 1)
    expected = min(common // BLOCK_TOKENS, rt.settings.template_log_max_blocks) * BLOCK_TOKENS
    assert expected >= 2 * BLOCK_TOKENS  # the fixture is what it claims
    best = MinedTemplate.from_dict(doc["templates"][0])
    assert (best.tenant, best.count, best.conversations) == ("default", 4, 3)
    assert best.prefix_tokens == expected and best.prefix_tokens % BLOCK_TOKENS == 0
    assert list(best.tokens) == prompts[0][:expected]
    assert best.key == rt.chain_for("default").keys(best.tokens)[-1].hex()
    assert best.saved_tokens == 3 * expected
    assert {t["tenant"] for t in doc["templates"]} == {"default", "tenant:acme"}

    acme = _listing(srv, "?tenant=tenant:acme", **token).json()["templates"]
    assert [(t["tenant"], t["count"], t["conversations"]) for t in acme] == [("tenant:acme", 2, 2)]
    assert _listing(srv, "?tenant=tenant:nobody", **token).json()["templates"] == []
    assert srv.metric("dscache_server_templates_recorded_total") == 6
    assert srv.metric("dscache_server_templates_tracked") >= 2

    r = httpx.get(srv.url + "/dscache/templates/filter", timeout=30)  # no token needed
    assert r.status_code == 200
    bloom = HoldingsFilter.from_bytes(r.content)
    keys = rt.chain_for("default").keys(best.tokens) + rt.chain_for("tenant:acme").keys(best.tokens)
    assert all(k in bloom for k in keys)
    assert int(r.headers[KEYS_HEADER]) == len(keys)
    other = rt.chain_for("default").keys(_ids(tokenizer, "Another system prompt. " * 60, "?"))
    assert bloom.prefix_length(other) == 0


def test_without_a_gateway_secret_403_and_with_mining_off_404(
    live_server: Callable[..., LiveServer],
) -> None:
    open_srv = live_server()
    _refused(_listing(open_srv), 403, "templates_need_gateway_secret")
    assert httpx.get(open_srv.url + "/dscache/templates/filter").status_code == 200
    off = live_server(gateway_secret=GATEWAY, template_log=False)
    _refused(_listing(off, **{"X-Dscache-Gateway-Token": GATEWAY}), 404, "templates_off")
    _refused(httpx.get(off.url + "/dscache/templates/filter"), 404, "templates_off")
    assert off.runtime.templates is None


def test_fetch_templates_merges_servers_and_skips_a_dead_one(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    a, b = live_server(gateway_secret=GATEWAY), live_server(gateway_secret=GATEWAY)
    system = random_text(tokenizer, 100, seed=43)
    for n, srv in enumerate((a, b, a, b, b)):
        _chat(srv, system, f"Question {n}?", session=f"s{n}")
    dead = f"http://127.0.0.1:{free_port()}"
    merged = fetch_templates([a.url, dead, b.url], GATEWAY, top=5, timeout_s=5)
    best = merged[0]
    assert (best.count, best.conversations, best.saved_tokens) == (5, 5, 4 * best.prefix_tokens)
    assert list(best.tokens) == _ids(tokenizer, system, "Question 0?")[: best.prefix_tokens]
    # Alone, server a lists it from two requests; b from three.
    assert [t.count for t in fetch_templates([a.url], GATEWAY, top=5)][:1] == [2]
    with pytest.raises(ValueError, match="none of the 2 servers"):
        fetch_templates([dead, b.url], "wrong-token", top=5)
    with pytest.raises(ValueError, match="top must be"):
        fetch_templates([a.url], GATEWAY, top=0)


def test_flags_and_env_configure_the_miner(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = ["--template-log-capacity", "64", "--template-log-max-blocks", "4"]
    s = settings_from_args(parser.parse_args(args))
    assert (s.template_log, s.template_log_capacity, s.template_log_max_blocks) == (True, 64, 4)
    assert not settings_from_args(parser.parse_args(["--no-template-log"])).template_log
    monkeypatch.setenv("DSCACHE_SERVER_TEMPLATE_LOG", "false")
    assert not settings_from_args(parser.parse_args([])).template_log
    with pytest.raises(ValidationError, match="template_log_capacity"):
        settings_from_args(parser.parse_args(["--template-log-capacity", "8"]))
