"""The model tracks: per slot, the Deployment and Service ``<name>-<slot>`` (pure).

Each model pod runs the model server (server image, torch) and the KV sidecar
(slim core image), sharing the cache volume and the sidecar's socket. With
``spec.engine: vllm`` the server container runs ``dscache vllm serve`` (vLLM with
the dscache KV connector) from ``spec.vllm.image`` instead, with a memory-backed
``/dev/shm`` (vLLM's processes share memory). A
hostPath cache lives in ``<hostPath>/<namespace>/<name>-<slot>``: one
directory per track, the same after a pod restart, handed to the pods' user by
the ``cache-owner`` init container (root with ``CHOWN`` only, running the
admin's image from the policy, never one the resource names). A
``persistentVolumeClaim`` cache is a generic ephemeral volume: a claim of
``cache.size`` per pod, never one claim shared by every pod. The tenant salt
comes from the generated Secret ``<name>-tenant-salt`` by default. With the
shared tier on, the pod does not share its PID namespace (the server could
otherwise read the sidecar's Redis credential in ``/proc``). With ``spec.auth.apiKeysSecretRef`` the
Secret's key is mounted read-only as a file into the model server (a whole
volume, not a subPath, so the kubelet's updates of a rotated Secret reach it)
and ``DSCACHE_SERVER_API_KEYS_FILE`` names it. With ``spec.cache.shared``
enabled the sidecar gets the ``DSCACHE_SIDECAR_SHARED_*`` variables: the
Redis Cluster's nodes and credentials as ``secretKeyRef`` entries (the operator
never reads a Secret), the TLS CA as a read-only Secret volume file, the rest
as values; disabled, the sidecar container is exactly what it was before the
field existed.

Invariants: a track's pod template is built only from the
:class:`RevisionSource` stored for that track in the status, never from the
live spec, so a rollout never restarts the stable pods; its hash is written
both on the Deployment's labels and in the pod template's annotations, so a
``kubectl rollout undo`` (which replaces the template but not the Deployment's
labels) is visible as a mismatch.
"""

from __future__ import annotations

import hashlib
import json

from dscache_operator.desired.common import (
    REVISION,
    RUN_AS,
    SLOT,
    TEMPLATE_HASH,
    TMP,
    Obj,
    Owner,
    container,
    labels,
    meta,
    pod_spec,
    resources,
    selector_labels,
    track_of,
)
from dscache_operator.policy import DEFAULT_POLICY, AdminPolicy, normalise_host_path
from dscache_operator.quantity import quantity_bytes, whole_cores
from dscache_operator.revision import ResourcesSpec, RevisionSource
from dscache_operator.rollout import slot_replicas
from dscache_operator.spec import DeepSeekCacheDeploymentSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

CACHE_DIR = "/var/cache/dscache"
SOCKET_DIR = "/run/dscache"
SOCKET = f"{SOCKET_DIR}/sidecar.sock"
AUTH_DIR = "/etc/dscache/auth"
API_KEYS_FILE = f"{AUTH_DIR}/api-keys.json"
SHARED_TIER_DIR = "/etc/dscache/shared-tier"
SHARED_TIER_CA_FILE = f"{SHARED_TIER_DIR}/ca.crt"
SHARED_ENV = "DSCACHE_SIDECAR_SHARED_"


def _cache_volume(owner: Owner, slot: str, src: RevisionSource, size_bytes: int) -> Obj:
    vol = src.cache.volume
    if vol.type == "hostPath" and vol.host_path:
        path = cache_host_path(owner, slot, vol.host_path)
        return {"name": "cache", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    if vol.type == "persistentVolumeClaim" and vol.claim_template is not None:
        # A generic ephemeral volume: one claim per pod, created and deleted with it, so
        # no two sidecars ever open one directory.
        tmpl = vol.claim_template
        claim: Obj = {
            "accessModes": list(tmpl.access_modes),
            "resources": {"requests": {"storage": str(size_bytes)}},
        }
        if tmpl.storage_class_name is not None:
            claim["storageClassName"] = tmpl.storage_class_name
        labels_ = {**selector_labels(owner, "model"), SLOT: slot}
        template = {"metadata": {"labels": labels_}, "spec": claim}
        return {"name": "cache", "ephemeral": {"volumeClaimTemplate": template}}
    return {"name": "cache", "emptyDir": {"sizeLimit": str(size_bytes)}}


def cache_host_path(owner: Owner, slot: str, host_path: str) -> str:
    """``<hostPath>/<namespace>/<name>-<slot>``: a node directory per track.

    Stable across pod restarts (a pod recreated on the same node finds its
    cache) and distinct per track, so the blue and the green pod that share a
    node never open one store directory twice.
    """
    # Normalised as the admin's policy checked it: no ".." reaches the kubelet.
    return f"{normalise_host_path(host_path).rstrip('/')}/{owner.namespace}/{owner.name}-{slot}"


def _cache_owner_init(policy: AdminPolicy) -> Obj:
    # The kubelet creates a hostPath directory root-owned (0755) and fsGroup does
    # not apply to hostPath volumes: hand the track's directory to the pods' user.
    # It runs as root, so it runs the admin's image, never one the resource names.
    image = policy.cache_owner_image
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


def tenant_salt_secret_name(owner: Owner) -> str:
    """The Secret holding a generated tenant salt (``tenantSalt.source: generated``)."""
    return f"{owner.name}-tenant-salt"


#: The key of the generated salt in :func:`tenant_salt_secret_name`'s Secret.
TENANT_SALT_KEY = "salt"
#: The key of the internal token in the same Secret: what the router's picker shows the
#: model pods to read their key info and holdings filters (derived from the salt).
INTERNAL_TOKEN_KEY = "internal-token"  # noqa: S105 - a key's name, not a secret


def internal_token_env(owner: Owner, salt_source: str, name: str) -> list[Obj]:
    """The variable ``name`` from the generated Secret's internal token; none unless the
    salt is generated (stored sources of other kinds render as they did). Optional: a
    Secret created before it held a token starts the pod without one (open, warned)."""
    if salt_source != "generated":
        return []
    ref = {"name": tenant_salt_secret_name(owner), "key": INTERNAL_TOKEN_KEY, "optional": True}
    return [{"name": name, "valueFrom": {"secretKeyRef": ref}}]


def _tenant_env(owner: Owner, src: RevisionSource) -> list[Obj]:
    salt = src.tenant_salt
    name = "DSCACHE_SERVER_TENANT_SECRET"
    if salt.source == "generated":
        ref = {"name": tenant_salt_secret_name(owner), "key": TENANT_SALT_KEY}
        return [{"name": name, "valueFrom": {"secretKeyRef": ref}}]
    if salt.source == "namespace":
        return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    if salt.source == "secret" and salt.secret_ref is not None:
        ref = {"name": salt.secret_ref.name, "key": salt.secret_ref.key}
        return [{"name": name, "valueFrom": {"secretKeyRef": ref}}]
    return []


def _auth_env(src: RevisionSource) -> list[Obj]:
    env: list[Obj] = []
    if src.auth.api_keys_secret_ref is not None:
        env.append({"name": "DSCACHE_SERVER_API_KEYS_FILE", "value": API_KEYS_FILE})
    gateway = src.auth.gateway_secret_ref
    if gateway is not None:
        ref = {"name": gateway.name, "key": gateway.key}
        env.append({"name": "DSCACHE_SERVER_GATEWAY_SECRET", "valueFrom": {"secretKeyRef": ref}})
    return env


def _auth_volumes(src: RevisionSource) -> tuple[list[Obj], list[Obj]]:
    """The API-key Secret's volume and the server's mount of it (none without auth)."""
    ref = src.auth.api_keys_secret_ref
    if ref is None:
        return [], []
    items = [{"key": ref.key, "path": API_KEYS_FILE.rsplit("/", 1)[1]}]
    # 0440 + fsGroup: readable by the pods' user only; never a subPath (no updates).
    volume = {
        "name": "api-keys",
        "secret": {"secretName": ref.name, "items": items, "defaultMode": 0o440},
    }
    return [volume], [{"name": "api-keys", "mountPath": AUTH_DIR, "readOnly": True}]


def _shared_tier_env(src: RevisionSource) -> list[Obj]:
    """The sidecar's ``DSCACHE_SIDECAR_SHARED_*`` variables (none while disabled)."""
    shared = src.cache.shared
    if not shared.enabled or shared.secret_ref is None:
        return []
    secret = shared.secret_ref.name

    def from_secret(name: str, key: str, optional: bool = False) -> Obj:
        ref: Obj = {"name": secret, "key": key}
        if optional:
            ref["optional"] = True
        return {"name": SHARED_ENV + name, "valueFrom": {"secretKeyRef": ref}}

    env = [from_secret("NODES", shared.endpoints_key)]
    if shared.username_key is not None:
        env.append(from_secret("USERNAME", shared.username_key))
    if shared.password_key is not None:
        env.append(from_secret("PASSWORD", shared.password_key))
    # The namespace's own prefix and HMAC keys (the chart's per-namespace Secret has
    # them); optional, so a Secret without them still starts the pod (unsigned, warned).
    env.append(from_secret("KEY_PREFIX", shared.key_prefix_key, optional=True))
    env.append(from_secret("SIGNING_KEY", shared.signing_key_key, optional=True))
    env.append(from_secret("SIGNING_KEY_PREVIOUS", shared.signing_key_previous_key, optional=True))
    tls = shared.tls
    values = {
        "TLS": "true" if tls.enabled else "false",
        "TLS_VERIFY_HOSTNAME": "true" if tls.verify_hostname else "false",
        "TIMEOUT_S": _seconds(shared.timeout_ms),
        "FETCH_BUDGET_S": _seconds(shared.fetch_budget_ms),
        "WRITE_POLICY": shared.write_policy,
        "TTL_S": str(int(shared.ttl_s)),
        "QUEUE_BLOCKS": str(shared.queue_blocks),
    }
    if tls.enabled and tls.ca_secret_ref is not None:
        values["TLS_CA_FILE"] = SHARED_TIER_CA_FILE
    return env + [{"name": SHARED_ENV + k, "value": v} for k, v in values.items()]


def _seconds(ms: int) -> str:
    """Milliseconds as the sidecar's seconds: ``250`` -> ``"0.25"``, ``1000`` -> ``"1"``."""
    return str(ms // 1000) if ms % 1000 == 0 else repr(ms / 1000)


def _shared_tier_volumes(src: RevisionSource) -> tuple[list[Obj], list[Obj]]:
    """The shared tier's CA volume and the sidecar's mount of it (none without a CA)."""
    shared = src.cache.shared
    ref = shared.tls.ca_secret_ref
    if not (shared.enabled and shared.tls.enabled) or ref is None:
        return [], []
    items = [{"key": ref.key, "path": SHARED_TIER_CA_FILE.rsplit("/", 1)[1]}]
    # A volume, not a subPath: a renewed CA reaches the running sidecar's file.
    volume = {
        "name": "shared-tier-ca",
        "secret": {"secretName": ref.name, "items": items, "defaultMode": 0o440},
    }
    return [volume], [{"name": "shared-tier-ca", "mountPath": SHARED_TIER_DIR, "readOnly": True}]


def _shared_mounts(tmp_sub_path: str) -> list[Obj]:
    # Read-write cache: the server maps hit blocks and writes new ones into the
    # space the sidecar allocates (Allocate -> pwrite -> Commit).
    return [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "socket", "mountPath": SOCKET_DIR},
        {"name": "tmp", "mountPath": TMP, "subPath": tmp_sub_path},
    ]


#: vLLM's processes talk through shared memory (the message queue of its multiprocess
#: executor wants 160 MiB; NCCL between tensor-parallel ranks more), and a container's
#: /dev/shm is 64 MiB: vLLM pods get a memory-backed one, charged to the pod's memory.
SHM_DIR = "/dev/shm"  # noqa: S108 - the path vLLM uses, not a temporary file
_SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def _vllm_container(owner: Owner, src: RevisionSource) -> Obj:
    """``dscache vllm serve``: vLLM with dscache as its KV connector, beside the sidecar."""
    port = src.server.port
    args = ["vllm", "serve", "--socket", SOCKET, "--data-dir", CACHE_DIR]
    args += ["--block-tokens", str(src.cache.block_tokens)]
    if src.model.revision:
        args += ["--revision", src.model.revision]
    args += [src.model.name, "--host", "0.0.0.0", "--port", str(port)]
    args += ["--max-num-seqs", str(src.server.max_concurrency)]
    ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    engine_events = src.cache.kv_events.engine_ports(src.engine)
    if engine_events:
        # vLLM's own KV events (its GPU prefix cache), for the router's picker.
        pub, replay = engine_events
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        args += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
        ports += [
            {"name": "engine-events", "containerPort": pub, "protocol": "TCP"},
            {"name": "engine-replay", "containerPort": replay, "protocol": "TCP"},
        ]
    args += src.vllm.args
    env = [{**e, "name": "DSCACHE_VLLM_TENANT_SECRET"} for e in _tenant_env(owner, src)] + [
        {"name": "HF_HUB_OFFLINE", "value": "1"}
    ]
    # The session ledger's token (dscache_vllm.ledger), as the model server's.
    env += internal_token_env(owner, src.tenant_salt.source, "DSCACHE_VLLM_INTERNAL_TOKEN")
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        **container("server", src.vllm.image, ["dscache"], args),
        "env": env,
        "ports": ports,
        # vLLM loads weights and profiles memory before /health answers: minutes.
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 180},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "resources": resources(src.server.resources),
        "volumeMounts": [*_shared_mounts("server"), {"name": "dshm", "mountPath": SHM_DIR}],
    }


def torch_threads(resources: ResourcesSpec) -> int | None:
    """The reference engine's torch intra-op threads: the container's CPU limit rounded up
    to whole cores; None (torch's default, a thread per core of the node) without one.

    Under a CPU limit the kernel's quota runs out that many times faster for every
    thread beyond it, and the container then waits for the next period with each
    forward's threads stopped half way (a parallel op waits for its slowest thread).
    Without a limit the default wins: one forward beside no busy neighbour took 0.37 s
    with 2 threads and 0.56 s with 1 on 2 cores (though 1.84 s against 0.91 s beside
    two), and a CPU request is a share under contention, not a cap (the kube demo with
    threads from a 100m request: its warm-up fell behind, TTFT P99 3.6 s -> 23.8 s).
    Concurrent requests use more cores either way: each forward runs on its own thread.
    """
    cpu = resources.limits.get("cpu")
    return None if cpu is None else whole_cores(str(cpu))


def _server_container(owner: Owner, src: RevisionSource) -> Obj:
    if src.engine == "vllm":
        return _vllm_container(owner, src)
    port = src.server.port
    args = ["server", "--model", src.model.name, "--port", str(port)]
    args += ["--sidecar-socket", SOCKET, "--sidecar-data-dir", CACHE_DIR]
    args += ["--block-tokens", str(src.cache.block_tokens)]
    args += ["--min-cache-tokens", str(src.cache.min_tokens)]
    args += ["--store-compress", src.cache.codec]
    args += ["--max-concurrency", str(src.server.max_concurrency)]
    if src.model.revision:
        args += ["--revision", src.model.revision]
    if src.server.dtype != "float32":
        # Only when set: pod templates of resources without a dtype stay as they were.
        args += ["--dtype", src.server.dtype]
    threads = torch_threads(src.server.resources)
    if threads is not None:
        # Only with a CPU limit: other pod templates stay as they were.
        args += ["--threads", str(threads)]
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        **container("server", src.server.image, ["dscache"], args),
        "env": _tenant_env(owner, src)
        + _auth_env(src)
        + internal_token_env(owner, src.tenant_salt.source, "DSCACHE_SERVER_INTERNAL_TOKEN"),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "resources": resources(src.server.resources),
        "volumeMounts": _shared_mounts("server") + _auth_volumes(src)[1],
    }


def _sidecar_container(owner: Owner, src: RevisionSource, capacity: int) -> Obj:
    port = src.sidecar.metrics_port
    args = ["sidecar", "--data-dir", CACHE_DIR, "--capacity", str(capacity)]
    args += ["--socket", SOCKET, "--metrics-port", str(port)]
    if src.cache.tenant_quota < 1.0:
        # Only when set: pod templates of resources without a quota stay as they were.
        args += ["--tenant-quota", repr(src.cache.tenant_quota)]
    if src.cache.eviction:
        # Only when set: pod templates of resources without one stay as they were.
        args += ["--policy", src.cache.eviction]
    env = _shared_tier_env(src) + internal_token_env(
        owner, src.tenant_salt.source, "DSCACHE_SIDECAR_INTERNAL_TOKEN"
    )
    ports = [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    events = src.cache.kv_events
    if events.enabled:
        # Only when on: pod templates of resources without events stay as they were.
        args += ["--kv-events-endpoint", f"tcp://*:{events.port}"]
        args += ["--kv-events-replay-endpoint", f"tcp://*:{events.replay_port}"]
        if events.open:
            env.append({"name": "DSCACHE_SIDECAR_KV_EVENTS_OPEN", "value": "true"})
        ports += [
            {"name": "kv-events", "containerPort": events.port, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": events.replay_port, "protocol": "TCP"},
        ]
    # The sidecar's gRPC health, as HTTP on its metrics port: no process per probe.
    health = {"httpGet": {"path": "/healthz", "port": "metrics"}}
    return {
        **container("sidecar", src.sidecar.image, ["dscache"], args),
        # Only when set: pod templates without a shared tier stay as they were.
        **({"env": env} if env else {}),
        "ports": ports,
        # Liveness waits for the start (up to 5 min): on a busy node a sidecar starting
        # beside its server took over the 45 s liveness allows, was killed, and its
        # store then refused writes for 90 s (a restart's quarantine), so a new pod's
        # prewarm stored nothing.
        "startupProbe": {
            **health,
            "periodSeconds": 2,
            "timeoutSeconds": 5,
            "failureThreshold": 150,
        },
        "livenessProbe": {
            **health,
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
        },
        "resources": resources(src.sidecar.resources),
        "volumeMounts": _shared_mounts("sidecar") + _shared_tier_volumes(src)[1],
    }


def pod_template(
    owner: Owner,
    slot: str,
    revision: str,
    src: RevisionSource,
    policy: AdminPolicy = DEFAULT_POLICY,
) -> Obj:
    """The model pod template of one track (without its hash annotation)."""
    size = quantity_bytes(src.cache.size)
    capacity = size * 9 // 10  # headroom for the index and partly written segments
    sel = {**selector_labels(owner, "model"), SLOT: slot}
    spec: Obj = {
        **pod_spec(src.scheduling, spread=sel),
        "terminationGracePeriodSeconds": 60,
        "containers": [_server_container(owner, src), _sidecar_container(owner, src, capacity)],
        "volumes": [
            _cache_volume(owner, slot, src, size),
            {"name": "socket", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            *_auth_volumes(src)[0],
            *_shared_tier_volumes(src)[0],
            *([_SHM_VOLUME] if src.engine == "vllm" else []),
        ],
    }
    if src.cache.direct_lookup and not src.cache.shared.enabled:
        # LMDB registers each reader process by its pid: the server and the sidecar
        # (both pid 1 in their own namespaces) would collide, and lookups fall back to
        # gRPC. One namespace gives them distinct pids (and the pod a pause pid 1).
        # Not with the shared tier: the server could read the sidecar's Redis
        # credential from /proc/<pid>/environ; its lookups go over gRPC instead.
        spec["shareProcessNamespace"] = True
    if src.cache.volume.type == "hostPath":
        # Two pods of a track on one node would share one store directory.
        term = {"labelSelector": {"matchLabels": sel}, "topologyKey": "kubernetes.io/hostname"}
        spec["affinity"] = {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
        }
        spec["initContainers"] = [_cache_owner_init(policy)]
    return {"metadata": {"labels": {**sel, REVISION: revision}}, "spec": spec}


def template_hash(template: Obj) -> str:
    """Hash of a pod template as the operator renders it."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:12]


def model_deployment(
    owner: Owner,
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    slot: str,
    policy: AdminPolicy = DEFAULT_POLICY,
) -> Obj:
    """Deployment ``<name>-<slot>`` for the revision stored for ``slot``."""
    ss = status.slots[slot]
    src = RevisionSource.model_validate(ss.source)
    template = pod_template(owner, slot, ss.revision, src, policy)
    digest = template_hash(template)
    template["metadata"]["annotations"] = {TEMPLATE_HASH: digest}
    lbls = {**labels(owner, "model", track_of(status, slot)), SLOT: slot, TEMPLATE_HASH: digest}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(owner, f"{owner.name}-{slot}", lbls),
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
        "metadata": meta(owner, f"{owner.name}-{slot}", lbls),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector_labels(owner, "model"), SLOT: slot},
            "ports": [
                {"name": "http", "port": src.server.port, "targetPort": "http"},
                {"name": "metrics", "port": src.sidecar.metrics_port, "targetPort": "metrics"},
            ],
        },
    }
