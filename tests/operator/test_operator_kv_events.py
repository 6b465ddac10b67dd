"""``spec.cache.kvEvents``: the sidecars publish their holdings as vLLM KV events.

Off by default, and then no pod template changes. On: each sidecar binds the PUB and
replay sockets on the spec's ports (named container ports), logs subscribers in with
the resource's internal token unless ``open``, and the model pods' NetworkPolicy lets
the router pods and the named subscribers (llm-d's indexer, say) reach those ports,
and no one else.
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from dscache_operator.desired import model_deployment, network_policies, router_deployment
from dscache_operator.policy import DEFAULT_POLICY
from dscache_operator.revision import revision_of
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import parse_spec
from spec_helpers import OWNER, status_for
from test_operator_network import Peer, allowed

BASE: dict[str, Any] = {
    "model": {"preset": "tiny-gqa", "revision": "1"},
    "prewarm": {"prompts": {"name": "chat-prompts"}},
}
INDEXER = {"app": "llm-d-kv-indexer"}


def _sidecar(cache: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_spec({**BASE, "cache": cache})
    dep = model_deployment(OWNER, parsed, status_for(parsed), "blue")
    (side,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"]
    kubernetes_validate.validate(dep, "1.35.0", strict=True)
    return dict(side)


def test_off_by_default_and_then_no_template_changes() -> None:
    side = _sidecar({})
    assert not any(a.startswith("--kv-events") for a in side["args"])
    assert [p["name"] for p in side["ports"]] == ["metrics"]
    assert _sidecar({"kvEvents": {"enabled": False, "port": 6000}}) == side


def test_on_the_sidecar_binds_both_sockets_and_logs_subscribers_in() -> None:
    side = _sidecar({"kvEvents": {"enabled": True, "port": 6001, "replayPort": 6002}})
    args = side["args"]
    assert args[args.index("--kv-events-endpoint") + 1] == "tcp://*:6001"
    assert args[args.index("--kv-events-replay-endpoint") + 1] == "tcp://*:6002"
    ports = {p["name"]: p["containerPort"] for p in side["ports"]}
    assert ports == {"metrics": 9102, "kv-events": 6001, "kv-replay": 6002}
    env = {e["name"]: e for e in side["env"]}
    # The internal token the sidecar already has is the subscribers' password.
    assert "DSCACHE_SIDECAR_INTERNAL_TOKEN" in env
    assert "DSCACHE_SIDECAR_KV_EVENTS_OPEN" not in env
    opened = _sidecar({"kvEvents": {"enabled": True, "open": True}})
    assert {e["name"]: e.get("value") for e in opened["env"]}[
        "DSCACHE_SIDECAR_KV_EVENTS_OPEN"
    ] == "true"


@pytest.mark.parametrize(
    "bad",
    [
        {"port": 80},
        {"replayPort": 70000},
        {"subscribers": [{"podLabels": {"bad key!": "x"}}]},
        {"unknown": True},
    ],
)
def test_a_bad_setting_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises((InvalidSpecError, ValueError)):
        parse_spec({**BASE, "cache": {"kvEvents": {"enabled": True, **bad}}})


def test_only_the_router_and_the_named_subscribers_reach_the_event_ports() -> None:
    spec = parse_spec(
        {
            **BASE,
            "cache": {
                "kvEvents": {
                    "enabled": True,
                    "subscribers": [{"podLabels": INDEXER, "namespaceLabels": {"team": "routing"}}],
                }
            },
        }
    )
    status = status_for(spec)
    pols = network_policies(OWNER, spec, status, DEFAULT_POLICY)
    dep = model_deployment(OWNER, spec, status, "blue")
    model = Peer(OWNER.namespace, dep["spec"]["template"]["metadata"]["labels"], "10.0.0.1")
    router_pod = router_deployment(OWNER, spec)["spec"]["template"]["metadata"]["labels"]
    router = Peer(OWNER.namespace, router_pod, "10.0.0.2")
    indexer = Peer("llm-d", INDEXER, "10.0.3.3", {"team": "routing"})
    elsewhere = Peer("llm-d", INDEXER, "10.0.3.4", {"team": "other"})
    stranger = Peer(OWNER.namespace, {"app": "web"}, "10.0.0.4")
    for port in (5557, 5558):
        assert allowed(pols, router, model, port)
        assert allowed(pols, indexer, model, port)
        assert not allowed(pols, elsewhere, model, port)
        assert not allowed(pols, stranger, model, port)
    # The ports stay closed to a resource without events.
    plain = parse_spec(BASE)
    closed = network_policies(OWNER, plain, status_for(plain), DEFAULT_POLICY)
    assert not allowed(closed, indexer, model, 5557)


def test_off_the_revision_is_unchanged_and_on_it_rolls_out() -> None:
    plain = revision_of(parse_spec(BASE).revision_source())
    off = parse_spec({**BASE, "cache": {"kvEvents": {"enabled": False, "port": 6000}}})
    assert revision_of(off.revision_source()) == plain
    on = parse_spec({**BASE, "cache": {"kvEvents": {"enabled": True}}})
    assert revision_of(on.revision_source()) != plain


def test_the_routers_picker_follows_the_events_when_they_are_on() -> None:
    def picker_args(cache: dict[str, Any]) -> list[str]:
        dep = router_deployment(OWNER, parse_spec({**BASE, "cache": cache}))
        (picker,) = [
            c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "picker"
        ]
        return list(picker["args"])

    assert "--kv-events-port" not in picker_args({})
    args = picker_args({"kvEvents": {"enabled": True, "port": 6001, "replayPort": 6002}})
    assert args[args.index("--kv-events-port") + 1] == "6001"
    assert args[args.index("--kv-events-replay-port") + 1] == "6002"


# -- vLLM's own KV events (engine vllm): its GPU prefix cache, for the picker ----------

VLLM: dict[str, Any] = {"model": {"path": "/models/ds"}, "engine": "vllm"}


def _containers(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The vLLM server container and the router's picker container of ``spec``."""
    parsed = parse_spec(spec)
    dep = model_deployment(OWNER, parsed, status_for(parsed), "blue")
    kubernetes_validate.validate(dep, "1.35.0", strict=True)
    (server,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    router = router_deployment(OWNER, parsed)
    (picker,) = [
        c for c in router["spec"]["template"]["spec"]["containers"] if c["name"] == "picker"
    ]
    return server, picker


def test_with_engine_vllm_vllm_publishes_its_own_events_and_the_picker_follows_them() -> None:
    server, picker = _containers({**VLLM, "cache": {"kvEvents": {"enabled": True}}})
    args = server["args"]
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5559",
        "replay_endpoint": "tcp://*:5560",
    }
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": 8000, "engine-events": 5559, "engine-replay": 5560}
    p = picker["args"]
    assert p[p.index("--vllm-events-port") + 1] == "5559"
    assert p[p.index("--vllm-events-replay-port") + 1] == "5560"
    # The sidecar's own events go on as before, beside vLLM's.
    assert p[p.index("--kv-events-port") + 1] == "5557"


@pytest.mark.parametrize(
    "spec",
    [
        {**VLLM},  # events off
        {**VLLM, "cache": {"kvEvents": {"enabled": True, "engine": {"enabled": False}}}},
        {**BASE, "cache": {"kvEvents": {"enabled": True}}},  # the reference server
    ],
    ids=["events-off", "engine-off", "reference-engine"],
)
def test_no_engine_events_unless_on_with_engine_vllm(spec: dict[str, Any]) -> None:
    parsed = parse_spec(spec)
    dep = model_deployment(OWNER, parsed, status_for(parsed), "blue")
    text = json.dumps(dep)
    assert "--kv-events-config" not in text and "engine-events" not in text
    assert "--vllm-events-port" not in json.dumps(router_deployment(OWNER, parsed))


def test_the_router_reaches_vllms_event_ports_and_strangers_do_not() -> None:
    spec = parse_spec({**VLLM, "cache": {"kvEvents": {"enabled": True}}})
    status = status_for(spec)
    pols = network_policies(OWNER, spec, status, DEFAULT_POLICY)
    dep = model_deployment(OWNER, spec, status, "blue")
    model = Peer(OWNER.namespace, dep["spec"]["template"]["metadata"]["labels"], "10.0.0.1")
    router_pod = router_deployment(OWNER, spec)["spec"]["template"]["metadata"]["labels"]
    router = Peer(OWNER.namespace, router_pod, "10.0.0.2")
    stranger = Peer(OWNER.namespace, {"app": "web"}, "10.0.0.4")
    for port in (5557, 5558, 5559, 5560):
        assert allowed(pols, router, model, port)
        assert not allowed(pols, stranger, model, port)


def test_resources_with_events_from_before_keep_their_revision() -> None:
    # The engine section came later: at its default it is no part of the revision.
    on = {**BASE, "cache": {"kvEvents": {"enabled": True}}}
    before = revision_of(parse_spec(on).revision_source())
    explicit = {**BASE, "cache": {"kvEvents": {"enabled": True, "engine": {"port": 5559}}}}
    assert revision_of(parse_spec(explicit).revision_source()) == before
    moved = {**BASE, "cache": {"kvEvents": {"enabled": True, "engine": {"port": 6100}}}}
    assert revision_of(parse_spec(moved).revision_source()) != before


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {**VLLM, "cache": {"kvEvents": {"enabled": True, "engine": {"port": 5557}}}},
            "must differ",
        ),
        (
            {**VLLM, "cache": {"kvEvents": {"enabled": True, "replayPort": 5557}}},
            "must differ",
        ),
        (
            {
                **VLLM,
                "cache": {"kvEvents": {"enabled": True}},
                "vllm": {"args": ["--kv-events-config", "{}"]},
            },
            "the operator sets it",
        ),
    ],
    ids=["engine-port-is-the-sidecars", "replay-is-the-pub", "own-kv-events-config"],
)
def test_clashing_event_settings_are_refused_with_the_reason(
    spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec(spec)
    # vLLM's own --kv-events-config is the user's to give when the operator's is off.
    parse_spec(
        {
            **VLLM,
            "cache": {"kvEvents": {"enabled": True, "engine": {"enabled": False}}},
            "vllm": {"args": ["--kv-events-config", "{}"]},
        }
    )
