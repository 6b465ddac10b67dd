"""The router's placement computed in Python (``dscache.routing``) is NGINX's own, on real NGINX.

A prewarm that warms "the pod a prompt's requests will reach" trusts
:func:`dscache_router.ring.prompt_key` and :class:`dscache_router.ring.Ring` to agree with
the router byte for byte. Here real NGINX (Debian's, with the Lua module) routes
session ids and id-less prompts of every shape the prompt key reads (escaped
quotes, nested content parts, more messages than it hashes, a body longer than
it scans, a completions ``prompt``) to stand-in pods, with NGINX's own
``hash ... consistent`` and with the Lua balancer; the key each pod got and the
pod itself must be what the Python computes.
"""

from __future__ import annotations

import json

import pytest
from dscache_router.ring import Ring, prompt_key
from router_helpers import Nginx, Pod


def _bodies() -> list[bytes]:
    chat = [
        {"role": "system", "content": 'You are "precise".\\ Quote \u00e9 {not json}'},
        {"role": "user", "content": [{"type": "text", "text": "part [one]"}]},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "third"},
    ]
    bodies = [
        json.dumps({"model": "m", "messages": chat[:1]}).encode(),
        json.dumps({"model": "m", "messages": chat}).encode(),
        json.dumps({"messages": chat, "max_tokens": 1}, separators=(",", ":")).encode(),
        # As the OpenAI Python SDK (httpx) and `dscache prewarm` send it: compact UTF-8.
        json.dumps({"messages": chat}, ensure_ascii=False, separators=(",", ":")).encode(),
        json.dumps({"messages": [{"role": "system", "content": "x" * 9000}]}).encode(),
        json.dumps({"model": "m", "prompt": [1, 2, 3] * 50, "max_tokens": 1}).encode(),
        json.dumps({"model": "m", "prompt": "plain text prompt"}).encode(),
    ]
    bodies += [
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}).encode() for i in range(30)
    ]
    return bodies


@pytest.mark.parametrize("factor", [0.0, 1.25])
def test_python_ring_and_prompt_key_place_requests_where_nginx_does(
    nginx: Nginx, pods: dict[str, Pod], factor: float
) -> None:
    stable = tuple(pods[n].address for n in ("s0", "s1", "s2"))
    by_address = {p.address: p.name for p in pods.values()}
    ring = Ring(reversed(stable))  # the ring is the set's, whatever the order
    nginx.start(nginx.config(stable=stable, balance_factor=factor))
    for sid in [f"session-{i}" for i in range(40)]:
        status, out = nginx.get("/v1/models", {"X-Session-ID": sid})
        assert status == 200
        assert out["x-route"] == sid
        assert out["x-pod"] == by_address[ring.walk(sid)[0]], sid
    placed = set()
    for body in _bodies():
        status, out = nginx.request("POST", "/v1/chat/completions", body, {"Content-Type": "x"})
        assert status == 200
        key = prompt_key(body)
        assert out["x-route"] == key, body[:80]
        assert out["x-pod"] == by_address[ring.walk(key)[0]], body[:80]
        placed.add(out["x-pod"])
    assert len(placed) == 3  # the prompts do spread over the track


def test_a_walk_lists_every_pod_once_and_keeps_keys_when_a_pod_joins() -> None:
    pods = [f"10.0.0.{i}:8000" for i in range(1, 5)]
    ring = Ring(pods)
    keys = [f"k{i}" for i in range(400)]
    for k in keys[:20]:
        assert sorted(ring.walk(k)) == sorted(pods)
    grown = Ring([*pods, "10.0.0.9:8000"])
    moved = [k for k in keys if grown.walk(k)[0] != ring.walk(k)[0]]
    assert all(grown.walk(k)[0] == "10.0.0.9:8000" for k in moved)  # only to the new pod
    assert 0 < len(moved) < len(keys) / 2
    with pytest.raises(ValueError, match="host:port"):
        Ring(["10.0.0.1"])
    with pytest.raises(ValueError, match="at least one"):
        Ring([])
