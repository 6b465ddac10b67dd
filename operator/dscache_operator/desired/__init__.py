"""Every child object of a ``DeepSeekCacheDeployment``, as pure functions.

Children (``<name>`` is the resource's name):

* per track ``<slot>`` in blue/green: Deployment and Service ``<name>-<slot>``
  (model server + KV sidecar per pod), PodDisruptionBudget ``<name>-<slot>``;
* the router: ConfigMap, Deployment and PodDisruptionBudget ``<name>-router``,
  Service ``<name>`` (the entry point);
* during a prewarm: Job ``<name>-prewarm-<revision>`` (created once per
  revision with the ready canary pods' addresses; a Job's template is
  immutable, so it is never re-applied);
* optionally ServiceMonitor and PrometheusRule ``<name>``.

Images: the model server runs the server image (torch); the sidecar, the
hostPath ``cache-owner`` init container and the prewarm Job run the slim core
image; the router runs NGINX itself (exec form, no shell) and reloads itself
when its mounted config changes. A hostPath cache lives in
``<hostPath>/<namespace>/<name>-<slot>``: one directory per track, the same
after a pod restart.

Invariants: the same inputs give the same dicts (so re-applying is a no-op);
every child carries an ownerReference to the resource (garbage collection),
the ``app.kubernetes.io/*`` labels and ``dscache.io/track``; selectors use only
name, instance, component and slot, which never change for an object. A
track's pod template is built only from the :class:`RevisionSource` stored for
that track in the status, never from the live spec, so a rollout never
restarts the stable pods; its hash is written both on the Deployment's labels
and in the pod template's annotations, so a ``kubectl rollout undo`` (which
replaces the template but not the Deployment's labels) is visible as a
mismatch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from dscache_operator import API_VERSION, KIND
from dscache_operator.analysis import token_hit_rate
from dscache_operator.nginx import PromptKey, RouterConfig, render_nginx_conf
from dscache_operator.rollout import slot_replicas
from dscache_operator.spec import (
    DeepSeekCacheDeploymentSpec,
    ResourcesSpec,
    RevisionSource,
    SchedulingSpec,
    parse_duration,
)
from dscache_operator.status import DeepSeekCacheDeploymentStatus

Obj = dict[str, Any]

TEMPLATE_HASH = "dscache.io/template-hash"
TRACK = "dscache.io/track"
SLOT = "dscache.io/slot"
REVISION = "dscache.io/revision"
CACHE_DIR = "/var/cache/dscache"
SOCKET_DIR = "/run/dscache"
SOCKET = f"{SOCKET_DIR}/sidecar.sock"
ROUTER_PORT = 8080
ROUTER_CONF_DIR = "/etc/dscache-router"
RUN_AS = 10001
TMP = "/tmp"  # noqa: S108 - an emptyDir of the pod's own, not a shared /tmp
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_FACTORS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}

#: Pod annotation the operator sets on live router pods after a config change: a pod
#: update makes the kubelet refresh the ConfigMap volume at once instead of on its
#: next periodic sync; the router's own watcher then reloads NGINX.
ROUTER_CONFIG_HASH = "dscache.io/router-config-hash"
ROUTER_CONF = f"{ROUTER_CONF_DIR}/nginx.conf"
PREWARM_TARGETS_ENV = "DSCACHE_PREWARM_TARGETS"


def parse_quantity(value: str) -> int:
    """``10Gi`` -> bytes (Kubernetes quantity suffixes)."""
    m = _QUANTITY.match(value)
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    return int(float(m.group(1)) * _FACTORS[m.group(2)])


@dataclass(frozen=True)
class Owner:
    """The resource the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> Obj:
        """The ownerReference every child carries."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    """Labels a selector may use: they never change for an object."""
    return {
        "app.kubernetes.io/name": "dscache",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
    }


def labels(owner: Owner, component: str, track: str) -> dict[str, str]:
    """The standard labels of a child."""
    return {
        **selector_labels(owner, component),
        "app.kubernetes.io/part-of": "dscache",
        "app.kubernetes.io/managed-by": "dscache-operator",
        TRACK: track,
    }


def _meta(owner: Owner, name: str, lbls: dict[str, str], **extra: Any) -> Obj:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": lbls,
        "ownerReferences": [owner.reference()],
        **extra,
    }


def track_of(status: DeepSeekCacheDeploymentStatus, slot: str) -> str:
    """stable, canary, previous (warm, rollback window) or idle."""
    if slot == status.stable_slot:
        return "stable"
    if slot == status.canary_slot:
        return "canary"
    if slot == status.previous_slot:
        return "previous"
    return "idle"


def _resources(r: ResourcesSpec) -> Obj:
    out: Obj = {}
    if r.requests:
        out["requests"] = {k: str(v) for k, v in r.requests.items()}
    if r.limits:
        out["limits"] = {k: str(v) for k, v in r.limits.items()}
    return out


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def scheduling(s: SchedulingSpec) -> Obj:
    """The pod spec fields of ``spec.scheduling`` (none when unset)."""
    out: Obj = {}
    if s.node_selector:
        out["nodeSelector"] = dict(s.node_selector)
    if s.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in s.tolerations]
    if s.priority_class_name:
        out["priorityClassName"] = s.priority_class_name
    return out


def _cache_volume(owner: Owner, slot: str, src: RevisionSource, size_bytes: int) -> Obj:
    vol = src.cache.volume
    if vol.type == "hostPath" and vol.host_path:
        path = cache_host_path(owner, slot, vol.host_path)
        return {"name": "cache", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    if vol.type == "persistentVolumeClaim":
        return {"name": "cache", "persistentVolumeClaim": {"claimName": vol.claim_name}}
    return {"name": "cache", "emptyDir": {"sizeLimit": str(size_bytes)}}


def cache_host_path(owner: Owner, slot: str, host_path: str) -> str:
    """``<hostPath>/<namespace>/<name>-<slot>``: a node directory per track.

    Stable across pod restarts (a pod recreated on the same node finds its
    cache) and distinct per track, so the blue and the green pod that share a
    node never open one store directory twice.
    """
    return f"{host_path.rstrip('/')}/{owner.namespace}/{owner.name}-{slot}"


def _cache_owner_init(src: RevisionSource) -> Obj:
    # The kubelet creates a hostPath directory root-owned (0755) and fsGroup does
    # not apply to hostPath volumes: hand the track's directory to the pods' user.
    image = src.sidecar.image
    return {
        "name": "cache-owner",
        "image": image.reference,
        "imagePullPolicy": image.pull_policy,
        "command": ["chown", f"{RUN_AS}:{RUN_AS}", CACHE_DIR],
        "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {"memory": "64Mi"},
        },
        "securityContext": {
            "runAsUser": 0,
            "runAsGroup": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}],
    }


def _tenant_env(src: RevisionSource) -> list[Obj]:
    salt = src.tenant_salt
    name = "DSCACHE_SERVER_TENANT_SECRET"
    if salt.source == "namespace":
        return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    if salt.source == "secret" and salt.secret_ref is not None:
        ref = {"name": salt.secret_ref.name, "key": salt.secret_ref.key}
        return [{"name": name, "valueFrom": {"secretKeyRef": ref}}]
    return []


def pod_template(owner: Owner, slot: str, revision: str, src: RevisionSource) -> Obj:
    """The model pod template of one track (without its hash annotation)."""
    size = parse_quantity(src.cache.size)
    capacity = size * 9 // 10  # headroom for the index and partly written segments
    server_image = src.server.image
    sidecar_image = src.sidecar.image
    port = src.server.port
    sel = {**selector_labels(owner, "model"), SLOT: slot}
    server_args = ["server", "--model", src.model.name, "--port", str(port)]
    server_args += ["--sidecar-socket", SOCKET, "--sidecar-data-dir", CACHE_DIR]
    server_args += ["--block-tokens", str(src.cache.block_tokens)]
    server_args += ["--min-cache-tokens", str(src.cache.min_tokens)]
    server_args += ["--store-compress", src.cache.codec]
    server_args += ["--max-concurrency", str(src.server.max_concurrency)]
    if src.model.revision:
        server_args += ["--revision", src.model.revision]
    http_probe = {"httpGet": {"path": "/health", "port": "http"}}
    # The sidecar's gRPC health, as HTTP on its metrics port: no process per probe.
    sidecar_live = {"httpGet": {"path": "/healthz", "port": "metrics"}}
    sidecar_ready = {"httpGet": {"path": "/readyz", "port": "metrics"}}
    spread_selector = {"matchLabels": sel}
    affinity: Obj = {}
    if src.cache.volume.type == "hostPath":
        # Two pods of a track on one node would share one store directory.
        affinity = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": spread_selector, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        }
    spec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": 60,
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": spread_selector,
            }
        ],
        "containers": [
            {
                "name": "server",
                "image": server_image.reference,
                "imagePullPolicy": server_image.pull_policy,
                "command": ["dscache"],
                "args": server_args,
                "env": _tenant_env(src),
                "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
                "startupProbe": {**http_probe, "periodSeconds": 5, "failureThreshold": 120},
                "livenessProbe": {**http_probe, "periodSeconds": 10, "failureThreshold": 3},
                "readinessProbe": {
                    "httpGet": {"path": "/ready", "port": "http"},
                    "periodSeconds": 5,
                    "failureThreshold": 2,
                },
                "resources": _resources(src.server.resources),
                "securityContext": _container_security(),
                "volumeMounts": [
                    # Read-write: the server maps hit blocks and writes new ones into
                    # the space the sidecar allocates (Allocate -> pwrite -> Commit).
                    {"name": "cache", "mountPath": CACHE_DIR},
                    {"name": "socket", "mountPath": SOCKET_DIR},
                    {"name": "tmp", "mountPath": TMP, "subPath": "server"},
                ],
            },
            {
                "name": "sidecar",
                "image": sidecar_image.reference,
                "imagePullPolicy": sidecar_image.pull_policy,
                "command": ["dscache"],
                "args": [
                    "sidecar",
                    "--data-dir",
                    CACHE_DIR,
                    "--capacity",
                    str(capacity),
                    "--socket",
                    SOCKET,
                    "--metrics-port",
                    str(src.sidecar.metrics_port),
                ],
                "ports": [
                    {
                        "name": "metrics",
                        "containerPort": src.sidecar.metrics_port,
                        "protocol": "TCP",
                    }
                ],
                "livenessProbe": {
                    **sidecar_live,
                    "periodSeconds": 15,
                    "timeoutSeconds": 5,
                    "failureThreshold": 3,
                },
                "readinessProbe": {**sidecar_ready, "periodSeconds": 10, "timeoutSeconds": 5},
                "resources": _resources(src.sidecar.resources),
                "securityContext": _container_security(),
                "volumeMounts": [
                    {"name": "cache", "mountPath": CACHE_DIR},
                    {"name": "socket", "mountPath": SOCKET_DIR},
                    {"name": "tmp", "mountPath": TMP, "subPath": "sidecar"},
                ],
            },
        ],
        "volumes": [
            _cache_volume(owner, slot, src, size),
            {"name": "socket", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    if affinity:
        spec["affinity"] = affinity
    spec.update(scheduling(src.scheduling))
    if src.cache.volume.type == "hostPath":
        spec["initContainers"] = [_cache_owner_init(src)]
    return {"metadata": {"labels": {**sel, REVISION: revision}}, "spec": spec}


def template_hash(template: Obj) -> str:
    """Hash of a pod template as the operator renders it."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:12]


def model_deployment(
    owner: Owner,
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    slot: str,
) -> Obj:
    """Deployment ``<name>-<slot>`` for the revision stored for ``slot``."""
    ss = status.slots[slot]
    src = RevisionSource.model_validate(ss.source)
    template = pod_template(owner, slot, ss.revision, src)
    digest = template_hash(template)
    template["metadata"]["annotations"] = {TEMPLATE_HASH: digest}
    lbls = {**labels(owner, "model", track_of(status, slot)), SLOT: slot, TEMPLATE_HASH: digest}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, f"{owner.name}-{slot}", lbls),
        "spec": {
            "replicas": slot_replicas(status, slot, spec.replicas),
            "revisionHistoryLimit": 10,
            "selector": {"matchLabels": {**selector_labels(owner, "model"), SLOT: slot}},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": template,
        },
    }


def model_service(owner: Owner, status: DeepSeekCacheDeploymentStatus, slot: str) -> Obj:
    """Service ``<name>-<slot>``: the track's pods (prewarm target, metrics)."""
    src = RevisionSource.model_validate(status.slots[slot].source)
    lbls = {**labels(owner, "model", track_of(status, slot)), SLOT: slot}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, f"{owner.name}-{slot}", lbls),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector_labels(owner, "model"), SLOT: slot},
            "ports": [
                {"name": "http", "port": src.server.port, "targetPort": "http"},
                {"name": "metrics", "port": src.sidecar.metrics_port, "targetPort": "metrics"},
            ],
        },
    }


def pdb(owner: Owner, name: str, component: str, track: str, extra: dict[str, str]) -> Obj:
    """A PodDisruptionBudget allowing one pod down at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, name, {**labels(owner, component, track), **extra}),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {**selector_labels(owner, component), **extra}},
        },
    }


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
        load_modules=tuple(r.load_modules),
        pid_file=f"{TMP}/nginx.pid",
        temp_dir=TMP,
        error_log="stderr",
        access_log="off",
        watch_config=True,
        config_path=ROUTER_CONF,
    )


def router_configmap(owner: Owner, config: RouterConfig) -> Obj:
    """ConfigMap ``<name>-router`` with the rendered nginx.conf."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, f"{owner.name}-router", labels(owner, "router", "all")),
        "data": {"nginx.conf": render_nginx_conf(config)},
    }


def router_config_hash(configmap: Obj) -> str:
    """The value of :data:`ROUTER_CONFIG_HASH` for a router ConfigMap."""
    text: str = configmap["data"]["nginx.conf"]
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def router_deployment(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """Deployment ``<name>-router``: NGINX itself (no shell), reloading when its ConfigMap changes.

    The rendered config carries a Lua timer that sends NGINX's master a SIGHUP
    when the mounted file changes (see :mod:`dscache_operator.nginx`); the pod
    template never changes with the config, so a weight change restarts nothing.
    """
    r = spec.routing
    sel = selector_labels(owner, "router")
    probe = {"httpGet": {"path": "/dscache/router/health", "port": "http"}, "periodSeconds": 5}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, f"{owner.name}-router", labels(owner, "router", "all")),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": sel},
            "template": {
                "metadata": {"labels": sel},
                "spec": {
                    **scheduling(spec.scheduling),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": _pod_security(),
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": sel},
                        }
                    ],
                    "containers": [
                        {
                            "name": "nginx",
                            "image": r.image.reference,
                            "imagePullPolicy": r.image.pull_policy,
                            "command": ["nginx"],
                            "args": [
                                "-p",
                                TMP,
                                "-e",
                                "stderr",
                                "-c",
                                ROUTER_CONF,
                                "-g",
                                "daemon off;",
                            ],
                            "ports": [
                                {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}
                            ],
                            "livenessProbe": probe,
                            "readinessProbe": probe,
                            "resources": _resources(r.resources),
                            "securityContext": _container_security(),
                            "volumeMounts": [
                                {"name": "config", "mountPath": ROUTER_CONF_DIR, "readOnly": True},
                                {"name": "tmp", "mountPath": TMP},
                            ],
                        }
                    ],
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
        "metadata": _meta(owner, owner.name, labels(owner, "router", "all")),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner, "router"),
            "ports": [{"name": "http", "port": spec.routing.port, "targetPort": "http"}],
        },
    }


def prewarm_job_name(owner: Owner, revision: str) -> str:
    """Name of the prewarm Job of ``revision``."""
    return f"{owner.name}-prewarm-{revision}"


def prewarm_job(
    owner: Owner,
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    targets: tuple[str, ...],
) -> Obj | None:
    """The prewarm Job of the canary revision (None: nothing to prewarm yet).

    Args:
        owner: the resource.
        spec: its spec (prompts, topN, concurrency, timeout, image).
        status: the status naming the canary slot and revision.
        targets: ``ip:port`` of every ready canary pod: the router may send a
            session to any of them, so every one gets every prompt. None yet
            (no ready pod): no Job yet.

    A Job's pod template is immutable: the caller creates this once per
    revision, with the addresses of that moment, and never re-applies it.
    """
    p = spec.prewarm
    slot, revision = status.canary_slot, status.canary_revision
    if not p.enabled or p.prompts is None or slot is None or revision is None or not targets:
        return None
    urls = ",".join(f"http://{address}" for address in targets)
    lbls = {**labels(owner, "prewarm", "canary"), SLOT: slot, REVISION: revision}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(owner, prewarm_job_name(owner, revision), lbls),
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": max(1, int(parse_duration(p.timeout))),
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": lbls},
                "spec": {
                    **scheduling(spec.scheduling),
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": _pod_security(),
                    "containers": [
                        {
                            "name": "prewarm",
                            "image": p.image.reference,
                            "imagePullPolicy": p.image.pull_policy,
                            "command": ["dscache"],
                            "args": [
                                "prewarm",
                                "--target",
                                f"$({PREWARM_TARGETS_ENV})",
                                "--prompts",
                                "/prewarm/prompts.jsonl",
                                "--top-n",
                                str(p.top_n),
                                "--concurrency",
                                str(p.concurrency),
                                "--quiet",
                            ],
                            "env": [{"name": PREWARM_TARGETS_ENV, "value": urls}],
                            "resources": {
                                "requests": {"cpu": "50m", "memory": "128Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "securityContext": _container_security(),
                            "volumeMounts": [
                                {"name": "prompts", "mountPath": "/prewarm", "readOnly": True},
                                {"name": "tmp", "mountPath": TMP},
                            ],
                        }
                    ],
                    "volumes": [
                        {
                            "name": "prompts",
                            "configMap": {
                                "name": p.prompts.name,
                                "items": [{"key": p.prompts.key, "path": "prompts.jsonl"}],
                            },
                        },
                        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
                    ],
                },
            },
        },
    }


def service_monitor(owner: Owner) -> Obj:
    """ServiceMonitor scraping both tracks' server and sidecar metrics."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(owner, owner.name, labels(owner, "model", "all")),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner, "model")},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            # The series get dscache_io_revision / dscache_io_slot: what analysis selects on.
            "podTargetLabels": [REVISION, SLOT],
            "endpoints": [
                {"port": "http", "path": "/metrics", "interval": "15s"},
                {"port": "metrics", "path": "/metrics", "interval": "15s"},
            ],
        },
    }


def prometheus_rule(owner: Owner, spec: DeepSeekCacheDeploymentSpec) -> Obj:
    """PrometheusRule ``DscacheHitRateLow`` on the token hit rate of both tracks.

    With ``minHitRate`` set: the hit rate over 10 minutes stayed under it for
    10 minutes. Without it (the default; traffic has no universal good hit
    rate): it stayed under ``minHitRateRatio`` times its own level over the
    hour before, i.e. the cache got worse than it was (sessions losing their
    pod, a cache too small, a cold rollout), whatever its natural level.
    """
    a = spec.rollout.analysis
    sel = f'{a.namespace_label}="{owner.namespace}",service=~"{owner.name}-(blue|green)"'

    def hit_rate(window: str, offset: str = "") -> str:
        return token_hit_rate(sel, window, offset)

    if a.min_hit_rate is not None:
        expr = f"{hit_rate('10m')} < {a.min_hit_rate}"
        summary = f"KV-cache token hit rate below {a.min_hit_rate} for 10 minutes"
    else:
        expr = f"({hit_rate('10m')}) < {a.min_hit_rate_ratio} * ({hit_rate('1h', ' offset 10m')})"
        summary = (
            f"KV-cache token hit rate below {a.min_hit_rate_ratio} x its level of the hour "
            "before, for 10 minutes"
        )
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _meta(owner, owner.name, labels(owner, "model", "all")),
        "spec": {
            "groups": [
                {
                    "name": f"dscache.{owner.namespace}.{owner.name}",
                    "rules": [
                        {
                            "alert": "DscacheHitRateLow",
                            "expr": expr,
                            "for": "10m",
                            "labels": {"severity": "warning"},
                            "annotations": {
                                "summary": f"{owner.namespace}/{owner.name}: {summary}",
                                "description": "Sessions are losing their pod or the cache is "
                                "too small; check the router and dscache_sidecar_evictions_total.",
                            },
                        }
                    ],
                }
            ]
        },
    }


def pod_address(ip: str, port: int) -> str:
    """``ip:port`` for NGINX (IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def children(
    owner: Owner,
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    stable_addresses: tuple[str, ...],
    canary_addresses: tuple[str, ...],
    *,
    previous_addresses: tuple[str, ...] = (),
    monitoring: bool,
) -> list[Obj]:
    """Every child to (re-)apply now, in a safe order (tracks before the router).

    Frozen tracks (a ``kubectl rollout undo`` was seen) are left out: the
    operator does not fight a person's rollback. The prewarm Job is not among
    them: it is created once (:func:`prewarm_job`), never re-applied.
    """
    out: list[Obj] = []
    for slot, ss in sorted(status.slots.items()):
        if not ss.frozen:
            out.append(model_deployment(owner, spec, status, slot))
        out.append(model_service(owner, status, slot))
        out.append(
            pdb(owner, f"{owner.name}-{slot}", "model", track_of(status, slot), {SLOT: slot})
        )
    cfg = router_config(spec, status, stable_addresses, canary_addresses, previous_addresses)
    out += [
        router_configmap(owner, cfg),
        router_deployment(owner, spec),
        router_service(owner, spec),
        pdb(owner, f"{owner.name}-router", "router", "all", {}),
    ]
    if monitoring:
        if spec.monitoring.service_monitor:
            out.append(service_monitor(owner))
        if spec.monitoring.prometheus_rule:
            out.append(prometheus_rule(owner, spec))
    return out
