"""The rollout state machine: ``next_step(status, observed, now) -> Decision`` (pure).

Two model tracks, ``blue`` and ``green`` (Deployments ``<name>-<slot>``), take
turns: one is stable, the other receives the next revision. A rollout goes

    Deploying -> Prewarming -> Progressing(step 0 .. n-1) -> promoted (Available)

with ``weight`` = ``steps[i]`` percent of sessions on the canary during step i
(blue-green: one step of 100). Each step lasts ``interval``; then the analysis
verdict decides: Pass -> next step (after the last: promote), Fail -> abort,
NoData -> hold (phase Paused) until data comes; never promote blind. The
verdict (with the canary's and the stable track's figures it compared) is
recorded in ``status.lastAnalysis``. On
promotion the canary becomes stable and the old track stays warm until
``retireAt`` (rollbackWindow), when it is scaled to zero. An abort sets weight
0, marks the revision rolled back (not retried until the spec changes) and
scales the canary down.

Annotations: ``dscache.io/pause`` holds (level: while present);
``dscache.io/promote`` (``full`` = finish now, anything else = one step) and
``dscache.io/abort`` are one-shot: acted on, recorded in status and Events,
then cleared. ``dscache.io/abort`` after promotion, while the old track is
still warm, switches traffic straight back to it.

A ``kubectl rollout undo`` of a track's Deployment (``undone``) is a rollback
decision: during a rollout it aborts; outside one it is recorded. The undone
Deployment is frozen (its template is not re-applied) until that track gets a
new revision, which only a spec change causes.

Invariants: the output depends only on the arguments; every field of the
decision is derivable from status + observations, so an operator restarted at
any point resumes exactly where it was, never repeating or skipping a step;
the weight never rises except on Pass or promote; an abort always leaves
weight 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from dscache_operator.conditions import get_condition, parse_time, rfc3339, set_condition
from dscache_operator.spec import (
    SLOTS,
    AnalysisResult,
    DeepSeekCacheDeploymentStatus,
    LastAction,
    Phase,
    Slot,
    SlotStatus,
)

ANNOTATION_PROMOTE = "dscache.io/promote"
ANNOTATION_PAUSE = "dscache.io/pause"
ANNOTATION_ABORT = "dscache.io/abort"
_FALSE = {"", "false", "0", "no", "off"}

PrewarmState = Literal["absent", "running", "succeeded", "failed"]
VerdictResult = Literal["Pass", "Fail", "NoData", "Skipped"]


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
        pause = a.get(ANNOTATION_PAUSE)
        abort = a.get(ANNOTATION_ABORT)
        return cls(
            promote=a.get(ANNOTATION_PROMOTE),
            pause=pause is not None and pause.strip().lower() not in _FALSE - {""},
            abort=abort is not None and abort.strip().lower() not in _FALSE - {""},
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
    """The new status and the side effects that go with it."""

    status: DeepSeekCacheDeploymentStatus
    events: tuple[Event, ...] = ()
    clear_annotations: tuple[str, ...] = ()
    requeue_after_s: float | None = None


def other(slot: Slot) -> Slot:
    """The other track."""
    return "green" if slot == "blue" else "blue"


def in_rollout(status: DeepSeekCacheDeploymentStatus) -> bool:
    """A canary revision is being rolled out."""
    return status.canary_slot is not None and status.canary_revision is not None


def analysis_due(status: DeepSeekCacheDeploymentStatus, observed: Observed, now: datetime) -> bool:
    """Whether the current step's interval is over, so its metrics must be fetched."""
    if not in_rollout(status) or status.step_index is None or status.step_started_at is None:
        return False
    if observed.annotations.pause:
        return False
    return now >= parse_time(status.step_started_at) + timedelta(seconds=observed.interval_s)


class _Work:
    """The mutable scratch state of one ``next_step`` call."""

    def __init__(self, status: DeepSeekCacheDeploymentStatus, observed: Observed, now: datetime):
        self.s: dict[str, Any] = status.model_dump()
        self.o = observed
        self.now = now
        self.events: list[Event] = []
        self.clear: list[str] = []
        self.rolled_back: tuple[str, str] | None = None  # (reason, message)
        self.new_rollout = False
        self.hold_reason: tuple[str, str] | None = None

    # -- helpers -----------------------------------------------------------------------
    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def action(self, type_: str, value: str, message: str) -> None:
        self.s["last_action"] = LastAction(
            type=type_, value=value, at=rfc3339(self.now), message=message
        ).model_dump()

    def set_slot(self, slot: Slot, revision: str, source: Mapping[str, Any]) -> None:
        self.s["slots"][slot] = SlotStatus(revision=revision, source=dict(source)).model_dump()

    def freeze(self, slot: str) -> None:
        if slot in self.s["slots"]:
            self.s["slots"][slot]["frozen"] = True

    def enter_step(self, index: int) -> None:
        self.s["step_index"] = index
        self.s["weight"] = self.o.steps[index]
        self.s["step_started_at"] = rfc3339(self.now)
        self.s["phase"] = "Progressing"
        self.event(
            "Normal",
            "StepStarted",
            f"canary {self.s['canary_revision']} at {self.s['weight']}% of sessions "
            f"(step {index + 1}/{len(self.o.steps)})",
        )

    def end_rollout(self) -> None:
        self.s.update(
            canary_slot=None,
            canary_revision=None,
            weight=0,
            step_index=None,
            step_started_at=None,
        )

    def promote(self, how: str) -> None:
        old, new = self.s["stable_slot"], self.s["canary_slot"]
        revision = self.s["canary_revision"]
        self.end_rollout()
        self.s.update(
            stable_slot=new,
            stable_revision=revision,
            previous_slot=old,
            retire_at=rfc3339(self.now + timedelta(seconds=self.o.rollback_window_s)),
            phase="Available",
        )
        self.event(
            "Normal",
            "Promoted",
            f"revision {revision} is stable ({how}); track {old} stays warm until "
            f"{self.s['retire_at']}",
        )

    def abort(self, reason: str, message: str) -> None:
        revision = self.s["canary_revision"]
        self.s["rolled_back_revision"] = revision
        self.end_rollout()
        self.s["phase"] = "RolledBack"
        text = f"revision {revision} rolled back, all sessions on stable: {message}"
        self.rolled_back = (reason, text)
        self.event("Warning", reason, text)

    def advance(self) -> None:
        index = self.s["step_index"]
        if index is None:
            self.enter_step(0)
        elif index + 1 < len(self.o.steps):
            self.enter_step(index + 1)
        else:
            self.promote("analysis passed at every step")

    def record(self, v: Verdict) -> None:
        self.s["last_analysis"] = AnalysisResult(
            at=rfc3339(self.now),
            weight=self.s["weight"],
            result=v.result,
            hit_rate=v.hit_rate,
            stable_hit_rate=v.stable_hit_rate,
            ttft_p99_seconds=v.ttft_p99_seconds,
            stable_ttft_p99_seconds=v.stable_ttft_p99_seconds,
            message=v.message,
        ).model_dump()
        if v.hit_rate is not None:
            self.s["hit_rate"] = f"{v.hit_rate:.3f}"


def next_step(status: DeepSeekCacheDeploymentStatus, observed: Observed, now: datetime) -> Decision:
    """Decides what to do next; see the module docstring for the rules."""
    w = _Work(status, observed, now)
    _first_deploy(w)
    _retire(w)
    if in_rollout(status):
        _during_rollout(w)
    else:
        _between_rollouts(w)
    _finish_phase(w)
    new = DeepSeekCacheDeploymentStatus.model_validate(w.s)
    new = _with_conditions(new, w)
    return Decision(
        status=new,
        events=tuple(w.events),
        clear_annotations=tuple(w.clear),
        requeue_after_s=_requeue(new, observed, now),
    )


def _first_deploy(w: _Work) -> None:
    if w.s["stable_slot"] is not None:
        return
    w.set_slot("blue", w.o.revision, w.o.source)
    w.s.update(stable_slot="blue", stable_revision=w.o.revision, phase="Pending")
    w.event("Normal", "Created", f"revision {w.o.revision} deployed as track blue")


def _retire(w: _Work) -> None:
    prev, at = w.s["previous_slot"], w.s["retire_at"]
    if prev is None or at is None or w.now < parse_time(at):
        return
    w.s.update(previous_slot=None, retire_at=None)
    w.event("Normal", "Retired", f"track {prev} scaled down (rollback window over)")


def _during_rollout(w: _Work) -> None:
    o, s = w.o, w.s
    canary = s["canary_slot"]
    undone = [slot for slot in SLOTS if o.track(slot).undone and not _frozen(w, slot)]
    if o.revision == s["stable_revision"]:
        w.end_rollout()
        w.event("Normal", "RolloutCancelled", "spec is back at the stable revision")
        return
    if o.revision != s["canary_revision"]:
        _start_rollout(w, canary, restarted=True)
        return
    if undone:
        for slot in undone:
            w.freeze(slot)
        w.action("undo", ",".join(undone), "kubectl rollout undo detected")
        w.abort("RolloutUndo", f"Deployment of track {','.join(undone)} was rolled back by hand")
        return
    if o.annotations.abort:
        w.clear.append(ANNOTATION_ABORT)
        w.action("abort", "", "rollout aborted by annotation")
        w.abort("Aborted", f"{ANNOTATION_ABORT} annotation")
        return
    if o.annotations.promote is not None:
        value = o.annotations.promote.strip().lower()
        w.clear.append(ANNOTATION_PROMOTE)
        if value == "full":
            w.action("promote", value, "promoted fully by annotation")
            w.promote(f"{ANNOTATION_PROMOTE}=full")
        else:
            w.action("promote", value, "advanced one step by annotation")
            w.advance()
        return
    if o.annotations.pause:
        w.hold_reason = ("Paused", f"{ANNOTATION_PAUSE} annotation is set")
        return
    _progress(w)


def _progress(w: _Work) -> None:
    o, s = w.o, w.s
    ready = o.track(s["canary_slot"]).ready
    if s["step_index"] is None and s["phase"] != "Prewarming":
        if not ready:
            s["phase"] = "Deploying"
            return
        if o.prewarm_enabled:
            s["phase"] = "Prewarming"
            w.event("Normal", "Prewarming", f"prewarming revision {s['canary_revision']}")
            return
        w.enter_step(0)
        return
    if s["phase"] == "Prewarming":
        if o.prewarm == "failed":
            w.abort("PrewarmFailed", "the prewarm Job failed")
        elif o.prewarm == "succeeded" or not o.prewarm_enabled:
            w.event("Normal", "Prewarmed", f"revision {s['canary_revision']} prewarmed")
            w.enter_step(0)
        return
    if o.verdict is None:
        return  # the step's interval is not over yet
    w.record(o.verdict)
    if o.verdict.result == "Fail":
        w.abort("AnalysisFailed", f"at {s['weight']}%: {o.verdict.message}")
    elif o.verdict.result == "NoData":
        w.hold_reason = ("AnalysisNoData", f"holding at {s['weight']}%: {o.verdict.message}")
        if s["phase"] != "Paused":
            w.event("Warning", "AnalysisNoData", w.hold_reason[1])
    else:
        w.event("Normal", "AnalysisPassed", f"at {s['weight']}%: {o.verdict.message}")
        w.advance()


def _between_rollouts(w: _Work) -> None:
    o, s = w.o, w.s
    stable = s["stable_slot"]
    if o.track(stable).undone and not _frozen(w, stable):
        w.freeze(stable)
        prev = s["previous_slot"]
        if prev is not None:
            _switch_back(w, f"Deployment of track {stable} was rolled back by hand")
        else:
            w.action("undo", stable, "kubectl rollout undo detected; template left as it is")
            w.rolled_back = (
                "RolloutUndo",
                f"Deployment of track {stable} was rolled back by hand; the operator leaves its "
                "template alone until the spec changes",
            )
            w.event("Warning", "RolloutUndo", w.rolled_back[1])
        return
    if o.annotations.abort:
        w.clear.append(ANNOTATION_ABORT)
        if s["previous_slot"] is not None:
            w.action("abort", "", "switched back to the previous track")
            _switch_back(w, f"{ANNOTATION_ABORT} annotation within the rollback window")
        else:
            w.action("abort", "", "nothing to abort")
            w.event("Normal", "AbortIgnored", "no rollout in progress and no warm previous track")
    if o.annotations.promote is not None:
        w.clear.append(ANNOTATION_PROMOTE)
        w.action("promote", o.annotations.promote, "nothing to promote")
        w.event("Normal", "PromoteIgnored", "no rollout in progress")
    if o.revision == s["stable_revision"]:
        s["rolled_back_revision"] = None
        return
    if o.revision == s["rolled_back_revision"]:
        return  # not retried until the spec changes
    _start_rollout(w, other(stable), restarted=False)


def _switch_back(w: _Work, why: str) -> None:
    s = w.s
    good = s["previous_slot"]
    bad_revision = s["stable_revision"]
    s.update(
        stable_slot=good,
        stable_revision=s["slots"][good]["revision"],
        previous_slot=None,
        retire_at=None,
        rolled_back_revision=bad_revision,
        phase="RolledBack",
    )
    text = f"revision {bad_revision} rolled back to the warm track {good}: {why}"
    w.rolled_back = ("RolledBackToPrevious", text)
    w.event("Warning", "RolledBackToPrevious", text)


def _start_rollout(w: _Work, slot: Slot, *, restarted: bool) -> None:
    s, o = w.s, w.o
    if s["previous_slot"] == slot:
        s.update(previous_slot=None, retire_at=None)
    w.set_slot(slot, o.revision, o.source)
    s.update(
        canary_slot=slot,
        canary_revision=o.revision,
        weight=0,
        step_index=None,
        step_started_at=None,
        rolled_back_revision=None,
        phase="Deploying",
    )
    w.new_rollout = True
    verb = "restarted with" if restarted else "started for"
    w.event("Normal", "RolloutStarted", f"rollout {verb} revision {o.revision} on track {slot}")


def _frozen(w: _Work, slot: str | None) -> bool:
    return bool(slot and w.s["slots"].get(slot, {}).get("frozen"))


def _finish_phase(w: _Work) -> None:
    s, o = w.s, w.o
    if w.hold_reason is not None:
        s["phase"] = "Paused"
        return
    if in_rollout(DeepSeekCacheDeploymentStatus.model_validate(s)):
        if s["phase"] == "Paused":  # data is back
            s["phase"] = "Progressing"
        return
    if s["rolled_back_revision"] is not None and o.revision == s["rolled_back_revision"]:
        s["phase"] = "RolledBack"
        return
    phase: Phase
    if o.track(s["stable_slot"]).ready:
        phase = "Available"
    elif s["phase"] in ("Pending", "Deploying"):
        phase = "Pending"
    else:
        phase = "Degraded"
    s["phase"] = phase


def _with_conditions(st: DeepSeekCacheDeploymentStatus, w: _Work) -> DeepSeekCacheDeploymentStatus:
    o, now, gen = w.o, w.now, w.o.generation
    conds = list(st.conditions)
    stable_ready = o.track(st.stable_slot).ready
    conds = set_condition(
        conds,
        "Available",
        stable_ready,
        "StableReady" if stable_ready else "StableNotReady",
        f"track {st.stable_slot} ({st.stable_revision})",
        now=now,
        generation=gen,
    )
    if w.hold_reason is not None:
        conds = set_condition(conds, "Progressing", False, *w.hold_reason, now=now, generation=gen)
    elif in_rollout(st):
        step = (
            f"step {st.step_index + 1}/{len(o.steps)} at {st.weight}%"
            if st.step_index is not None
            else st.phase
        )
        conds = set_condition(
            conds,
            "Progressing",
            True,
            st.phase,
            f"revision {st.canary_revision}: {step}",
            now=now,
            generation=gen,
        )
    else:
        conds = set_condition(
            conds,
            "Progressing",
            False,
            "NoRollout",
            "no rollout in progress",
            now=now,
            generation=gen,
        )
    degraded = st.phase == "Degraded"
    conds = set_condition(
        conds,
        "Degraded",
        degraded,
        "StableNotReady" if degraded else "AsExpected",
        "the stable track has unready pods" if degraded else "",
        now=now,
        generation=gen,
    )
    if w.rolled_back is not None:
        conds = set_condition(conds, "RolledBack", True, *w.rolled_back, now=now, generation=gen)
    elif w.new_rollout:
        conds = set_condition(
            conds,
            "RolledBack",
            False,
            "NewRollout",
            f"rolling out {st.canary_revision}",
            now=now,
            generation=gen,
        )
    elif get_condition(conds, "RolledBack") is None:
        conds = set_condition(conds, "RolledBack", False, "NoRollback", "", now=now, generation=gen)
    conds = set_condition(
        conds,
        "Ready",
        stable_ready,
        "Available" if stable_ready else "NotAvailable",
        f"phase {st.phase}",
        now=now,
        generation=gen,
    )
    return st.model_copy(update={"conditions": conds, "observed_generation": gen})


def _requeue(st: DeepSeekCacheDeploymentStatus, o: Observed, now: datetime) -> float | None:
    times: list[float] = []
    if in_rollout(st) and st.step_started_at is not None and st.phase == "Progressing":
        due = parse_time(st.step_started_at) + timedelta(seconds=o.interval_s)
        times.append(max(0.0, (due - now).total_seconds()))
    if st.retire_at is not None:
        times.append(max(0.0, (parse_time(st.retire_at) - now).total_seconds()))
    return min(times) if times else None


def slot_replicas(status: DeepSeekCacheDeploymentStatus, slot: str, replicas: int) -> int:
    """How many model pods track ``slot`` should run."""
    active = {status.stable_slot, status.canary_slot, status.previous_slot} - {None}
    return replicas if slot in active else 0
