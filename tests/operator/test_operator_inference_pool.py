"""``spec.routing.gateway: inferencePool``: an InferencePool whose endpoint picker is the picker.

Off (``nginx``, the default) nothing changes. On: the router pods' picker also serves
Envoy ext_proc on ``inferencePool.eppPort`` with its pool from a file in the router's
ConfigMap (every track's pods by slot, the canary weight as the slot's share of new
sessions), a Service ``<name>-epp`` reaches it, and an InferencePool ``<name>`` selects
every model pod and names that Service, where the cluster serves the API. The gateway's
pods may reach the picker and the model pods' server port, no one else beyond the router.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from dscache_operator.children import (
    DEPLOYMENTS,
    JOBS,
    OBJECTIVES,
    PODS,
    IndexedChildren,
    objective_entry,
)
from dscache_operator.desired import (
    EPP_POOL_KEY,
    children,
    model_deployment,
    network_policies,
    objective_priorities,
    router_config_hash,
    router_deployment,
    selector_labels,
)
from dscache_operator.desired.router import epp_pool
from dscache_operator.policy import DEFAULT_POLICY
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import parse_spec
from dscache_router.epp import read_pool_file
from dscache_router.nginx import RouterConfig
from spec_helpers import OWNER, status_for
from test_operator_network import Peer, allowed

BASE: dict[str, Any] = {
    "model": {"preset": "tiny-gqa", "revision": "1"},
    "prewarm": {"prompts": {"name": "chat-prompts"}},
}
GATEWAY = {"app.kubernetes.io/name": "envoy"}
POOL: dict[str, Any] = {
    **BASE,
    "routing": {
        "gateway": "inferencePool",
        "inferencePool": {
            "eppPort": 9100,
            "maxInflight": 16,
            "failureMode": "FailOpen",
            "gatewayPeers": [{"podLabels": GATEWAY, "namespaceLabels": {"gw": "yes"}}],
        },
    },
}
STABLE = ("10.1.0.1:8000", "10.1.0.2:8000")


def _objs(doc: dict[str, Any], pools: bool = True) -> dict[tuple[str, str], dict[str, Any]]:
    spec = parse_spec(doc)
    objs = children(
        OWNER, spec, status_for(spec), STABLE, (), monitoring=False, inference_pools=pools
    )
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _picker(doc: dict[str, Any]) -> dict[str, Any]:
    dep = router_deployment(OWNER, parse_spec(doc))
    kubernetes_validate.validate(dep, "1.35.0", strict=True)
    (picker,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "picker"]
    return dict(picker)


def test_nginx_by_default_and_then_nothing_of_the_pool() -> None:
    objs = _objs(BASE)
    assert ("Service", "chat-epp") not in objs
    assert not any(kind == "InferencePool" for kind, _ in objs)
    assert EPP_POOL_KEY not in objs["ConfigMap", "chat-router"]["data"]
    assert "--epp" not in _picker(BASE)["args"]


def test_the_pool_names_every_model_pod_and_the_picker_service() -> None:
    objs = _objs(POOL)
    pool = objs["InferencePool", "chat"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    # Every model pod, of every slot: the picker chooses the track, not the gateway.
    assert pool["spec"]["selector"] == {"matchLabels": selector_labels(OWNER, "model")}
    model = model_deployment(OWNER, parse_spec(POOL), status_for(parse_spec(POOL)), "blue")
    pod_labels = model["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port = model["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "chat-epp",
        "port": {"number": 9100},
        "failureMode": "FailOpen",
    }
    assert pool["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    svc = objs["Service", "chat-epp"]
    kubernetes_validate.validate(svc, "1.35.0", strict=True)
    assert svc["spec"]["selector"] == selector_labels(OWNER, "router")
    (sp,) = svc["spec"]["ports"]
    assert (sp["port"], sp["targetPort"], sp["appProtocol"]) == (9100, "epp", "kubernetes.io/h2c")


def test_without_the_pool_api_the_picker_still_serves_without_a_pool_object() -> None:
    objs = _objs(POOL, pools=False)
    assert ("Service", "chat-epp") in objs
    assert not any(kind == "InferencePool" for kind, _ in objs)


def test_the_picker_serves_ext_proc_from_the_pool_file_on_the_pods_address() -> None:
    picker = _picker(POOL)
    args = picker["args"]
    assert args[args.index("--epp-port") + 1] == "9100"
    assert args[args.index("--epp-host") + 1] == "0.0.0.0"
    assert args[args.index("--epp-pool-file") + 1] == f"/etc/dscache-router/{EPP_POOL_KEY}"
    assert args[args.index("--epp-max-inflight") + 1] == "16"
    assert args[args.index("--session-header") + 1] == "X-Session-ID"
    # Its HTTP face stays on loopback: only ext_proc is for the gateway.
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert picker["ports"] == [{"name": "epp", "containerPort": 9100, "protocol": "TCP"}]
    mounts = {m["mountPath"]: m for m in picker["volumeMounts"]}
    assert mounts["/etc/dscache-router"]["readOnly"] is True


def test_the_pool_file_is_what_the_picker_reads_and_a_new_one_nudges_the_pods(
    tmp_path: Path,
) -> None:
    cfg = RouterConfig(
        listen="8080",
        stable=STABLE,
        canary=("10.1.1.1:8000",),
        previous=("10.1.2.1:8000",),
        stable_name="blue",
        canary_name="green",
        previous_name="red",
        canary_weight=25,
    )
    path = tmp_path / EPP_POOL_KEY
    path.write_text(epp_pool(cfg))
    endpoints, weights, _objectives = read_pool_file(path)
    assert endpoints == {
        "10.1.0.1:8000": "blue",
        "10.1.0.2:8000": "blue",
        "10.1.1.1:8000": "green",
        "10.1.2.1:8000": "red",
    }
    # New sessions: a quarter to the canary slot, none to the previous one (it keeps its own).
    assert weights == {"blue": 75, "green": 25, "red": 0}
    cm = _objs(POOL)["ConfigMap", "chat-router"]
    moved = {**cm, "data": {**cm["data"], EPP_POOL_KEY: json.dumps({"endpoints": {}})}}
    assert router_config_hash(moved) != router_config_hash(cm)
    # Without a pool the hash is nginx.conf's alone, as the cluster test and older
    # operators compute it: an upgrade re-annotates no router pod.
    plain = _objs(BASE)["ConfigMap", "chat-router"]
    conf = plain["data"]["nginx.conf"].encode()
    assert router_config_hash(plain) == hashlib.sha256(conf).hexdigest()[:16]


def test_only_the_gateway_reaches_the_picker_and_the_model_pods_directly() -> None:
    spec = parse_spec(POOL)
    status = status_for(spec)
    pols = network_policies(OWNER, spec, status, DEFAULT_POLICY)
    model_labels = model_deployment(OWNER, spec, status, "blue")["spec"]["template"]["metadata"]
    model = Peer(OWNER.namespace, model_labels["labels"], "10.0.0.1")
    router_labels = router_deployment(OWNER, spec)["spec"]["template"]["metadata"]["labels"]
    router = Peer(OWNER.namespace, router_labels, "10.0.0.2")
    gateway = Peer("gateways", GATEWAY, "10.0.9.9", {"gw": "yes"})
    stranger = Peer("web", {"app": "web"}, "10.0.8.8")
    assert allowed(pols, gateway, router, 9100) and allowed(pols, gateway, model, 8000)
    assert not allowed(pols, stranger, router, 9100)
    assert not allowed(pols, stranger, model, 8000)
    # Without the pool the gateway reaches neither.
    plain = parse_spec(BASE)
    closed = network_policies(OWNER, plain, status_for(plain), DEFAULT_POLICY)
    assert not allowed(closed, gateway, model, 8000)
    assert not allowed(closed, gateway, router, 9100)


@pytest.mark.parametrize(
    "routing",
    [
        {"gateway": "inferencePool", "picker": {"enabled": False}},
        {"gateway": "envoy"},
        {"inferencePool": {"eppPort": 80}},
        {"inferencePool": {"failureMode": "Sometimes"}},
    ],
)
def test_a_bad_setting_is_refused(routing: dict[str, Any]) -> None:
    with pytest.raises((InvalidSpecError, ValueError)):
        parse_spec({**BASE, "routing": routing})


def _objective(
    name: str, pool: str, priority: Any = None, kind: str | None = None
) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": pool, **({"kind": kind} if kind else {})}
    spec: dict[str, Any] = {
        "poolRef": ref,
        **({"priority": priority} if priority is not None else {}),
    }
    return {"metadata": {"name": name}, "spec": spec}


def test_the_pools_objectives_reach_the_pool_file_and_a_pool_without_any_is_unchanged(
    tmp_path: Path,
) -> None:
    found = objective_priorities(
        [
            _objective("batch", OWNER.name, -2),
            _objective("chat", OWNER.name),  # no priority: 0, as the extension has it
            _objective("elsewhere", "other-pool", -9),
            _objective("not-a-pool", OWNER.name, 5, kind="Service"),
            _objective("odd", OWNER.name, "high"),
        ],
        OWNER.name,
    )
    assert found == {"batch": -2, "chat": 0}
    cfg = RouterConfig(listen="8080", stable=STABLE, stable_name="blue")
    assert epp_pool(cfg, {}) == epp_pool(cfg)  # no objectives: the file of before
    path = tmp_path / EPP_POOL_KEY
    path.write_text(epp_pool(cfg, found))
    assert read_pool_file(path)[2] == {"batch": -2, "chat": 0}
    spec = parse_spec({**BASE, "routing": {"gateway": "inferencePool"}})
    objs = children(OWNER, spec, status_for(spec), STABLE, (), monitoring=False, objectives=found)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert json.loads(cm["data"][EPP_POOL_KEY])["objectives"] == found


def test_the_operator_keeps_objectives_in_an_index_by_namespace_and_only_what_it_reads() -> None:
    """The reconcile reads a pool's InferenceObjectives from kopf's index (a watch)
    instead of listing them every tick: each entry is filed under its namespace and
    keeps its name, pool and priority (not its labels, annotations or other fields),
    enough for the same priorities."""
    full = _objective("batch", OWNER.name, -2)
    full["metadata"].update(namespace="team-a", labels={"a": "b"}, annotations={"x": "y" * 512})
    full["spec"]["modelName"] = "m"
    entry = objective_entry("team-a", full)
    assert entry == {
        "team-a": {
            "metadata": {"name": "batch"},
            "spec": {"poolRef": {"name": OWNER.name}, "priority": -2},
        }
    }
    unset = objective_entry("team-a", _objective("chat", OWNER.name))["team-a"]
    other = objective_entry("team-b", _objective("other", OWNER.name, -9))["team-b"]
    index = {"team-a": [entry["team-a"], unset], "team-b": [other]}
    reader = IndexedChildren({DEPLOYMENTS: {}, JOBS: {}, PODS: {}, OBJECTIVES: index})
    assert objective_priorities(reader.objectives("team-a"), OWNER.name) == {"batch": -2, "chat": 0}
    assert reader.objectives("team-c") == []
