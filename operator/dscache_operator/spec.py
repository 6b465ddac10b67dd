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

import hashlib
import itertools
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from dscache_operator.nginx import DEBIAN_LUA_MODULES

DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=32)]
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=32)]
ShortString = Annotated[str, Field(min_length=1, max_length=253)]
ResourceList = dict[str, int | str]


class InvalidSpecError(ValueError):
    """The resource's spec cannot be reconciled; the message says what to change."""


def parse_duration(value: str) -> float:
    """``"90s"``, ``"5m"``, ``"1h30m"``, ``"250ms"`` -> seconds."""
    if not re.fullmatch(DURATION_PATTERN, value):
        raise ValueError(f"not a duration: {value!r} (examples: 30s, 5m, 1h30m)")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ImageSpec(_Model):
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
#: Debian's NGINX with the ndk and Lua modules (loaded from DEBIAN_LUA_MODULES).
DEFAULT_ROUTER_IMAGE = ImageSpec(repository="ghcr.io/dscache/dscache-router", tag="0.1.0")
#: ``load_module`` paths of the default router image (Debian's libnginx-mod-http-{ndk,lua}).
DEFAULT_ROUTER_MODULES: tuple[str, ...] = DEBIAN_LUA_MODULES


class ResourcesSpec(_Model):
    """Compute resources of a container (as in a Pod's resources)."""

    requests: ResourceList = Field(
        default_factory=dict, description="Minimum resources, e.g. cpu: '4', memory: 32Gi."
    )
    limits: ResourceList = Field(
        default_factory=dict,
        description="Maximum resources; GPUs go here, e.g. nvidia.com/gpu: 1.",
    )


class ModelSpec(_Model):
    """The model to serve: a built-in preset or a checkpoint directory in the image."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.preset) != has(self.path)",
                    "message": "set exactly one of model.preset or model.path",
                }
            ]
        }
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


class ServerSpec(_Model):
    """The model server container (``dscache server``)."""

    image: ImageSpec = Field(default=DEFAULT_IMAGE, description="Model server image.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port of the OpenAI API.")
    max_concurrency: int = Field(
        default=1, ge=1, le=1024, description="Requests generating at once."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Resources of the model server container."
    )


class SidecarSpec(_Model):
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


class CacheVolumeSpec(_Model):
    """Where the sidecar keeps its segment files."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.type != 'hostPath' || has(self.hostPath)",
                    "message": "cache.volume.hostPath is required when type is hostPath",
                },
                {
                    "rule": "self.type != 'persistentVolumeClaim' || has(self.claimName)",
                    "message": "cache.volume.claimName is required when type is "
                    "persistentVolumeClaim",
                },
            ]
        }
    )

    type: Literal["emptyDir", "hostPath", "persistentVolumeClaim"] = Field(
        default="emptyDir",
        description="emptyDir (per pod, lost on reschedule), hostPath (node-local SSD, survives "
        "pod restarts) or persistentVolumeClaim.",
    )
    host_path: Annotated[str, Field(max_length=1024, pattern=r"^/")] | None = Field(
        default=None, description="Node directory for type hostPath."
    )
    claim_name: Annotated[str, Field(max_length=253)] | None = Field(
        default=None, description="PersistentVolumeClaim name for type persistentVolumeClaim."
    )


class CacheSpec(_Model):
    """The KV store of each model pod."""

    volume: CacheVolumeSpec = Field(
        default_factory=CacheVolumeSpec, description="Volume of the segment files."
    )
    size: Quantity = Field(default="10Gi", description="Segment space per pod, e.g. 200Gi.")
    block_tokens: int = Field(
        default=256, ge=16, le=8192, description="Tokens per cached block (part of the cache key)."
    )
    codec: Literal["auto", "raw", "zstd"] = Field(
        default="auto", description="Block codec policy: auto compresses only where it pays."
    )
    min_tokens: int = Field(
        default=512, ge=0, le=1 << 20, description="Prompts shorter than this are not cached."
    )


class RoutingSpec(_Model):
    """The NGINX router in front of the model pods."""

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
    replicas: int = Field(default=2, ge=0, le=100, description="Router pods.")
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


class ConfigMapKeyRef(_Model):
    """A key of a ConfigMap in the resource's namespace."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)] = Field(
        description="ConfigMap name."
    )
    key: Annotated[str, Field(max_length=253, min_length=1)] = Field(
        default="prompts.jsonl", description="Key holding the prompts, one JSON chat per line."
    )


class PrewarmSpec(_Model):
    """Prewarming a new revision's cache before it takes traffic."""

    enabled: bool = Field(default=True, description="Run a prewarm Job for every new revision.")
    image: ImageSpec = Field(
        default=DEFAULT_CORE_IMAGE,
        description="Image of the prewarm Job (runs `dscache prewarm`; the slim core image).",
    )
    prompts: ConfigMapKeyRef | None = Field(
        default=None,
        description="Prompts to replay (JSONL of chats, hottest first); no prompts, no Job.",
    )
    top_n: int = Field(default=100, ge=1, le=100000, description="Replay the first N prompts.")
    concurrency: int = Field(default=2, ge=1, le=256, description="Prewarm requests in flight.")
    timeout: Duration = Field(
        default="15m", description="Deadline of the prewarm Job; past it the rollout aborts."
    )


class AnalysisSpec(_Model):
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


class RolloutSpec(_Model):
    """How a new revision replaces the stable one."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self.steps.isSorted()", "message": "rollout.steps must increase"},
                {
                    "rule": "self.steps[self.steps.size() - 1] == 100",
                    "message": "the last rollout step must be 100",
                },
            ]
        }
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


class SecretKeyRef(_Model):
    """A key of a Secret in the resource's namespace (read by the pods, never the operator)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)] = Field(
        description="Secret name."
    )
    key: Annotated[str, Field(min_length=1, max_length=253)] = Field(description="Key.")


class TenantSaltSpec(_Model):
    """Where the cache-key tenant salt comes from (isolates tenants' cached prompts)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.source != 'secret' || has(self.secretRef)",
                    "message": "tenantSalt.secretRef is required when source is secret",
                }
            ]
        }
    )

    source: Literal["namespace", "secret", "none"] = Field(
        default="namespace",
        description="namespace: the namespace name; secret: secretRef; none: one shared cache.",
    )
    secret_ref: SecretKeyRef | None = Field(default=None, description="Secret key of the salt.")


LabelKey = Annotated[str, Field(pattern=r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9._-]{1,63}$")]


class TolerationSpec(_Model):
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


class SchedulingSpec(_Model):
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


class MonitoringSpec(_Model):
    """Prometheus Operator objects, created only when their CRDs exist in the cluster."""

    service_monitor: bool = Field(default=True, description="Create a ServiceMonitor.")
    prometheus_rule: bool = Field(
        default=True,
        description="Create a PrometheusRule: hit rate under minHitRate for 10m, or, without "
        "minHitRate, under minHitRateRatio times its own level of the hour before.",
    )


class DeepSeekCacheDeploymentSpec(_Model):
    """Desired state of a DeepSeekCacheDeployment."""

    model: ModelSpec = Field(description="The model to serve.")
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
        return RevisionSource(
            model=self.model,
            server=self.server,
            sidecar=self.sidecar,
            cache=self.cache,
            tenant_salt=self.tenant_salt,
            scheduling=self.scheduling,
        )


class RevisionSource(_Model):
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


def revision_of(source: RevisionSource) -> str:
    """A short, stable hash of ``source`` (canonical JSON, sha256)."""
    data = json.dumps(source.model_dump(mode="json", by_alias=True), sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:10]


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
    if vol.type == "persistentVolumeClaim" and not vol.claim_name:
        raise InvalidSpecError("spec.cache.volume.claimName is required for a PVC")
    if spec.tenant_salt.source == "secret" and spec.tenant_salt.secret_ref is None:
        raise InvalidSpecError("spec.tenantSalt.secretRef is required when source is secret")
    if spec.interval_s < 1:
        raise InvalidSpecError("spec.rollout.interval must be at least 1s")


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
