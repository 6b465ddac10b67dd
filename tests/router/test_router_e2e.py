"""End to end on loopback: real NGINX + real model servers + real sidecars.

One stack per module (model servers take seconds to load): two stable pods and one
canary pod, each ``dscache server --model mini-gqa`` with its own ``dscache sidecar``,
behind NGINX running the rendered router config with its debug headers on. The
tests check what a user of the system would notice: stickiness, the issued cookie,
canary sessions staying put as the weight grows, the cache paying off on a second
pass through the router, and a sidecar crash costing no request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dscache_tools.demo.stack import LocalStack, Server, StackOptions
from dscache_tools.loadgen import LoadConfig, LoadReport, RequestResult, parse_counters, run_load
from dscache_tools.workload import ChatRequest, WorkloadConfig, generate
from needs import need_nginx
from prometheus_client.parser import text_string_to_metric_families

from dscache import metricnames as names

pytestmark = pytest.mark.slow


class Pods:
    """The module's stack and who is who."""

    def __init__(self, stack: LocalStack, stable: list[Server], canary: list[Server]) -> None:
        self.stack = stack
        self.stable = stable
        self.canary = canary
        assert stack.router is not None
        self.url = stack.router.url

    @property
    def all(self) -> list[Server]:
        return self.stable + self.canary

    def by_address(self, address: str) -> Server:
        return next(s for s in self.all if s.address == address)

    def metrics_urls(self) -> tuple[str, ...]:
        return tuple(s.metrics_url for s in self.all)


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    need_nginx()
    workdir: Path = tmp_path_factory.mktemp("e2e")
    with LocalStack(workdir, StackOptions(model="mini-gqa", threads=1)) as stack:
        stable = stack.start_servers(2, cache=True, prefix="stable")
        canary = stack.start_servers(1, cache=True, prefix="canary")
        stack.start_router(stable, canary, canary_weight=10)
        yield Pods(stack, stable, canary)


def _chat(client: httpx.Client, text: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 1,
        "temperature": 0.0,
    }
    resp = client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text
    return resp


def test_the_same_session_always_reaches_the_same_server(pods: Pods) -> None:
    seen: dict[str, set[str]] = {}
    with httpx.Client(base_url=pods.url, timeout=120) as client:
        for turn in range(3):
            for i in range(10):
                sid = f"e2e-sticky-{i}"
                resp = _chat(client, f"turn {turn}", {"X-Session-ID": sid})
                seen.setdefault(sid, set()).add(resp.headers["X-Dscache-Upstream"])
                # The router passed the key upstream; the server echoes it.
                assert resp.headers["X-Session-ID"] == sid
                assert "set-cookie" not in resp.headers  # the client named its session
    assert all(len(ups) == 1 for ups in seen.values()), seen
    assert len({next(iter(u)) for u in seen.values()}) >= 2  # sessions do spread


def test_a_request_without_id_sticks_by_its_prompt_and_is_no_session(pods: Pods) -> None:
    with httpx.Client(base_url=pods.url, timeout=120) as client:
        first = _chat(client, "hello without any id")
        # No header, no cookie: keyed by the prompt's leading messages. That key routes
        # the request but names no session: no cookie, no session id upstream, so two
        # users who share an opening never share a session (nor its ordering lock).
        assert first.headers["X-Dscache-Key-Source"] == "prompt"
        assert "set-cookie" not in first.headers
        assert "X-Session-ID" not in first.headers  # the server was sent none to echo
        pod = first.headers["X-Dscache-Upstream"]
    # Another client, same opening: the same pod, by the prompt.
    with httpx.Client(base_url=pods.url, timeout=120) as other:
        again = _chat(other, "hello without any id")
        assert again.headers["X-Dscache-Key-Source"] == "prompt"
        assert again.headers["X-Dscache-Upstream"] == pod


def test_a_request_with_no_key_at_all_gets_a_cookie_and_then_sticks(pods: Pods) -> None:
    with httpx.Client(base_url=pods.url, timeout=120) as client:
        # No id and no prompt to key by: a fresh key, issued as the session cookie.
        first = client.get("/v1/models")
        assert first.status_code == 200
        assert first.headers["X-Dscache-Key-Source"] == "new"
        cookie = first.cookies.get("dscache_session")
        assert cookie, first.headers
        pod = first.headers["X-Dscache-Upstream"]
        for turn in range(3):
            resp = _chat(client, f"follow-up {turn}")  # the client sends the cookie back
            assert resp.headers["X-Dscache-Key-Source"] == "cookie"
            assert resp.headers["X-Dscache-Upstream"] == pod
            assert resp.headers["X-Session-ID"] == cookie  # its own id is its session
            assert "set-cookie" not in resp.headers


def test_canary_sessions_stay_on_the_canary_as_the_weight_grows(pods: Pods) -> None:
    canary_pod = pods.canary[0].address

    def tracks() -> dict[str, str]:
        out = {}
        with httpx.Client(base_url=pods.url, timeout=30) as client:
            for i in range(200):
                sid = f"e2e-canary-{i}"
                resp = client.get("/v1/models", headers={"X-Session-ID": sid})
                assert resp.status_code == 200
                track = resp.headers["X-Dscache-Track"]
                on_canary = resp.headers["X-Dscache-Upstream"] == canary_pod
                assert on_canary == (track == "canary")
                out[sid] = track
        return out

    try:
        at10 = tracks()
        pods.stack.set_canary_weight(50)
        at50 = tracks()
    finally:
        pods.stack.set_canary_weight(10)
    canary10 = {s for s, t in at10.items() if t == "canary"}
    canary50 = {s for s, t in at50.items() if t == "canary"}
    assert 5 <= len(canary10) <= 40
    assert 70 <= len(canary50) <= 130
    assert canary10 <= canary50, f"left the canary: {sorted(canary10 - canary50)}"


def _replay(pods: Pods, workload: list[ChatRequest], **kw: object) -> LoadReport:
    cfg = LoadConfig(
        target=pods.url, concurrency=2, metrics_urls=pods.metrics_urls(), progress=False
    )
    return asyncio.run(run_load(cfg, workload, **kw))  # type: ignore[arg-type]


def test_the_second_pass_hits_the_cache(pods: Pods) -> None:
    workload = generate(
        WorkloadConfig(sessions=3, seed=11, companies=2, min_turns=3, max_turns=3, max_tokens=2)
    )
    first = _replay(pods, workload)
    second = _replay(pods, workload)
    assert first.errors == second.errors == 0
    assert first.token_hit_ratio is not None and second.token_hit_ratio is not None
    assert second.token_hit_ratio >= 0.85
    assert second.token_hit_ratio > first.token_hit_ratio
    # What clients saw agrees with what the servers counted.
    assert second.client_token_hit_ratio == pytest.approx(second.token_hit_ratio, abs=0.02)


def _fallbacks(server: Server) -> float:
    text = httpx.get(server.metrics_url, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == names.CACHE_FALLBACKS + "_total"
    )


def test_a_sidecar_killed_mid_run_fails_no_request(pods: Pods) -> None:
    # Last in the module: it leaves one pod without its sidecar.
    workload = generate(
        WorkloadConfig(
            sessions=4, seed=12, companies=2, min_turns=4, max_turns=4, max_tokens=2,
            drop_id_share=0.0,
        )
    )  # fmt: skip
    victim: list[Server] = []
    before: dict[str, float] = {}

    def on_result(res: RequestResult) -> None:
        if victim or res.upstream is None or res.turn != 1:
            return
        server = pods.by_address(res.upstream)
        assert server.sidecar is not None
        before[server.name] = _fallbacks(server)
        pods.stack.kill_sidecar(server.sidecar)
        victim.append(server)

    report = _replay(pods, workload, on_result=on_result)
    assert victim, "the sidecar was never killed"
    assert report.errors == 0, report.error_kinds
    server = victim[0]
    # The pod kept serving its sessions after the crash, by recomputing.
    assert _fallbacks(server) > before[server.name]
    assert not server.sidecar.child.alive()  # type: ignore[union-attr]
    text = httpx.get(server.metrics_url, timeout=10).text
    recomputed = f'{names.PROMPT_TOKENS}{{{names.SOURCE_LABEL}="{names.SOURCE_RECOMPUTED}"}}'
    assert parse_counters(text)[recomputed] > 0
