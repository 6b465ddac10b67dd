"""The NetworkPolicies of a deployment: who may reach its pods (pure).

With the admin's ``network_policies`` on (the default), each resource gets:

* ``<name>-model``: the model pods take connections only
  - on the server port from this resource's router pods (requests; the
    picker's ``/dscache/keyinfo``) and prewarm Job pods (the prompts; the
    stable pods' mined templates),
  - on the sidecar's metrics port from the router pods (the picker's holdings
    filters),
  - with ``cache.kvEvents`` on, on the KV-event ports (the sidecar's, and with
    engine vllm vLLM's own, ``kvEvents.engine``) from the router pods and the
    subscribers the spec names (llm-d's indexer, Dynamo's router),
  - on both ports from the metrics peers the admin names (Prometheus),
  - with ``routing.gateway: inferencePool``, on the server port from the
    gateway's pods (``routing.inferencePool.gatewayPeers``; none named: any pod):
    the gateway sends requests to the pod the picker chose itself;
* ``<name>-router``: the router pods take connections on the router port
  only, from anywhere (it is the service's entry point), and with an
  InferencePool on the endpoint picker's port from the gateway's pods;
* ``<name>-prewarm``: the prewarm Job's pods take none.

Only ingress is restricted: a model pod's way out (the shared tier's Redis,
DNS) is the cluster's egress policy's business; the chart renders the Redis
side (only the sidecars may reach it). Policies are additive, so a policy of
the admin's can open more. Kubelet probes come from the node, which
NetworkPolicy implementations let through.

Invariants: the ports are every port a track of the resource serves on (its
stored revisions' and the spec's), so a rollout that changes a port is open on
both tracks while both run.
"""

from __future__ import annotations

from dscache_operator.desired.common import Obj, Owner, labels, meta, selector_labels
from dscache_operator.desired.router import ROUTER_PORT, epp_active
from dscache_operator.policy import AdminPolicy
from dscache_operator.revision import KVEventsPeer, RevisionSource
from dscache_operator.spec import DeepSeekCacheDeploymentSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus


def _tcp(ports: list[int]) -> list[Obj]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _peer(peer: KVEventsPeer) -> Obj:
    """A NetworkPolicy peer of KV-event subscribers."""
    out: Obj = {"podSelector": {"matchLabels": dict(peer.pod_labels)}}
    if peer.namespace_labels is not None:
        out["namespaceSelector"] = {"matchLabels": dict(peer.namespace_labels)}
    return out


def _unique(peers: list[Obj]) -> list[Obj]:
    out: list[Obj] = []
    for p in peers:
        if p not in out:
            out.append(p)
    return out


def _policy(owner: Owner, name: str, component: str, ingress: list[Obj]) -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(owner, name, labels(owner, component, "all")),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def network_policies(
    owner: Owner,
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    policy: AdminPolicy,
) -> list[Obj]:
    """The resource's NetworkPolicies (none when the admin turned them off)."""
    if not policy.network_policies:
        return []
    sources = [spec.revision_source()]
    sources += [RevisionSource.model_validate(ss.source) for ss in status.slots.values()]
    server = sorted({s.server.port for s in sources})
    sidecar = sorted({s.sidecar.metrics_port for s in sources})
    router = {"podSelector": {"matchLabels": selector_labels(owner, "router")}}
    prewarm = {"podSelector": {"matchLabels": selector_labels(owner, "prewarm")}}
    model_ingress: list[Obj] = [
        {"from": [router, prewarm], "ports": _tcp(server)},
        {"from": [router], "ports": _tcp(sidecar)},
    ]
    if policy.metrics_peers:
        peers = [dict(p) for p in policy.metrics_peers]
        model_ingress.append({"from": peers, "ports": _tcp(sorted({*server, *sidecar}))})
    events = [s.cache.kv_events for s in sources if s.cache.kv_events.enabled]
    if events:
        ports = sorted(
            {p for e in events for p in (e.port, e.replay_port)}
            | {p for s in sources for p in s.cache.kv_events.engine_ports(s.engine) or ()}
        )
        subscribers = [router] + [_peer(p) for e in events for p in e.subscribers]
        model_ingress.append({"from": _unique(subscribers), "ports": _tcp(ports)})
    router_ingress: list[Obj] = [{"ports": _tcp([ROUTER_PORT])}]
    if epp_active(spec):
        ip = spec.routing.inference_pool
        gateway = _unique([_peer(p) for p in ip.gateway_peers])
        from_gateway: Obj = {"from": gateway} if gateway else {}
        model_ingress.append({**from_gateway, "ports": _tcp(server)})
        router_ingress.append({**from_gateway, "ports": _tcp([ip.epp_port])})
    return [
        _policy(owner, f"{owner.name}-model", "model", model_ingress),
        _policy(owner, f"{owner.name}-router", "router", router_ingress),
        _policy(owner, f"{owner.name}-prewarm", "prewarm", []),
    ]
