"""What the rollout machine reads and what it decides (plain, frozen values).

:class:`Observed` is everything :func:`dscache_operator.rollout.next_step` may
look at besides the status and the clock: the spec's rollout settings, the
tracks' Deployments, the prewarm Job, the control annotations and, when a step
is due, the analysis :class:`Verdict`. :class:`Decision` is its answer: the new
typed status plus the side effects (Events, annotations to clear, when to look
again). Nothing here touches the API; :mod:`dscache_operator.reconcile` builds
the observation and carries out the decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dscache_operator.status import DeepSeekCacheDeploymentStatus, VerdictResult

ANNOTATION_PROMOTE = "dscache.io/promote"
ANNOTATION_PAUSE = "dscache.io/pause"
ANNOTATION_ABORT = "dscache.io/abort"
_FALSE = {"false", "0", "no", "off"}  # an empty value is a set flag


def _flag(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in _FALSE


PrewarmState = Literal["absent", "running", "succeeded", "failed"]


@dataclass(frozen=True)
class TrackObservation:
    """What the API server shows of one track's Deployment."""

    exists: bool = False
    ready: bool = False
    undone: bool = False


@dataclass(frozen=True)
class Annotations:
    """The control annotations on the resource."""

    promote: str | None = None
    pause: bool = False
    abort: bool = False

    @classmethod
    def from_metadata(cls, annotations: Mapping[str, str] | None) -> Annotations:
        """Reads them from ``metadata.annotations``; ``pause: "false"`` is not a pause."""
        a = dict(annotations or {})
        return cls(
            promote=a.get(ANNOTATION_PROMOTE),
            pause=_flag(a.get(ANNOTATION_PAUSE)),
            abort=_flag(a.get(ANNOTATION_ABORT)),
        )


@dataclass(frozen=True)
class Verdict:
    """The analysis of one step."""

    result: VerdictResult
    message: str = ""
    hit_rate: float | None = None
    ttft_p99_seconds: float | None = None
    stable_ttft_p99_seconds: float | None = None
    stable_hit_rate: float | None = None


@dataclass(frozen=True)
class Observed:
    """Everything ``next_step`` may look at besides the status and the clock."""

    generation: int
    revision: str
    source: Mapping[str, Any]
    steps: tuple[int, ...] = (10, 25, 50, 100)
    interval_s: float = 300.0
    rollback_window_s: float = 1800.0
    prewarm_enabled: bool = True
    tracks: Mapping[str, TrackObservation] = field(default_factory=dict)
    #: The router Deployment has an available pod: the service's clients get answers.
    #: It does not steer the rollout (its analysis reads the model pods), only the
    #: ``Available`` and ``Ready`` conditions.
    router_ready: bool = True
    #: The prewarm Job of the step about to be entered: step 0 while Prewarming,
    #: the next step during a step ("succeeded" when that step needs no Job).
    prewarm: PrewarmState = "absent"
    annotations: Annotations = field(default_factory=Annotations)
    verdict: Verdict | None = None

    def track(self, slot: str | None) -> TrackObservation:
        """The observation of ``slot`` (absent if unknown)."""
        return self.tracks.get(slot or "", TrackObservation())


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the resource."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    """The new status and the side effects that go with it.

    Attributes:
        status: the new status.
        events: the Kubernetes Events to record.
        clear_annotations: the one-shot annotations (promote, abort) consumed.
        prewarm_job: create the prewarm Job of this rollout step now (0: before the
            first step; ``N``: before step ``N``), or None.
    """

    status: DeepSeekCacheDeploymentStatus
    events: tuple[Event, ...] = ()
    clear_annotations: tuple[str, ...] = ()
    prewarm_job: int | None = None
