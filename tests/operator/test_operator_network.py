"""The rendered NetworkPolicies, evaluated against pod labels (issue 30).

A small evaluator of NetworkPolicy semantics (ingress, podSelector matchLabels,
namespaceSelector, ipBlock, ports; a pod selected by any policy takes only what
some policy allows) answers "may this peer reach that port" for the pods the
operator renders, with the labels their templates carry. The dev cluster test
(``test_operator_security_cluster.py``) checks the same policies enforced on a
real node.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import kubernetes_validate
import pytest
from dscache_operator.desired import children, network_policies, prewarm_job, router_deployment
from dscache_operator.policy import DEFAULT_POLICY, AdminPolicy
from dscache_operator.spec import parse_spec
from spec_helpers import OWNER, status_for

SPEC = parse_spec(
    {
        "model": {"preset": "tiny-gqa"},
        "server": {"port": 8000},
        "sidecar": {"metricsPort": 9102},
        "prewarm": {"prompts": {"name": "p"}},
    }
)
STATUS = status_for(SPEC)


@dataclass(frozen=True)
class Peer:
    """A pod (namespace, labels, ip) or a host address (labels None)."""

    namespace: str
    labels: dict[str, str] | None
    ip: str
    ns_labels: dict[str, str] = field(default_factory=dict)


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what the operator renders
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_ok(rule_peer: dict[str, Any], src: Peer, dst_ns: str) -> bool:
    if "ipBlock" in rule_peer:
        return ipaddress.ip_address(src.ip) in ipaddress.ip_network(rule_peer["ipBlock"]["cidr"])
    if src.labels is None:
        return False  # a host address matches no pod selector
    if "namespaceSelector" in rule_peer:
        ns_ok = _matches(rule_peer["namespaceSelector"], src.ns_labels)
    else:
        ns_ok = src.namespace == dst_ns
    return ns_ok and _matches(rule_peer.get("podSelector", {}), src.labels)


def allowed(policies: list[dict[str, Any]], src: Peer, dst: Peer, port: int) -> bool:
    """Whether ``src`` may open a TCP connection to ``dst`` on ``port``."""
    assert dst.labels is not None
    mine = [
        p
        for p in policies
        if p["metadata"]["namespace"] == dst.namespace
        and _matches(p["spec"]["podSelector"], dst.labels)
    ]
    if not mine:
        return True  # not isolated
    for p in mine:
        for rule in p["spec"]["ingress"]:
            ports = [x["port"] for x in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_ok(r, src, dst.namespace) for r in peers):
                return True
    return False


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = obj["spec"]["template"]["metadata"]["labels"]
    return out


def _pods() -> dict[str, Peer]:
    objs = children(OWNER, SPEC, STATUS, ("10.0.0.1:8000",), (), monitoring=False)
    model = next(o for o in objs if o["kind"] == "Deployment" and "model" in str(_labels(o)))
    job = prewarm_job(
        OWNER,
        SPEC,
        STATUS.model_copy(update={"canary_slot": "green", "canary_revision": "r"}),
        ("10.0.0.9:8000",),
    )
    assert job is not None
    ns = OWNER.namespace
    prom_ns = {"kubernetes.io/metadata.name": "monitoring"}
    return {
        "model": Peer(ns, _labels(model), "10.0.0.1"),
        "router": Peer(ns, _labels(router_deployment(OWNER, SPEC)), "10.0.0.2"),
        "prewarm": Peer(ns, _labels(job), "10.0.0.3"),
        "other pod": Peer(ns, {"app": "web"}, "10.0.0.4"),
        "other namespace's router": Peer(
            "attacker", _labels(router_deployment(OWNER, SPEC)), "10.0.9.2"
        ),
        "prometheus": Peer(
            "monitoring", {"app.kubernetes.io/name": "prometheus"}, "10.0.5.5", prom_ns
        ),
        "node": Peer("", None, "10.246.0.1"),
    }


def test_the_policies_are_valid_objects_owned_by_the_resource() -> None:
    pols = network_policies(OWNER, SPEC, STATUS, DEFAULT_POLICY)
    assert [p["metadata"]["name"] for p in pols] == ["chat-model", "chat-router", "chat-prewarm"]
    for p in pols:
        kubernetes_validate.validate(p, "1.35.0", strict=True)
        assert p["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert network_policies(OWNER, SPEC, STATUS, AdminPolicy(network_policies=False)) == []
    assert {p["kind"] for p in children(OWNER, SPEC, STATUS, (), (), monitoring=False)} >= {
        "NetworkPolicy"
    }


@pytest.mark.parametrize(
    ("src", "dst", "port", "ok"),
    [
        ("router", "model", 8000, True),  # requests, the picker's keyinfo
        ("router", "model", 9102, True),  # the picker's holdings filters
        ("prewarm", "model", 8000, True),  # prompts; mined templates
        ("prewarm", "model", 9102, False),
        ("prometheus", "model", 8000, True),  # the server's /metrics
        ("prometheus", "model", 9102, True),  # the sidecar's /metrics
        ("other pod", "model", 8000, False),
        ("other pod", "model", 9102, False),
        ("other namespace's router", "model", 8000, False),
        ("node", "model", 8000, False),  # not a metrics peer by default
        ("model", "model", 8000, False),
        ("other pod", "router", 8080, True),  # the entry point
        ("other pod", "router", 8090, False),  # the picker is loopback-only anyway
        ("other pod", "prewarm", 8000, False),
        ("router", "prewarm", 8080, False),
    ],
)
def test_who_reaches_which_port(src: str, dst: str, port: int, ok: bool) -> None:
    pods = _pods()
    pols = network_policies(OWNER, SPEC, STATUS, DEFAULT_POLICY)
    assert allowed(pols, pods[src], pods[dst], port) is ok


def test_the_admin_names_the_metrics_peers() -> None:
    pods = _pods()
    host = AdminPolicy(metrics_peers=({"ipBlock": {"cidr": "10.246.0.1/32"}},))
    pols = network_policies(OWNER, SPEC, STATUS, host)
    assert allowed(pols, pods["node"], pods["model"], 9102)
    assert not allowed(pols, pods["prometheus"], pods["model"], 9102)
    none = network_policies(OWNER, SPEC, STATUS, AdminPolicy(metrics_peers=()))
    assert not allowed(none, pods["prometheus"], pods["model"], 8000)
    assert allowed(none, pods["router"], pods["model"], 8000)
