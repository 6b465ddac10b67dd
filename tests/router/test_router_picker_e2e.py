"""KV-aware routing end to end: real NGINX consulting a real picker, real servers and sidecars.

Three cache-on pods behind the router with ``routing="kv"``, every server, sidecar
and the picker with the internal token (key info and filters are the picker's
alone). What a user notices:
every turn of a conversation reaches the pod holding its history whether or not it
carries its session id (the id and the prompt key hash to different pods), the
follow-ups reuse that history, a restarted picker finds it again from the sidecars'
published filters alone, and a dead picker costs no request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_sidecar.holdings import HOLDINGS_PATH, INTERNAL_TOKEN_HEADER, HoldingsFilter
from dscache_tools.demo.stack import LocalStack, StackOptions
from dscache_tools.polling import poll
from needs import need_nginx
from prometheus_client.parser import text_string_to_metric_families

from dscache import metricnames as names
from dscache.keys import block_keys

pytestmark = pytest.mark.slow

WORDS = [
    "ledger",
    "accrual",
    "covenant",
    "dividend",
    "margin",
    "liquidity",
    "tranche",
    "coupon",
    "hedge",
    "audit",
]


def document(seed: int, words: int = 900) -> str:
    """A long text of its own per conversation (several 256-token blocks)."""
    return " ".join(
        f"{WORDS[(seed * 7 + i * i) % len(WORDS)]}{(seed + i) % 97}" for i in range(words)
    )


#: The internal token every server, sidecar and the picker of the stack get: key info
#: and holdings filters are the picker's alone.
TOKEN = "picker-e2e-token"
SHOWN = {INTERNAL_TOKEN_HEADER: TOKEN}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    need_nginx()
    workdir: Path = tmp_path_factory.mktemp("picker-e2e")
    with pytest.MonkeyPatch.context() as env:  # the children inherit it
        for part in ("SERVER", "SIDECAR", "PICKER"):
            env.setenv(f"DSCACHE_{part}_INTERNAL_TOKEN", TOKEN)
        with LocalStack(workdir, StackOptions(model="mini-gqa", threads=1)) as st:
            servers = st.start_servers(3, cache=True)
            st.start_router(servers, routing="kv")
            yield st


def _turn(
    client: httpx.Client, messages: list[dict[str, str]], session: str | None
) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 2, "temperature": 0.0}
    headers = {"X-Session-ID": session} if session else {}
    resp = client.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


def _cached(resp: httpx.Response) -> int:
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _picks(url: str) -> dict[str, float]:
    text = httpx.get(url + names.ROUTER_METRICS_PATH, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == names.ROUTER_PICKS + "_total":
                out[s.labels["reason"]] = s.value
    return out


def _conversation(client: httpx.Client, seed: int, turns: int) -> list[httpx.Response]:
    """Turns alternating with and without the session id (the gateway drops it)."""
    messages = [
        {"role": "system", "content": f"Analyst desk {seed}."},
        {"role": "user", "content": document(seed) + " Summarise."},
    ]
    out = []
    for t in range(turns):
        resp = _turn(client, messages, f"conv-{seed}" if t % 2 == 0 else None)
        out.append(resp)
        answer = resp.json()["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Follow-up {t}: {document(seed + 100 + t, 60)}"},
        ]
    return out


def test_every_turn_reaches_its_history_with_or_without_the_id(stack: LocalStack) -> None:
    assert stack.router is not None
    with httpx.Client(base_url=stack.router.url, timeout=300) as client:
        for seed in range(4):
            responses = _conversation(client, seed, turns=4)
            pods = {r.headers["X-Dscache-Upstream"] for r in responses}
            sources = [r.headers["X-Dscache-Key-Source"] for r in responses]
            assert sources == ["header", "prompt", "header", "prompt"]
            assert len(pods) == 1, (seed, [r.headers["X-Dscache-Upstream"] for r in responses])
            # The follow-ups reuse the history the earlier turns left on that pod (turn 2
            # comes milliseconds after turn 1, before its blocks are stored in the
            # background; from turn 3 on, at least turn 1's blocks are there).
            assert all(_cached(r) > 0 for r in responses[2:]), [_cached(r) for r in responses]
    picks = _picks(stack.router.url)
    # The id-less turns were placed by what the pods hold (a pick that timed out on a
    # loaded machine falls back to the hash, so "failed" is bounded, not zero).
    assert picks["prefix"] >= 4
    assert picks["failed"] <= 2
    # The picker listens on loopback; its own figures reach Prometheus through NGINX.
    text = httpx.get(stack.router.url + names.PICKER_METRICS_PATH, timeout=10).text
    decisions = {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "dscache_picker_decisions_total"
    }
    assert decisions.get("prefix", 0) >= picks["prefix"]


def test_a_restarted_picker_finds_the_history_in_the_sidecars_filters(stack: LocalStack) -> None:
    assert stack.router is not None
    with httpx.Client(base_url=stack.router.url, timeout=300) as client:
        first = _conversation(client, 50, turns=1)[0]
    pod = next(s for s in stack.servers if s.address == first.headers["X-Dscache-Upstream"])
    messages = [
        {"role": "system", "content": "Analyst desk 50."},
        {"role": "user", "content": document(50) + " Summarise."},
    ]
    # The pod's sidecar publishes the turn's blocks (stored in the background), to the
    # bearer of the internal token only.
    assert httpx.get(pod.url + "/dscache/keyinfo", timeout=10).status_code == 401
    info = httpx.get(pod.url + "/dscache/keyinfo", headers=SHOWN, timeout=10).json()
    ids = DeepSeekTokenizer().apply_chat_template([ChatMessage(**m) for m in messages])
    keys = block_keys(bytes.fromhex(info["root"]), ids, info["block_tokens"])
    assert pod.sidecar is not None and len(keys) >= 2
    url = f"http://127.0.0.1:{pod.sidecar.metrics_port}{HOLDINGS_PATH}"
    assert httpx.get(url, timeout=10).status_code == 401

    def published() -> bool:
        r = httpx.get(url, headers=SHOWN, timeout=10)
        return r.status_code == 200 and HoldingsFilter.from_bytes(r.content).prefix_length(
            keys
        ) == len(keys)

    assert poll(published, timeout=30), "the sidecar never published the turn's blocks"
    since = time.monotonic()
    stack.start_router(list(stack.servers), routing="kv")  # a new NGINX and picker: no memory
    router = stack.router
    assert router is not None and router.picker is not None

    def fetched_since() -> bool:
        text = httpx.get(f"http://{router.picker}/metrics", timeout=10).text
        values = {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("dscache_picker_filter")
        }
        return (
            values.get("dscache_picker_filters") == len(stack.servers)
            and values["dscache_picker_filter_age_seconds"] < time.monotonic() - since
        )

    assert poll(fetched_since, timeout=30), "the new picker never fetched every filter"
    follow = [
        *messages,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Risks?"},
    ]
    with httpx.Client(base_url=router.url, timeout=300) as client:
        resp = _turn(client, follow, None)
    assert resp.headers["X-Dscache-Upstream"] == pod.address
    assert _cached(resp) >= len(keys) * info["block_tokens"]
    assert _picks(router.url)["prefix"] >= 1


def test_a_dead_picker_costs_no_request(stack: LocalStack) -> None:
    router = stack.router
    assert router is not None and router.picker_child is not None
    stack.procs.kill(router.picker_child)
    before = _picks(router.url)["failed"]
    with httpx.Client(base_url=router.url, timeout=300) as client:
        for seed in range(3):
            _conversation(client, 200 + seed, turns=2)
    assert _picks(router.url)["failed"] >= before + 6  # placed by the hash instead
