"""The session router: ConfigMap, Deployment and Service of NGINX (pure).

With ``routing.picker`` on (and bounded loads), each router pod also runs the
picker (``dscache picker`` on the pod's loopback) that NGINX's Lua consults per
request for KV-aware routing; its liveness probe goes through NGINX
(:data:`~dscache_router.nginx.render.PICKER_HEALTH_PATH`), so the picker
listens on loopback only.

The router runs NGINX itself (exec form, no shell) and reloads itself when
its mounted config changes: the rendered config carries a Lua timer that sends
NGINX's master a SIGHUP when the file changes (see
:mod:`dscache_router.nginx`), so the pod template never changes with the
config and a weight change restarts nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from dscache_router.nginx import PromptKey, RouterConfig, render_nginx_conf
from dscache_router.nginx.render import PICKER_HEALTH_PATH

from dscache_operator.desired import common
from dscache_operator.desired.common import TMP, Obj, Owner, meta, selector_labels
from dscache_operator.desired.model import internal_token_env
from dscache_operator.schema import parse_duration
from dscache_operator.spec import DeepSeekCacheDeploymentSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

ROUTER_PORT = 8080
ROUTER_CONF_DIR = "/etc/dscache-router"
ROUTER_CONF = f"{ROUTER_CONF_DIR}/nginx.conf"
#: The endpoint picker's pool file, beside nginx.conf (routing.gateway: inferencePool).
EPP_POOL_KEY = "epp-pool.json"
#: The InferencePool API (Gateway API Inference Extension).
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
#: The InferenceObjective's API (llm-d's router; the extension's before v1.1): a
#: request names its objective, whose priority says whether it may be shed.
INFERENCE_OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
#: Pod annotation the operator sets on live router pods after a config change: a pod
#: update makes the kubelet refresh the ConfigMap volume at once instead of on its
#: next periodic sync; the router's own watcher then reloads NGINX.
ROUTER_CONFIG_HASH = "dscache.io/router-config-hash"


def router_config(
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    stable: tuple[str, ...],
    canary: tuple[str, ...],
    previous: tuple[str, ...] = (),
) -> RouterConfig:
    """The router's config: each track's pod addresses, named by slot, and the canary weight.

    Tracks are named after their slot (blue, green), so a session the router
    remembers on a slot stays there when the slot's role changes: on promotion
    the old stable slot becomes the previous track, which takes no new session
    but keeps serving its own until they end or the slot retires.
    """
    r = spec.routing
    # Upstream names must differ even for tracks without pods: "idle", "retired".
    prev = status.previous_slot
    warm = prev is not None and prev != status.canary_slot
    memory = round(parse_duration(r.session_memory))
    picker = picker_active(spec)
    return RouterConfig(
        listen=str(ROUTER_PORT),
        stable=stable,
        canary=canary if status.canary_slot is not None else (),
        previous=previous if warm and memory > 0 else (),
        stable_name=status.stable_slot or "blue",
        canary_name=status.canary_slot or "idle",
        previous_name=prev if warm and prev is not None else "retired",
        session_memory_s=memory,
        canary_weight=status.weight,
        session_header=r.session_header,
        cookie_name=r.cookie_name,
        prompt_key=PromptKey(mode=r.prompt_key, max_bytes=r.prompt_key_bytes),
        balance_factor=r.balance_factor,
        picker=f"127.0.0.1:{r.picker.port}" if picker else None,
        picker_timeout_ms=round(parse_duration(r.picker.timeout) * 1000),
        load_modules=tuple(r.load_modules),
        pid_file=f"{TMP}/nginx.pid",
        temp_dir=TMP,
        error_log="stderr",
        access_log="off",
        watch_config=True,
        config_path=ROUTER_CONF,
        debug_headers=r.debug_headers,
    )


def picker_active(spec: DeepSeekCacheDeploymentSpec) -> bool:
    """Whether NGINX consults the picker (enabled, and the Lua balancer is on)."""
    return spec.routing.picker.enabled and spec.routing.balance_factor > 0


def epp_active(spec: DeepSeekCacheDeploymentSpec) -> bool:
    """Whether the picker is also an InferencePool's endpoint picker."""
    return spec.routing.gateway == "inferencePool" and spec.routing.picker.enabled


def picker_runs(spec: DeepSeekCacheDeploymentSpec) -> bool:
    """Whether the router pods run the picker (for NGINX, the gateway, or both)."""
    return picker_active(spec) or epp_active(spec)


def objective_priorities(objectives: Iterable[Obj], pool: str) -> dict[str, int]:
    """Each InferenceObjective's priority (unset: 0) among ``objectives`` whose
    ``spec.poolRef`` names the InferencePool ``pool``."""
    out: dict[str, int] = {}
    for obj in objectives:
        spec = obj.get("spec") or {}
        ref = spec.get("poolRef") or {}
        if ref.get("name") != pool or ref.get("kind", "InferencePool") != "InferencePool":
            continue
        priority = spec.get("priority", 0)
        if isinstance(priority, int) and not isinstance(priority, bool):
            out[str(obj["metadata"]["name"])] = priority
    return out


def epp_pool(config: RouterConfig, objectives: Mapping[str, int] | None = None) -> str:
    """The endpoint picker's pool file: every track's pods by slot name, the share of
    new sessions each slot takes (the previous slot none: it keeps its own sessions),
    and the pool's objectives' priorities (only when it has some: the file of a pool
    without any stays as it was)."""
    endpoints = {a: config.stable_name for a in config.stable}
    endpoints.update({a: config.canary_name for a in config.canary})
    endpoints.update({a: config.previous_name for a in config.previous})
    weight = round(config.canary_weight, 2) if config.canary else 0.0
    weights = {config.stable_name: round(100 - weight, 2), config.canary_name: weight}
    weights[config.previous_name] = 0.0
    doc: dict[str, Any] = {"endpoints": endpoints, "trackWeights": weights}
    if objectives:
        doc["objectives"] = dict(objectives)
    return json.dumps(doc, sort_keys=True)


def _picker_container(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """``dscache picker`` on the pod's loopback; NGINX proxies its health for the probe.
    With a generated salt it shows the model pods the internal token (its Secret's)."""
    p = spec.routing.picker
    args = ["picker", "--host", "127.0.0.1", "--port", str(p.port)]
    args += ["--holdings-port", str(spec.sidecar.metrics_port)]
    events = spec.cache.kv_events
    if events.enabled:
        # The sidecars' KV events: exact holdings, fresher than the filters.
        args += ["--kv-events-port", str(events.port)]
        args += ["--kv-events-replay-port", str(events.replay_port)]
    engine_events = events.engine_ports(spec.engine)
    if engine_events:
        # vLLM's own events: what each pod's GPU prefix cache holds.
        args += ["--vllm-events-port", str(engine_events[0])]
        args += ["--vllm-events-replay-port", str(engine_events[1])]
    args += ["--similarity-threshold", f"{p.similarity_threshold:g}"]
    for term, weight in sorted(p.domain_terms.items()):
        args += ["--domain-term", f"{term}={weight}"]
    ports: list[Obj] = []
    mounts: list[Obj] = [{"name": "tmp", "mountPath": TMP}]
    if epp_active(spec):
        # The gateway's ext_proc face, on the pod's address; the pool comes from the
        # ConfigMap beside nginx.conf and is reloaded when the kubelet updates it.
        ip = spec.routing.inference_pool
        args += ["--epp", "--epp-host", "0.0.0.0", "--epp-port", str(ip.epp_port)]
        args += ["--epp-pool-file", f"{ROUTER_CONF_DIR}/{EPP_POOL_KEY}"]
        args += ["--session-header", spec.routing.session_header]
        if ip.max_inflight:
            args += ["--epp-max-inflight", str(ip.max_inflight)]
        ports.append({"name": "epp", "containerPort": ip.epp_port, "protocol": "TCP"})
        mounts.append({"name": "config", "mountPath": ROUTER_CONF_DIR, "readOnly": True})
    # By number: a probe's named port is looked up in its own container's ports, and
    # "http" is NGINX's (the kubelet could not parse it, so the picker was never probed).
    probe = {"httpGet": {"path": PICKER_HEALTH_PATH, "port": ROUTER_PORT}, "periodSeconds": 10}
    env = internal_token_env(owner, spec.tenant_salt.source, "DSCACHE_PICKER_INTERNAL_TOKEN")
    return {
        **common.container("picker", p.image, ["dscache"], args),
        **({"env": env} if env else {}),
        **({"ports": ports} if ports else {}),
        # Up to 5 minutes to start on a busy node; then 6 misses in a row restart it.
        "startupProbe": {**probe, "failureThreshold": 30},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": common.resources(p.resources),
        "volumeMounts": mounts,
    }


def router_configmap(
    owner: Owner,
    config: RouterConfig,
    epp: bool = False,
    objectives: Mapping[str, int] | None = None,
) -> Obj:
    """ConfigMap ``<name>-router`` with the rendered nginx.conf (and, with ``epp``, the
    endpoint picker's pool file, with ``objectives``' priorities)."""
    data = {"nginx.conf": render_nginx_conf(config)}
    if epp:
        data[EPP_POOL_KEY] = epp_pool(config, objectives)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(owner, f"{owner.name}-router", common.labels(owner, "router", "all")),
        "data": data,
    }


def router_config_hash(configmap: Obj) -> str:
    """The value of :data:`ROUTER_CONFIG_HASH` for a router ConfigMap: of nginx.conf, and
    of the endpoint picker's pool file where there is one (a new pool must reach the
    picker as soon as a new config reaches NGINX; without one the hash is nginx.conf's
    alone, as before pools existed, so an upgrade nudges no pod)."""
    text: str = configmap["data"]["nginx.conf"]
    pool = configmap["data"].get(EPP_POOL_KEY)
    if pool is not None:
        text += "\0" + pool
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def router_deployment(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """Deployment ``<name>-router``: NGINX itself, reloading when its ConfigMap changes."""
    r = spec.routing
    sel = selector_labels(owner, "router")
    probe = {"httpGet": {"path": "/dscache/router/health", "port": "http"}, "periodSeconds": 5}
    args = ["-p", TMP, "-e", "stderr", "-c", ROUTER_CONF, "-g", "daemon off;"]
    nginx = {
        **common.container("nginx", r.image, ["nginx"], args),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "livenessProbe": probe,
        "readinessProbe": probe,
        "resources": common.resources(r.resources),
        "volumeMounts": [
            {"name": "config", "mountPath": ROUTER_CONF_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": TMP},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(owner, f"{owner.name}-router", common.labels(owner, "router", "all")),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": sel},
            "template": {
                "metadata": {"labels": sel},
                "spec": {
                    **common.pod_spec(spec.scheduling, spread=sel),
                    "containers": [nginx, _picker_container(owner, spec)]
                    if picker_runs(spec)
                    else [nginx],
                    "volumes": [
                        {"name": "config", "configMap": {"name": f"{owner.name}-router"}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                    ],
                },
            },
        },
    }


def router_service(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """Service ``<name>``: where clients send requests."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(owner, owner.name, common.labels(owner, "router", "all")),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner, "router"),
            "ports": [{"name": "http", "port": spec.routing.port, "targetPort": "http"}],
        },
    }


def epp_service(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """Service ``<name>-epp``: the router pods' picker as the InferencePool's endpoint picker
    (gRPC without TLS: ``appProtocol`` h2c)."""
    port = spec.routing.inference_pool.epp_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(owner, f"{owner.name}-epp", common.labels(owner, "router", "all")),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner, "router"),
            "ports": [
                {
                    "name": "grpc",
                    "port": port,
                    "targetPort": "epp",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                }
            ],
        },
    }


def inference_pool(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """InferencePool ``<name>``: every model pod of the resource (all tracks: the picker
    chooses the track, so a gateway's split never moves a conversation), its server
    port, and ``<name>-epp`` as the endpoint picker."""
    ip = spec.routing.inference_pool
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": meta(owner, owner.name, common.labels(owner, "model", "all")),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner, "model")},
            "targetPorts": [{"number": spec.server.port}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": f"{owner.name}-epp",
                "port": {"number": ip.epp_port},
                "failureMode": ip.failure_mode,
            },
        },
    }
