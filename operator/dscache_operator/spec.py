"""The ``DeepSeekCacheDeployment`` spec as typed, validated objects.

This module is the single source of the resource's shape: the CRD's OpenAPI
schema (defaults, bounds, enums, CEL rules, ``kubectl explain`` text) is
generated from these models by :mod:`dscache_operator.crd` (the status's from
:mod:`dscache_operator.status`), and the operator parses each resource into
them exactly once per reconcile. Field names are
snake_case in Python and camelCase on the wire (``model_dump(by_alias=True)``).

Invariants:
* Every default here is also the API server's default, so a spec read back
  from the cluster and a spec parsed locally agree.
* :func:`revision_of` depends only on the fields that change the model pods'
  behaviour (:class:`RevisionSource`); replicas, routing and rollout settings
  never start a rollout.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from dscache_router.nginx import DEBIAN_LUA_MODULES
from pydantic import Field, ValidationError, field_validator, model_validator

from dscache_operator.revision import (
    CLAIM_NAME_REFUSED,
    DEFAULT_CORE_IMAGE,
    KV_EVENT_PORTS_DIFFER,
    AuthSpec,
    CacheSpec,
    ImageSpec,
    KVEventsPeer,
    ModelSpec,
    ResourcesSpec,
    RevisionSource,
    SchedulingSpec,
    SecretKeyRef,
    ServerSpec,
    SidecarSpec,
    TenantSaltSpec,
    VllmSpec,
)
from dscache_operator.schema import (
    NAME_PATTERN,
    Duration,
    InvalidSpecError,
    SpecModel,
    cel_rules,
    parse_duration,
)

#: Debian's NGINX with the ndk and Lua modules (loaded from DEBIAN_LUA_MODULES).
DEFAULT_ROUTER_IMAGE = ImageSpec(repository="ghcr.io/dscache/dscache-router", tag="0.1.0")
#: ``load_module`` paths of the default router image (Debian's libnginx-mod-http-{ndk,lua}).
DEFAULT_ROUTER_MODULES: tuple[str, ...] = DEBIAN_LUA_MODULES


DomainTerm = Annotated[str, Field(pattern=r"^[A-Za-z0-9$%._-]{1,64}$")]
TermWeight = Annotated[int, Field(ge=0, le=64)]


class PickerSpec(SpecModel):
    """The router's picker: KV-aware routing (a container beside NGINX in each router pod)."""

    enabled: bool = Field(
        default=True,
        description="Route each request to the pod holding the longest cached prefix of it "
        "(from the sidecars' published filters), under balanceFactor's load bound; else to "
        "the pod of a similar recent request; else by the session / prompt-key hash. Off: the "
        "hash alone. Needs balanceFactor >= 1.",
    )
    image: ImageSpec = Field(
        default=DEFAULT_CORE_IMAGE,
        description="Image running `dscache picker` (the slim core image).",
    )
    port: int = Field(default=8090, ge=1, le=65535, description="Picker port (pod-local).")
    timeout: Duration = Field(
        default="250ms",
        description="How long a request waits for the picker before the hash places it.",
    )
    similarity_threshold: float = Field(
        default=0.65,
        ge=0.0,
        le=1.0,
        description="Estimated Jaccard (MinHash over word shingles) from which a request with "
        "no cached prefix follows a similar recent request's pod; 0 = off.",
    )
    domain_terms: Annotated[dict[DomainTerm, TermWeight], Field(max_length=1024)] = Field(
        default_factory=dict,
        description="Words that weigh more in similarity: term -> weight (a weight-w term "
        "counts as w shingles), e.g. {ebitda: 4}.",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Resources of the picker container."
    )

    @field_validator("timeout")
    @classmethod
    def _timeout_range(cls, value: str) -> str:
        if not 0.01 <= parse_duration(value) <= 10.0:
            raise ValueError(f"routing.picker.timeout {value!r} must be between 10ms and 10s")
        return value


class InferencePoolSpec(SpecModel):
    """An InferencePool whose endpoint picker is the picker (``routing.gateway:
    inferencePool``)."""

    epp_port: int = Field(
        default=9002,
        ge=1024,
        le=65535,
        description="Port of the picker's ext_proc face on the router pods and of the "
        "<name>-epp Service the InferencePool names.",
    )
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        default="FailClose",
        description="The InferencePool's endpointPickerRef.failureMode: what the gateway "
        "does when the picker does not answer (drop the request, or pick a pod itself).",
    )
    max_inflight: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Requests in flight per pod (through the gateway) past which the picker "
        "passes it over; every pod past it: 429. 0: no bound.",
    )
    gateway_peers: Annotated[list[KVEventsPeer], Field(max_length=16)] = Field(
        default_factory=list,
        description="The gateway's pods (NetworkPolicy peers): they reach the picker's "
        "ext_proc port and the model pods' server port directly. Empty: any pod may.",
        json_schema_extra={"default": []},
    )


class RoutingSpec(SpecModel):
    """The NGINX router in front of the model pods."""

    model_config = cel_rules(
        (
            "self.balanceFactor == 0.0 || self.balanceFactor >= 1.0",
            "routing.balanceFactor must be 0 (off) or at least 1",
        ),
        (
            "self.gateway != 'inferencePool' || self.picker.enabled",
            "routing.gateway inferencePool needs routing.picker.enabled: the picker is the "
            "endpoint picker",
        ),
    )

    gateway: Literal["nginx", "inferencePool"] = Field(
        default="nginx",
        description="Who routes requests to the model pods: 'nginx', the router "
        "(Service <name>); 'inferencePool' also makes an InferencePool <name> whose endpoint "
        "picker is the router pods' picker (Service <name>-epp), for Gateway API Inference "
        "Extension gateways; the router keeps serving beside it.",
    )
    inference_pool: InferencePoolSpec = Field(
        default_factory=InferencePoolSpec,
        description="The InferencePool and its endpoint picker (gateway: inferencePool).",
    )

    @model_validator(mode="after")
    def _gateway_needs_the_picker(self) -> RoutingSpec:
        if self.gateway == "inferencePool" and not self.picker.enabled:
            raise ValueError(
                "routing.gateway inferencePool needs routing.picker.enabled: the picker is "
                "the endpoint picker"
            )
        return self

    session_header: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")] = Field(
        default="X-Session-ID", description="Request header carrying the session id."
    )
    cookie_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_]{1,64}$")] = Field(
        default="dscache_session", description="Cookie carrying (or issued with) the session id."
    )
    prompt_key: Literal["lua", "off"] = Field(
        default="lua",
        description="Requests with neither header nor cookie: 'lua' routes them by a hash of the "
        "prompt's leading messages; 'off' treats each as a new session.",
    )
    prompt_key_bytes: int = Field(
        default=4096, ge=64, le=1 << 20, description="Leading prompt bytes hashed by 'lua'."
    )
    session_memory: Duration = Field(
        default="30m",
        description="How long the router remembers a session's track after its last request: "
        "a conversation running when a rollout starts finishes on the track it started on "
        "(and on the warm previous track after promotion), and only new sessions follow the "
        "canary weight; '0s' makes every session follow the weight.",
    )
    balance_factor: float = Field(
        default=1.25,
        ge=0.0,
        le=100.0,
        description="Bounded-load consistent hashing: a pod takes a new request only while its "
        "in-flight requests are under balanceFactor x the track's mean (plus one), else the "
        "next pod on the hash ring does, so a hot prompt or session spills instead of "
        "queueing; 0 = plain consistent hash; else at least 1.",
    )
    replicas: int = Field(default=2, ge=0, le=100, description="Router pods.")
    debug_headers: bool = Field(
        default=False,
        description="Answer every request with X-Dscache-Track, X-Dscache-Upstream (the model "
        "pod's address) and X-Dscache-Key-Source: for debugging placement; shows pod addresses "
        "to clients.",
    )
    image: ImageSpec = Field(
        default=DEFAULT_ROUTER_IMAGE,
        description="NGINX image with the Lua module (the router reloads itself with Lua, and "
        "promptKey lua needs it too); its entrypoint must be nginx.",
    )
    load_modules: Annotated[
        list[Annotated[str, Field(pattern=r"^/[A-Za-z0-9_./-]+$", max_length=1024)]],
        Field(max_length=16),
    ] = Field(
        default_factory=lambda: list(DEFAULT_ROUTER_MODULES),
        description="load_module paths of the router image's dynamic modules (NDK and Lua for "
        "the default image); [] for an image with Lua built in, e.g. OpenResty.",
        json_schema_extra={"default": list(DEFAULT_ROUTER_MODULES)},
    )
    port: int = Field(default=80, ge=1, le=65535, description="Port of the router Service.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Resources of the router container."
    )
    picker: PickerSpec = Field(
        default_factory=PickerSpec, description="KV-aware routing (the picker beside NGINX)."
    )


class ConfigMapKeyRef(SpecModel):
    """A key of a ConfigMap in the resource's namespace."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)] = Field(
        description="ConfigMap name."
    )
    key: Annotated[str, Field(max_length=253, min_length=1)] = Field(
        default="prompts.jsonl", description="Key holding the prompts, one JSON chat per line."
    )


class MinedSpec(SpecModel):
    """The live-mined templates a prewarm sends besides its prompt list."""

    enabled: bool = Field(
        default=True,
        description="Send the stable pods' mined templates (GET /dscache/templates) too; "
        "needs spec.auth.gatewaySecretRef (the endpoint shows other users' prompt "
        "prefixes and asks for the gateway token); without it, off.",
    )
    top: int = Field(default=100, ge=1, le=1000, description="Mined templates sent.")


class PrewarmSpec(SpecModel):
    """Prewarming a new revision's cache before it takes traffic."""

    enabled: bool = Field(default=True, description="Run a prewarm Job for every new revision.")
    image: ImageSpec = Field(
        default=DEFAULT_CORE_IMAGE,
        description="Image of the prewarm Job (runs `dscache prewarm`; the slim core image).",
    )
    prompts: ConfigMapKeyRef | None = Field(
        default=None,
        description="Prompts to replay (JSONL of chats, hottest first); no prompts and no "
        "mined templates, no Job.",
    )
    top_n: int = Field(default=100, ge=1, le=100000, description="Replay the first N prompts.")
    concurrency: int = Field(default=2, ge=1, le=256, description="Prewarm requests in flight.")
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the API key the prewarm Job sends (it warms that "
        "key's tenant); required with auth.apiKeysSecretRef and prompts.",
    )
    timeout: Duration = Field(
        default="15m", description="Deadline of the prewarm Job; past it the rollout aborts."
    )
    mined: MinedSpec = Field(
        default_factory=MinedSpec,
        description="Templates the stable pods mined from live traffic, warmed too.",
    )
    placement: Literal["all", "ring"] = Field(
        default="all",
        description="all: every prompt to every canary pod, once, before the first step (the "
        "warmest canary); ring: progressive, through the router's own hashing: each prompt "
        "goes to the canary pods the router's consistent hash tries first for it, one copy "
        "before the first step and ceil(pods x weight / 100) by each later step (a Job per "
        "step that needs more). ring costs a fraction of the prewarm requests; with "
        "concurrent sessions the picker's load bound sends some past a prompt's only holder, "
        "so its first steps hit less (see the README).",
    )


class AnalysisSpec(SpecModel):
    """What each rollout step must show in Prometheus before the next one."""

    enabled: bool = Field(
        default=True,
        description="false advances every interval without looking at metrics "
        "(blind; not advised).",
    )
    prometheus_url: Annotated[str, Field(max_length=2048, pattern=r"^https?://")] | None = Field(
        default=None,
        description="Prometheus base URL; defaults to the operator's "
        "DSCACHE_OPERATOR_PROMETHEUS_URL.",
    )
    min_hit_rate_ratio: float = Field(
        default=0.95,
        ge=0.0,
        le=10.0,
        description="Canary's token hit rate must be at least the stable track's hit rate over "
        "the same window times this.",
    )
    min_hit_rate: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Optional absolute floor on the canary's token hit rate (unset: none).",
    )
    max_ttft_p99_ratio: float = Field(
        default=1.2,
        ge=0.1,
        le=100.0,
        description="Canary's P99 TTFT must be at most stable's P99 TTFT times this.",
    )
    min_ttft_p99_increase_seconds: float = Field(
        default=0.15,
        ge=0.0,
        le=60.0,
        description="A canary P99 TTFT above stable's times maxTtftP99Ratio fails only when it "
        "is also more than this many seconds above stable's: at low latencies a P99 over one "
        "step's window rests on a few requests and one histogram bucket (0.1-0.25 s in both "
        "engines' TTFT histograms), so a smaller increase is not told apart from noise. "
        "0: the ratio alone.",
    )
    max_ttft_p99_seconds: float | None = Field(
        default=None, ge=0.0, description="Optional absolute ceiling on the canary's P99 TTFT."
    )
    revision_label: Annotated[str, Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", max_length=128)] = (
        Field(
            default="dscache_io_revision",
            description="Series label holding the pod's dscache.io/revision label.",
        )
    )
    namespace_label: Annotated[str, Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", max_length=128)] = (
        Field(default="namespace", description="Series label holding the namespace.")
    )


class RolloutSpec(SpecModel):
    """How a new revision replaces the stable one."""

    model_config = cel_rules(
        ("self.steps.isSorted()", "rollout.steps must increase"),
        ("self.steps[self.steps.size() - 1] == 100", "the last rollout step must be 100"),
    )

    strategy: Literal["canary", "blueGreen"] = Field(
        default="canary",
        description="canary ramps the session share through steps; blueGreen switches all "
        "sessions at once after prewarm, then analyses, keeping the old track warm.",
    )
    steps: Annotated[
        list[Annotated[int, Field(ge=1, le=100)]], Field(min_length=1, max_length=20)
    ] = Field(
        default_factory=lambda: [10, 25, 50, 100],
        description="Canary session shares in percent, increasing, ending at 100.",
        json_schema_extra={"x-kubernetes-list-type": "set", "default": [10, 25, 50, 100]},
    )
    interval: Duration = Field(default="5m", description="Analysis time per step.")
    rollback_window: Duration = Field(
        default="30m",
        description="After promotion the old track stays warm this long; "
        "dscache.io/abort in this window switches back at once.",
    )
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec, description="Gates of every step.")


class MonitoringSpec(SpecModel):
    """Prometheus Operator objects, created only when their CRDs exist in the cluster."""

    service_monitor: bool = Field(default=True, description="Create a ServiceMonitor.")
    prometheus_rule: bool = Field(
        default=True,
        description="Create a PrometheusRule: hit rate under minHitRate for 10m, or, without "
        "minHitRate, under minHitRateRatio times its own level of the hour before.",
    )


#: Why engine vllm refuses spec.server.dtype (the CEL rule's and the operator's message).
_VLLM_DTYPE = (
    "spec.server.dtype is the reference server's; with engine vllm pass vLLM's own dtype "
    "in spec.vllm.args (e.g. [--dtype, bfloat16]) and leave server.dtype float32"
)


#: Why engine vllm refuses spec.cache.codec int8.
_VLLM_INT8 = (
    "spec.cache.codec int8 is the reference server's; the vLLM connector stores vLLM's own "
    "KV dtype exactly: use raw (or vLLM's --kv-cache-dtype in spec.vllm.args)"
)


#: Why engine vllm with its own KV events refuses a --kv-events-config of the user's.
_VLLM_KV_EVENTS = (
    "spec.vllm.args carries --kv-events-config while spec.cache.kvEvents.engine is on: "
    "the operator sets it (ports cache.kvEvents.engine.port and replayPort, which the "
    "router and the NetworkPolicy follow); remove it, or set kvEvents.engine.enabled false"
)


class DeepSeekCacheDeploymentSpec(SpecModel):
    """Desired state of a DeepSeekCacheDeployment."""

    model_config = cel_rules(
        (
            "self.engine != 'vllm' || !has(self.cache) || !has(self.cache.kvEvents) "
            "|| !self.cache.kvEvents.enabled || !has(self.cache.kvEvents.engine) "
            "|| !self.cache.kvEvents.engine.enabled || !has(self.vllm) "
            "|| !self.vllm.args.exists(a, a.startsWith('--kv-events-config'))",
            _VLLM_KV_EVENTS,
        ),
        (
            "self.engine != 'vllm' || has(self.model.path)",
            "engine vllm serves a checkpoint directory: set spec.model.path",
        ),
        (
            "self.engine != 'vllm' || !has(self.auth) || !has(self.auth.apiKeysSecretRef)",
            "spec.auth.apiKeysSecretRef is checked by the reference server only; with engine "
            "vllm check API keys at your gateway",
        ),
        (
            "self.engine != 'vllm' || !has(self.server) || !has(self.server.dtype) "
            "|| self.server.dtype == 'float32'",
            _VLLM_DTYPE,
        ),
        (
            "self.engine != 'vllm' || !has(self.cache) || !has(self.cache.codec) "
            "|| self.cache.codec != 'int8'",
            _VLLM_INT8,
        ),
    )

    model: ModelSpec = Field(description="The model to serve.")
    engine: Literal["reference", "vllm"] = Field(
        default="reference",
        description="What serves the model: the reference server (dscache server) or vLLM "
        "with dscache as its KV connector (dscache vllm serve).",
    )
    vllm: VllmSpec = Field(
        default_factory=VllmSpec, description="The vLLM container (engine vllm only)."
    )
    replicas: int = Field(default=2, ge=0, le=1000, description="Model pods per track.")
    server: ServerSpec = Field(default_factory=ServerSpec, description="Model server container.")
    sidecar: SidecarSpec = Field(default_factory=SidecarSpec, description="KV sidecar container.")
    cache: CacheSpec = Field(default_factory=CacheSpec, description="KV cache per pod.")
    routing: RoutingSpec = Field(default_factory=RoutingSpec, description="Session router.")
    prewarm: PrewarmSpec = Field(default_factory=PrewarmSpec, description="Cache prewarming.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout strategy.")
    tenant_salt: TenantSaltSpec = Field(
        default_factory=TenantSaltSpec, description="Tenant isolation of cache keys."
    )
    auth: AuthSpec = Field(
        default_factory=AuthSpec, description="API keys of the model servers (tenancy)."
    )
    monitoring: MonitoringSpec = Field(
        default_factory=MonitoringSpec, description="ServiceMonitor and PrometheusRule."
    )
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec,
        description="Node selector, tolerations and priority of the model pods, the router "
        "and the prewarm Job.",
    )

    @property
    def interval_s(self) -> float:
        """``rollout.interval`` in seconds."""
        return parse_duration(self.rollout.interval)

    @property
    def rollback_window_s(self) -> float:
        """``rollout.rollbackWindow`` in seconds."""
        return parse_duration(self.rollout.rollback_window)

    @property
    def steps(self) -> tuple[int, ...]:
        """Rollout weights in percent; blue-green is one step of 100."""
        return (100,) if self.rollout.strategy == "blueGreen" else tuple(self.rollout.steps)

    def revision_source(self) -> RevisionSource:
        """The part of the spec that defines the model pods."""
        return RevisionSource(**{name: getattr(self, name) for name in RevisionSource.model_fields})


def _semantic_checks(spec: DeepSeekCacheDeploymentSpec) -> None:
    # What the schema's CEL rules say, again: a CRD installed without them (or an
    # older one) must not get an unreconcilable spec past the operator.
    if (spec.model.preset is None) == (spec.model.path is None):
        raise InvalidSpecError("set exactly one of spec.model.preset or spec.model.path")
    steps = spec.rollout.steps
    if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100:
        raise InvalidSpecError(f"spec.rollout.steps must increase and end at 100, got {steps}")
    vol = spec.cache.volume
    if vol.type == "hostPath" and not vol.host_path:
        raise InvalidSpecError("spec.cache.volume.hostPath is required for type hostPath")
    if vol.claim_name is not None:
        raise InvalidSpecError(f"spec.{CLAIM_NAME_REFUSED}")
    if vol.type == "persistentVolumeClaim" and vol.claim_template is None:
        raise InvalidSpecError(
            "spec.cache.volume.claimTemplate is required when type is persistentVolumeClaim"
        )
    _shared_tier_checks(spec)
    if spec.tenant_salt.source == "secret" and spec.tenant_salt.secret_ref is None:
        raise InvalidSpecError("spec.tenantSalt.secretRef is required when source is secret")
    tenancy = spec.auth.api_keys_secret_ref is not None
    _vllm_checks(spec)
    if tenancy and spec.prewarm.prompts is not None and spec.prewarm.api_key_secret_ref is None:
        raise InvalidSpecError(
            "spec.prewarm.apiKeySecretRef is required when spec.auth.apiKeysSecretRef is set "
            "and prewarm prompts are given (the prewarm Job needs a key of the file)"
        )
    if 0.0 < spec.routing.balance_factor < 1.0:
        raise InvalidSpecError(
            f"spec.routing.balanceFactor must be 0 (off) or at least 1, "
            f"got {spec.routing.balance_factor}"
        )
    if spec.interval_s < 1:
        raise InvalidSpecError("spec.rollout.interval must be at least 1s")


def _vllm_checks(spec: DeepSeekCacheDeploymentSpec) -> None:
    """What engine vllm cannot do (the reference server's features)."""
    tenancy = spec.auth.api_keys_secret_ref is not None
    if spec.engine == "vllm" and spec.model.path is None:
        raise InvalidSpecError("engine vllm serves a checkpoint directory: set spec.model.path")
    if spec.engine == "vllm" and tenancy:
        raise InvalidSpecError(
            "spec.auth.apiKeysSecretRef is checked by the reference server only; with engine "
            "vllm check API keys at your gateway"
        )
    if spec.engine == "vllm" and spec.auth.gateway_secret_ref is not None:
        raise InvalidSpecError(
            "spec.auth.gatewaySecretRef is checked by the reference server only; with engine "
            "vllm check tenants at your gateway"
        )
    if spec.engine == "vllm" and spec.server.dtype != "float32":
        raise InvalidSpecError(f"{_VLLM_DTYPE}, got {spec.server.dtype!r}")
    if spec.engine == "vllm" and spec.cache.codec == "int8":
        raise InvalidSpecError(_VLLM_INT8)
    events = spec.cache.kv_events
    ports = [events.port, events.replay_port, events.engine.port, events.engine.replay_port]
    if len(set(ports)) != len(ports):
        raise InvalidSpecError(f"{KV_EVENT_PORTS_DIFFER}, got {ports}")
    if events.engine_ports(spec.engine) and any(
        a.startswith("--kv-events-config") for a in spec.vllm.args
    ):
        raise InvalidSpecError(_VLLM_KV_EVENTS)


def _shared_tier_checks(spec: DeepSeekCacheDeploymentSpec) -> None:
    shared = spec.cache.shared
    if shared.enabled and shared.secret_ref is None:
        raise InvalidSpecError(
            "spec.cache.shared.secretRef is required when spec.cache.shared.enabled is true: "
            "name a Secret whose endpoints key holds the Redis Cluster's host:port list"
        )
    if shared.tls.ca_secret_ref is not None and not shared.tls.enabled:
        raise InvalidSpecError(
            "spec.cache.shared.tls.caSecretRef is set but spec.cache.shared.tls.enabled is "
            "false: enable TLS or remove the CA"
        )
    ttl = shared.ttl_s
    if ttl < 1 or not ttl.is_integer():
        raise InvalidSpecError(
            f"spec.cache.shared.ttl must be whole seconds, at least 1s, got {shared.ttl!r}"
        )


def parse_spec(raw: dict[str, Any] | Any) -> DeepSeekCacheDeploymentSpec:
    """Parses and checks a resource's ``spec``.

    Raises:
        InvalidSpecError: with a message naming the field and what to change.
    """
    try:
        spec = DeepSeekCacheDeploymentSpec.model_validate(dict(raw or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidSpecError(problems) from exc
    _semantic_checks(spec)
    return spec
