"""The router's bounded loads, retries, metrics and header hygiene, on real NGINX.

Debian's NGINX with the Lua module runs the rendered config in front of stand-in
pods (:class:`router_helpers.Pod`) in this process. What a user would notice:

* with no load the Lua balancer picks exactly the pod NGINX's own consistent
  hash picks (sessions keep their pods when bounded loads are turned on);
* a hot key whose pod is over its bound spills to the next pod on the ring, and
  with the factor at 0 it piles on one pod;
* a session (the client's own id) stays on its pod whatever the load, new sessions
  spill, and a spilled session stays where it was placed;
* a pod's own in-flight report (every router replica's requests) counts in the
  bound, and never reaches the client;
* a dead pod costs no request (retried on the next pod) and shows in the retry
  and upstream-error counters;
* ``/dscache/router/metrics`` counts requests by track role and status class;
* a client can never name its tenant, and only a client's own id reaches the
  model server as a session.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
from dscache_router.ring import Ring
from dscache_tools.net import free_port
from router_helpers import Nginx, Pod, call, metric, scrape, wait_for

from dscache import metricnames as names

REQUESTS = names.ROUTER_REQUESTS + "_total"
RETRIES = names.ROUTER_RETRIES + "_total"
TRIES = names.ROUTER_UPSTREAM_REQUESTS + "_total"
ERRORS = names.ROUTER_UPSTREAM_ERRORS + "_total"
SKIPS = names.ROUTER_OVERLOAD_SKIPS + "_total"


def _stable(pods: dict[str, Pod]) -> tuple[str, ...]:
    return tuple(pods[n].address for n in ("s0", "s1", "s2"))


def _body(opening: str) -> bytes:
    messages = [{"role": "system", "content": opening}, {"role": "user", "content": "hi"}]
    return json.dumps({"model": "m", "messages": messages}).encode()


@pytest.mark.parametrize("factor", [1.25, 2.0])
def test_without_load_the_balancer_picks_nginx_own_consistent_hash_pod(
    nginx: Nginx, pods: dict[str, Pod], factor: float
) -> None:
    stable = _stable(pods)
    sids = [f"ring-{i}" for i in range(60)]
    chosen: dict[float, dict[str, str]] = {}
    for f in (0.0, factor):
        nginx.start(nginx.config(stable=stable, balance_factor=f))
        chosen[f] = {s: nginx.get("/v1/models", {"X-Session-ID": s})[1]["x-pod"] for s in sids}
    assert chosen[factor] == chosen[0.0]
    assert len(set(chosen[0.0].values())) == 3  # and the keys do spread


def test_a_pods_own_inflight_report_counts_in_the_bound_and_stays_internal(
    nginx: Nginx, pods: dict[str, Pod]
) -> None:
    stable = _stable(pods)
    nginx.start(nginx.config(stable=stable, balance_factor=1.25))
    busy = pods["s0"]
    busy.reported = 50  # the other router replicas' requests on it
    ring = Ring(stable)
    to_busy = [f"rep-{i}" for i in range(300) if ring.walk(f"rep-{i}")[0] == busy.address]
    # The first answer from it teaches this router its load (and the client sees none).
    status, headers = nginx.get("/v1/models", {"X-Session-ID": to_busy[0]})
    assert (status, headers["x-pod"]) == (200, "s0")
    assert "x-dscache-inflight" not in headers
    placed = [nginx.get("/v1/models", {"X-Session-ID": s})[1]["x-pod"] for s in to_busy[1:4]]
    gauge = metric(scrape(nginx.port), names.ROUTER_UPSTREAM_INFLIGHT, upstream=busy.address)
    assert gauge == 50
    # New sessions whose hash names it spill although this router sent it nothing
    # else; the session it already served stays.
    assert "s0" not in placed, placed
    assert nginx.get("/v1/models", {"X-Session-ID": to_busy[0]})[1]["x-pod"] == "s0"


def _send_held(
    nginx: Nginx,
    held: list[Pod],
    count: int,
    body: bytes,
    *,
    balanced: bool,
    headers: list[dict[str, str]] | None = None,
) -> list[str]:
    """``count`` concurrent requests while ``held`` pods hold them: one prompt key, or
    request ``i`` with ``headers[i]``. The pods that answered, in request order."""
    for p in held:
        p.hold()
    base = sum(p.arrived for p in held)
    answers = ["failed"] * count  # in request order

    def one(i: int) -> None:
        extra = headers[i] if headers else {}
        out = nginx.request("POST", "/v1/chat/completions", body, {"Content-Type": "x", **extra})[1]
        answers[i] = out.get("x-pod", "failed")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for i, t in enumerate(threads):
        t.start()
        # One at a time into the router, so each choice sees the ones before it.
        wait_for(
            f"request {i + 1} at a pod",
            lambda n=base + i + 1: sum(p.arrived for p in held) >= n or None,
            10,
            nginx.workdir / "error.log",
        )
    if balanced:  # the balancer counts what is in flight
        samples = scrape(nginx.port)
        inflight = [
            metric(samples, names.ROUTER_UPSTREAM_INFLIGHT, upstream=p.address) for p in held
        ]
        assert sum(inflight) == count
    for p in held:
        p.release()
    for t in threads:
        t.join(30)
    return answers


def test_a_hot_prompt_spills_to_the_next_pod_only_with_bounded_loads(
    nginx: Nginx, pods: dict[str, Pod]
) -> None:
    two = (pods["s0"], pods["s1"])
    stable = tuple(p.address for p in two)
    body = _body("You are a helpful assistant for everyone. " * 20)

    nginx.start(nginx.config(stable=stable, balance_factor=0))
    piled = Counter(_send_held(nginx, list(two), 6, body, balanced=False))
    assert len(piled) == 1  # plain consistent hash: one pod takes the whole hot key

    nginx.start(nginx.config(stable=stable, balance_factor=1.25))
    spread = Counter(_send_held(nginx, list(two), 6, body, balanced=True))
    assert "failed" not in spread and len(spread) == 2
    # No pod above ceil(1.25 * 6 / 2) = 4 in flight; the hot key's own pod keeps most.
    assert max(spread.values()) <= 4
    home = piled.most_common(1)[0][0]
    assert spread[home] == max(spread.values())
    samples = scrape(nginx.port)
    home_addr = next(p.address for p in two if p.name == home)
    assert metric(samples, SKIPS, upstream=home_addr) >= 1
    # Every try ended: nothing is left in flight.
    assert all(metric(samples, names.ROUTER_UPSTREAM_INFLIGHT, upstream=a) == 0 for a in stable)


def test_a_session_stays_on_its_pod_over_the_bound_new_sessions_spill(
    nginx: Nginx, pods: dict[str, Pod]
) -> None:
    """A session's pod holds its KV: load never moves it; new sessions go elsewhere."""
    two = (pods["s0"], pods["s1"])
    stable = tuple(p.address for p in two)
    body = _body("a conversation of its own " * 5)
    # Where each id's home pod is (plain hash: the balancer's no-load choice, test above).
    nginx.start(nginx.config(stable=stable, balance_factor=0))
    home = {f"user-{i}": nginx.get("/v1/models", {"X-Session-ID": f"user-{i}"})[1]["x-pod"]
            for i in range(40)}  # fmt: skip
    pod0 = [sid for sid, pod in home.items() if pod == "s0"]
    assert len(pod0) >= 7
    nginx.start(nginx.config(stable=stable, balance_factor=1.25))
    veteran = pod0[0]
    assert nginx.get("/v1/models", {"X-Session-ID": veteran})[1]["x-pod"] == "s0"  # pinned
    # Six requests of the veteran at once: all on s0, far over ceil(1.25 * 6 / 2) = 4.
    same = [{"X-Session-ID": veteran}] * 6
    assert Counter(_send_held(nginx, list(two), 6, body, balanced=True, headers=same)) == {"s0": 6}
    # Six new sessions whose home is s0, at once: s0 takes its bound, the rest spill ...
    new = [{"X-Session-ID": sid} for sid in pod0[1:7]]
    placed = _send_held(nginx, list(two), 6, body, balanced=True, headers=new)
    assert Counter(placed)["s0"] <= 4 and Counter(placed)["s1"] >= 2
    # ... and a spilled session stays where it was placed, now that s0 is idle again.
    for h, pod in zip(new, placed, strict=True):
        assert nginx.get("/v1/models", h)[1]["x-pod"] == pod


@pytest.mark.parametrize("factor", [0.0, 1.25])
def test_a_dead_pod_is_retried_on_the_next_one_and_counted(
    nginx: Nginx, pods: dict[str, Pod], factor: float
) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    stable = (dead, pods["s0"].address)
    nginx.start(nginx.config(stable=stable, balance_factor=factor))
    statuses = Counter(nginx.get("/v1/models", {"X-Session-ID": f"d-{i}"})[0] for i in range(40))
    assert statuses == {200: 40}
    samples = scrape(nginx.port)
    assert metric(samples, RETRIES, track="stable") >= 1
    assert metric(samples, ERRORS, upstream=dead) >= 1
    assert metric(samples, ERRORS, upstream=pods["s0"].address) == 0
    assert metric(samples, TRIES, upstream=pods["s0"].address) == 40
    assert metric(samples, REQUESTS, track="stable", code="2xx") == 40


def test_metrics_count_requests_by_track_and_status_class(
    nginx: Nginx, pods: dict[str, Pod]
) -> None:
    stable = _stable(pods)
    canary = (pods["c0"].address,)
    nginx.start(nginx.config(stable=stable, canary=canary, canary_weight=30))
    tracks = Counter(
        nginx.get("/v1/models", {"X-Session-ID": f"m-{i}"})[1]["x-dscache-track"]
        for i in range(100)
    )
    missing = [nginx.get("/v1/missing", {"X-Session-ID": f"m-{i}"})[0] for i in range(5)]
    assert missing == [404] * 5
    samples = scrape(nginx.port)
    ok = {t: metric(samples, REQUESTS, track=t, code="2xx") for t in ("stable", "canary")}
    assert ok == {"stable": tracks["stable"], "canary": tracks["canary"]}
    assert 10 <= ok["canary"] <= 50
    four = sum(metric(samples, REQUESTS, track=t, code="4xx") for t in ("stable", "canary"))
    assert four == 5
    assert metric(samples, names.ROUTER_CANARY_WEIGHT) == 30
    assert metric(samples, names.ROUTER_BALANCE_FACTOR) == 1.25
    # Per-pod tries add up; pod labels are only configured addresses.
    pod_labels = {dict(k[1]).get("upstream") for k in samples if k[0] == TRIES}
    assert pod_labels == set(stable + canary)
    assert sum(metric(samples, TRIES, upstream=a) for a in stable + canary) == 105
    # The router's own endpoints are not counted as proxied requests.
    assert sum(v for k, v in scrape(nginx.port).items() if k[0] == REQUESTS) == 105


def test_a_client_never_names_its_tenant_nor_a_session_it_did_not_send(
    nginx: Nginx, pods: dict[str, Pod]
) -> None:
    pod = pods["s0"]
    nginx.start(nginx.config(stable=(pod.address,)))
    spoof = {"X-Dscache-Tenant": "someone-else", "X-Dscache-Gateway-Token": "guessed"}
    nginx.get("/v1/models", {**spoof, "X-Session-ID": "mine"})
    nginx.get("/v1/models", {**spoof, "Cookie": "dscache_session=from-cookie"})
    nginx.request("POST", "/v1/chat/completions", _body("shared opening " * 30), spoof)
    nginx.get("/v1/models", spoof)
    assert len(pod.headers) == 4
    for seen in pod.headers:
        assert "x-dscache-tenant" not in seen and "x-dscache-gateway-token" not in seen
        assert seen["x-dscache-route-key"]  # every request is routed by some key
    # A client's header or cookie is its session; a prompt or fresh key is not.
    sessions = [h.get("x-session-id") for h in pod.headers]
    assert sessions == ["mine", "from-cookie", None, None]


def test_the_metrics_endpoint_is_off_with_metrics_off(nginx: Nginx, pods: dict[str, Pod]) -> None:
    nginx.start(nginx.config(stable=_stable(pods), metrics=False, balance_factor=0))
    resp = call(nginx.port, names.ROUTER_METRICS_PATH)
    # Neither served nor proxied: the router forwards /v1/ only.
    assert resp is not None and resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"
    assert not any(p.seen for p in pods.values())
