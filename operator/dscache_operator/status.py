"""The ``DeepSeekCacheDeployment`` status as a typed model, and its one edge to the wire.

The operator reads the status kopf hands in with :func:`parse_status` and
writes it back with :func:`dump_status`; everything in between (the rollout
machine, the desired objects) works on :class:`DeepSeekCacheDeploymentStatus`,
with times as timezone-aware :class:`~datetime.datetime` values. The CRD's
status schema is generated from these models by :mod:`dscache_operator.crd`.

Invariants:
* Times are UTC and whole seconds (as Kubernetes writes them), both when parsed
  and when assigned, so a status that went through the API server equals the
  one the operator computed.
* The models validate on assignment: the rollout machine mutates a private copy
  and can never build a status the CRD would refuse.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict


def rfc3339(t: datetime) -> str:
    """``2026-11-30T12:00:00Z`` (UTC, whole seconds, as Kubernetes writes times)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _utc_seconds(t: datetime) -> datetime:
    # A time without a zone is taken as UTC (Kubernetes never writes one).
    aware = t if t.tzinfo is not None else t.replace(tzinfo=UTC)
    return aware.astimezone(UTC).replace(microsecond=0)


#: A status time: parsed from RFC 3339, held as aware UTC, written back as RFC 3339.
Timestamp = Annotated[
    datetime,
    AfterValidator(_utc_seconds),
    PlainSerializer(rfc3339, return_type=str, when_used="json"),
]
_TIME: JsonDict = {"format": "date-time"}

Slot = Literal["blue", "green"]
SLOTS: tuple[Slot, Slot] = ("blue", "green")
Phase = Literal[
    "Pending",
    "Available",
    "Deploying",
    "Prewarming",
    "Progressing",
    "Paused",
    "RolledBack",
    "Degraded",
    "Failed",
]
VerdictResult = Literal["Pass", "Fail", "NoData", "Skipped"]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )


class Condition(_Model):
    """A metav1.Condition."""

    type: Annotated[str, Field(max_length=316)] = Field(description="Condition type.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: Annotated[str, Field(max_length=1024)] = Field(description="CamelCase reason.")
    message: Annotated[str, Field(max_length=32768)] = Field(default="", description="Details.")
    last_transition_time: Timestamp = Field(
        description="When status last changed (RFC 3339).", json_schema_extra=_TIME
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this condition was set for."
    )


class AnalysisResult(_Model):
    """One analysis of a rollout step."""

    at: Timestamp = Field(description="When (RFC 3339).", json_schema_extra=_TIME)
    weight: int = Field(description="Canary weight analysed, percent.")
    result: VerdictResult = Field(description="Verdict.")
    hit_rate: float | None = Field(default=None, description="Canary token hit rate.")
    stable_hit_rate: float | None = Field(
        default=None, description="Stable token hit rate the canary was compared with."
    )
    ttft_p99_seconds: float | None = Field(default=None, description="Canary P99 TTFT.")
    stable_ttft_p99_seconds: float | None = Field(default=None, description="Stable P99 TTFT.")
    message: str = Field(default="", description="Why.")


class SlotStatus(_Model):
    """One model track (a Deployment named <name>-<slot>) and the revision it runs."""

    revision: str = Field(description="Revision hash of this track's template.")
    source: dict[str, Any] = Field(
        description="The spec fields this track's template was built from.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    frozen: bool = Field(
        default=False,
        description="A rollout undo changed this Deployment; the operator leaves its template "
        "alone until the track gets a new revision.",
    )


class LastAction(_Model):
    """The last annotation or event the operator acted on."""

    type: str = Field(description="promote, pause, abort, undo, ...")
    value: str = Field(default="", description="Annotation value, if any.")
    at: Timestamp = Field(description="When (RFC 3339).", json_schema_extra=_TIME)
    message: str = Field(default="", description="What was done.")


class DeepSeekCacheDeploymentStatus(_Model):
    """Observed state of a DeepSeekCacheDeployment, written only by the operator."""

    observed_generation: int | None = Field(default=None, description="Last generation seen.")
    phase: Phase = Field(default="Pending", description="Summary of the state.")
    stable_slot: Slot | None = Field(default=None, description="Track serving stable traffic.")
    stable_revision: str | None = Field(default=None, description="Revision of the stable track.")
    canary_slot: Slot | None = Field(default=None, description="Track of the rollout.")
    canary_revision: str | None = Field(default=None, description="Revision being rolled out.")
    weight: int = Field(default=0, ge=0, le=100, description="Percent of sessions on the canary.")
    step_index: int | None = Field(default=None, description="Index into rollout steps.")
    step_started_at: Timestamp | None = Field(
        default=None, description="When the current step began.", json_schema_extra=_TIME
    )
    previous_slot: Slot | None = Field(
        default=None, description="Old stable track kept warm until retireAt."
    )
    retire_at: Timestamp | None = Field(
        default=None,
        description="When the previous track is scaled down.",
        json_schema_extra=_TIME,
    )
    rolled_back_revision: str | None = Field(
        default=None, description="Revision rolled back; not retried until the spec changes."
    )
    hit_rate: str | None = Field(default=None, description="Last analysed canary hit rate.")
    last_analysis: AnalysisResult | None = Field(default=None, description="Last analysis.")
    last_action: LastAction | None = Field(default=None, description="Last action taken.")
    slots: dict[str, SlotStatus] = Field(
        default_factory=dict, description="Tracks by slot name (blue, green)."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Available, Progressing, Degraded, RolledBack, Ready.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )


def parse_status(raw: dict[str, Any] | Any) -> DeepSeekCacheDeploymentStatus:
    """The operator's own status fields; foreign keys (kopf's) are ignored."""
    own = DeepSeekCacheDeploymentStatus.model_fields
    aliases = {f.alias or n for n, f in own.items()}
    data = {k: v for k, v in dict(raw or {}).items() if k in aliases}
    return DeepSeekCacheDeploymentStatus.model_validate(data)


def dump_status(status: DeepSeekCacheDeploymentStatus) -> dict[str, Any]:
    """Wire form of ``status``; ``None`` fields are written as nulls (a merge patch clears them)."""
    return status.model_dump(mode="json", by_alias=True)
