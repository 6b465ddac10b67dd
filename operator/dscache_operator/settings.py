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
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


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
        default=10.0, gt=0, description="seconds per PromQL query"
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

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [n.strip() for n in value.split(",") if n.strip()]
        return value

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
