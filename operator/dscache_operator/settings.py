"""The operator's settings: one typed object read from ``DSCACHE_OPERATOR_*`` env vars.

Command-line flags of ``dscache operator`` override the environment, which
overrides the defaults. The long prefix cannot collide with the
``<SERVICE>_PORT`` variables Kubernetes injects into pods. :func:`peering_priority`
is the one derived value: a replica's kopf peering priority, higher for an
older process.
"""

from __future__ import annotations

import random
import time
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from dscache_operator.policy import (
    DEFAULT_HOST_PATH_ROOT,
    DEFAULT_MAX_CACHE_SIZE,
    DEFAULT_METRICS_PEERS,
    AdminPolicy,
)
from dscache_operator.revision import DEFAULT_CORE_IMAGE, ImageSpec
from dscache_operator.schema import QUANTITY_PATTERN


class OperatorSettings(BaseSettings):
    """Every knob of ``dscache operator``; units are in the names."""

    model_config = SettingsConfigDict(env_prefix="DSCACHE_OPERATOR_", extra="forbid")

    namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="namespaces to watch (comma-separated in the env var); empty = all",
    )
    all_namespaces: bool = Field(default=False, description="watch every namespace")
    tick_seconds: float = Field(
        default=10.0, gt=0, description="seconds between rollout timer ticks per resource"
    )
    retry_delay_seconds: float = Field(
        default=5.0, gt=0, description="seconds before retrying after an API error"
    )
    prometheus_url: str | None = Field(
        default=None, description="default Prometheus base URL for rollout analysis"
    )
    prometheus_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="seconds one rollout analysis may spend on Prometheus in all (each of its "
        "queries, connection and body included, and all of them together)",
    )
    api_timeout_seconds: float = Field(
        default=30.0, gt=0, description="seconds per Kubernetes API request"
    )
    reapply_seconds: float = Field(
        default=60.0,
        ge=0,
        description="seconds an unchanged child is not re-applied (drift is repaired after it)",
    )
    health_port: int = Field(default=8080, ge=0, le=65535, description="port of /healthz (0 = off)")
    metrics_port: int = Field(
        default=9090, ge=0, le=65535, description="port of the operator's /metrics (0 = off)"
    )
    max_workers: int = Field(
        default=4, ge=1, le=64, description="threads running handlers (resources in parallel)"
    )
    peering: str = Field(
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        max_length=253,
        description="kopf peering object (ClusterKopfPeering with all namespaces, else a "
        "KopfPeering in each watched namespace) shared by the operator's replicas: exactly "
        "one acts, the others stand by; empty = standalone (one process, e.g. from a shell)",
    )
    peering_lifetime_seconds: int = Field(
        default=30,
        ge=2,
        le=3600,
        description="seconds a replica's peering record counts as alive without a keep-alive: "
        "how long a standby waits before taking over from a replica that died without saying so",
    )

    # -- what resources may make the operator do (the admin's policy, dscache_operator.policy)
    host_path_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [DEFAULT_HOST_PATH_ROOT],
        description="node directories a hostPath cache may be in or below (comma-separated in "
        "the env var; normalised); empty = no hostPath caches",
    )
    max_cache_size: str = Field(
        default=DEFAULT_MAX_CACHE_SIZE,
        pattern=QUANTITY_PATTERN,
        description="largest spec.cache.size (bytes per pod, a Kubernetes quantity)",
    )
    toleration_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"],
        description="taint keys a resource's pods may tolerate (fnmatch patterns, "
        "comma-separated); empty = no tolerations",
    )
    allow_keyless_tolerations: bool = Field(
        default=False,
        description="allow a toleration without a key (it tolerates every taint)",
    )
    shared_tier_images: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(AdminPolicy().shared_tier_images),
        description="sidecar images (fnmatch patterns over repository:tag or repository@digest, "
        "comma-separated) that may receive the shared tier's credential",
    )
    prometheus_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Prometheus base URLs a resource's rollout.analysis.prometheusUrl may name "
        "besides prometheus_url (comma-separated); any other is never fetched",
    )
    prometheus_max_body_bytes: int = Field(
        default=1 << 20, ge=1024, le=64 << 20, description="largest Prometheus answer read"
    )
    cache_owner_image: str = Field(
        default=DEFAULT_CORE_IMAGE.reference,
        min_length=1,
        max_length=512,
        description="image of the root init container that hands a hostPath cache directory to "
        "the pods' user (repository:tag or repository@sha256:...); never the resource's",
    )

    network_policies: bool = Field(
        default=True,
        description="render a NetworkPolicy per component of each resource (model pods "
        "reachable from its router, prewarm Jobs and the metrics peers only)",
    )
    metrics_peers: list[dict[str, Any]] = Field(
        default_factory=lambda: [dict(p) for p in DEFAULT_METRICS_PEERS],
        description="NetworkPolicy peers (JSON list: podSelector, namespaceSelector, ipBlock) "
        "that may scrape the model pods' server and sidecar ports: your Prometheus",
    )

    @field_validator(
        "namespaces",
        "host_path_roots",
        "toleration_keys",
        "shared_tier_images",
        "prometheus_urls",
        mode="before",
    )
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [n.strip() for n in value.split(",") if n.strip()]
        return value

    def policy(self) -> AdminPolicy:
        """The admin's rules for resources, from these settings."""
        repo, sep, tag = self.cache_owner_image.rpartition(
            "@" if "@" in self.cache_owner_image else ":"
        )
        if not sep or not repo or "/" in tag:
            repo, tag = self.cache_owner_image, "latest"
        return AdminPolicy(
            host_path_roots=tuple(self.host_path_roots),
            max_cache_size=self.max_cache_size,
            toleration_keys=tuple(self.toleration_keys),
            allow_keyless_tolerations=self.allow_keyless_tolerations,
            shared_tier_images=tuple(self.shared_tier_images),
            prometheus_url=self.prometheus_url,
            prometheus_urls=tuple(self.prometheus_urls),
            cache_owner_image=ImageSpec(repository=repo, tag=tag),
            network_policies=self.network_policies,
            metrics_peers=tuple(self.metrics_peers),
        )

    @model_validator(mode="after")
    def _scope(self) -> OperatorSettings:
        if self.all_namespaces and self.namespaces:
            raise ValueError("choose either namespaces or all_namespaces")
        return self

    @property
    def standalone(self) -> bool:
        """No peering: this process acts alone."""
        return not self.peering

    @property
    def clusterwide(self) -> bool:
        """Watch every namespace."""
        return self.all_namespaces or not self.namespaces


#: Priorities are ``(_EPOCH_END - start second) * _TIEBREAK + random``: positive
#: until the year 2128, and below 2**53, so JSON carries them exactly.
_EPOCH_END = 5 * 10**9
_TIEBREAK = 10**6


def peering_priority(started_at: float | None = None, tiebreak: int | None = None) -> int:
    """This process's kopf peering priority: the older the process, the higher.

    kopf pauses every peer that sees a live peer of a higher priority, and every
    peer of an equal one, so replicas need distinct priorities. Ranking by start
    time keeps the active replica active while others start (a rolling update
    or a scale-up never moves the work to a newcomer); the random low digits
    break ties between replicas started within the same second.

    Args:
        started_at: the start time (Unix seconds); default now.
        tiebreak: the low digits (0 <= x < 10**6); default random.
    """
    started = time.time() if started_at is None else started_at
    low = random.randrange(_TIEBREAK) if tiebreak is None else tiebreak
    return (_EPOCH_END - int(started)) * _TIEBREAK + low
