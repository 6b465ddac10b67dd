"""The operator's settings: one typed object read from ``DSCACHE_OPERATOR_*`` env vars.

Command-line flags of ``dscache operator`` override the environment, which
overrides the defaults. The long prefix cannot collide with the
``<SERVICE>_PORT`` variables Kubernetes injects into pods.
"""

from __future__ import annotations

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
    def clusterwide(self) -> bool:
        """Watch every namespace."""
        return self.all_namespaces or not self.namespaces
