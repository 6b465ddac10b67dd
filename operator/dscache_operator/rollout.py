"""The rollout state machine: ``next_step(status, observed, now) -> Decision`` (pure).

Two model tracks, ``blue`` and ``green`` (Deployments ``<name>-<slot>``), take
turns: one is stable, the other receives the next revision. A rollout goes

    Deploying -> Prewarming -> Progressing(step 0 .. n-1) -> promoted (Available)

with ``weight`` = ``steps[i]`` percent of sessions on the canary during step i
(blue-green: one step of 100). Each step lasts ``interval``; then the analysis
verdict decides: Pass -> next step (after the last: promote), Fail -> abort,
NoData -> hold (phase Paused) until data comes; never promote blind. A
Pass waits (phase Paused, reason Prewarming) for the next step's prewarm Job
when progressive prewarming runs one (``Observed.prewarm`` is then that Job's
state; a failed one aborts, as before step 0). The
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
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any, Literal

from dscache_operator.conditions import rollout_conditions
from dscache_operator.rollout_types import (
    ANNOTATION_ABORT,
    ANNOTATION_PAUSE,
    ANNOTATION_PROMOTE,
    Decision,
    Event,
    Observed,
    Verdict,
)
from dscache_operator.status import (
    SLOTS,
    AnalysisResult,
    DeepSeekCacheDeploymentStatus,
    LastAction,
    Phase,
    Slot,
    SlotStatus,
    rfc3339,
)


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
    return now >= status.step_started_at + timedelta(seconds=observed.interval_s)


class _Work:
    """The scratch state of one ``next_step`` call: a private, typed copy of the status."""

    def __init__(self, status: DeepSeekCacheDeploymentStatus, observed: Observed, now: datetime):
        self.s = status.model_copy(deep=True)
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
        self.s.last_action = LastAction(type=type_, value=value, at=self.now, message=message)

    def set_slot(self, slot: Slot, revision: str, source: Mapping[str, Any]) -> None:
        self.s.slots[slot] = SlotStatus(revision=revision, source=dict(source))

    def freeze(self, slot: str) -> None:
        if slot in self.s.slots:
            self.s.slots[slot].frozen = True

    def frozen(self, slot: str | None) -> bool:
        track = self.s.slots.get(slot or "")
        return track is not None and track.frozen

    def enter_step(self, index: int) -> None:
        s = self.s
        s.step_index = index
        s.weight = self.o.steps[index]
        s.step_started_at = self.now
        s.phase = "Progressing"
        self.event(
            "Normal",
            "StepStarted",
            f"canary {s.canary_revision} at {s.weight}% of sessions "
            f"(step {index + 1}/{len(self.o.steps)})",
        )

    def end_rollout(self) -> None:
        s = self.s
        s.canary_slot = s.canary_revision = None
        s.weight = 0
        s.step_index = None
        s.step_started_at = None

    def promote(self, how: str) -> None:
        s = self.s
        old, new, revision = s.stable_slot, s.canary_slot, s.canary_revision
        self.end_rollout()
        retire_at = self.now + timedelta(seconds=self.o.rollback_window_s)
        s.stable_slot, s.stable_revision, s.previous_slot = new, revision, old
        s.retire_at = retire_at
        s.phase = "Available"
        self.event(
            "Normal",
            "Promoted",
            f"revision {revision} is stable ({how}); track {old} stays warm until "
            f"{rfc3339(retire_at)}",
        )

    def abort(self, reason: str, message: str) -> None:
        revision = self.s.canary_revision
        self.s.rolled_back_revision = revision
        self.end_rollout()
        self.s.phase = "RolledBack"
        text = f"revision {revision} rolled back, all sessions on stable: {message}"
        self.rolled_back = (reason, text)
        self.event("Warning", reason, text)

    def advance(self) -> None:
        index = self.s.step_index
        if index is None:
            self.enter_step(0)
        elif index + 1 < len(self.o.steps):
            self.enter_step(index + 1)
        else:
            self.promote("analysis passed at every step")

    def record(self, v: Verdict) -> None:
        # A verdict's fields are the analysis record's, less when and at what weight.
        self.s.last_analysis = AnalysisResult(at=self.now, weight=self.s.weight, **asdict(v))
        if v.hit_rate is not None:
            self.s.hit_rate = f"{v.hit_rate:.3f}"


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
    new = w.s
    new.conditions = rollout_conditions(
        new,
        observed,
        now,
        hold=w.hold_reason,
        rolled_back=w.rolled_back,
        new_rollout=w.new_rollout,
    )
    new.observed_generation = observed.generation
    return Decision(
        status=new,
        events=tuple(w.events),
        clear_annotations=tuple(w.clear),
        prewarm_job=_prewarm_job(status, new, observed),
    )


def prewarm_step(status: DeepSeekCacheDeploymentStatus) -> int | None:
    """The rollout step whose prewarm Job matters now: step 0 while prewarming, the
    next step during a step, None outside a rollout or during the last step."""
    if status.canary_revision is None:
        return None
    if status.step_index is None:
        return 0 if status.phase == "Prewarming" else None
    return status.step_index + 1


def _prewarm_job(
    old: DeepSeekCacheDeploymentStatus, new: DeepSeekCacheDeploymentStatus, observed: Observed
) -> int | None:
    """The step whose prewarm Job to create now: the rollout (the same canary as
    before this decision) reached a step whose Job is absent, or a new step."""
    step = prewarm_step(new)
    if step is None or not observed.prewarm_enabled:
        return None
    if new.canary_revision != old.canary_revision:
        return None  # the canary's pods are not there yet: the next tick
    if observed.prewarm == "absent" or step != prewarm_step(old):
        return step
    return None


def _first_deploy(w: _Work) -> None:
    if w.s.stable_slot is not None:
        return
    w.set_slot("blue", w.o.revision, w.o.source)
    w.s.stable_slot, w.s.stable_revision, w.s.phase = "blue", w.o.revision, "Pending"
    w.event("Normal", "Created", f"revision {w.o.revision} deployed as track blue")


def _retire(w: _Work) -> None:
    prev, at = w.s.previous_slot, w.s.retire_at
    if prev is None or at is None or w.now < at:
        return
    w.s.previous_slot = w.s.retire_at = None
    w.event("Normal", "Retired", f"track {prev} scaled down (rollback window over)")


def _during_rollout(w: _Work) -> None:
    o, s = w.o, w.s
    undone = [slot for slot in SLOTS if o.track(slot).undone and not w.frozen(slot)]
    if o.revision == s.stable_revision:
        w.end_rollout()
        w.event("Normal", "RolloutCancelled", "spec is back at the stable revision")
        return
    if o.revision != s.canary_revision:
        assert s.canary_slot is not None  # in a rollout
        _start_rollout(w, s.canary_slot, restarted=True)
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
        _promote_by_annotation(w, o.annotations.promote.strip().lower())
        return
    if o.annotations.pause:
        w.hold_reason = ("Paused", f"{ANNOTATION_PAUSE} annotation is set")
        return
    _progress(w)


def _promote_by_annotation(w: _Work, value: str) -> None:
    w.clear.append(ANNOTATION_PROMOTE)
    if value == "full":
        w.action("promote", value, "promoted fully by annotation")
        w.promote(f"{ANNOTATION_PROMOTE}=full")
    else:
        w.action("promote", value, "advanced one step by annotation")
        w.advance()


def _progress(w: _Work) -> None:
    o, s = w.o, w.s
    if s.step_index is None and s.phase != "Prewarming":
        if not o.track(s.canary_slot).ready:
            s.phase = "Deploying"
        elif o.prewarm_enabled:
            s.phase = "Prewarming"
            w.event("Normal", "Prewarming", f"prewarming revision {s.canary_revision}")
        else:
            w.enter_step(0)
        return
    if s.phase == "Prewarming":
        if o.prewarm == "failed":
            w.abort("PrewarmFailed", "the prewarm Job failed")
        elif o.prewarm == "succeeded" or not o.prewarm_enabled:
            w.event("Normal", "Prewarmed", f"revision {s.canary_revision} prewarmed")
            w.enter_step(0)
        return
    if o.verdict is not None:  # else the step's interval is not over yet
        _judge(w, o.verdict)


def _judge(w: _Work, verdict: Verdict) -> None:
    s = w.s
    w.record(verdict)
    if verdict.result == "Fail":
        w.abort("AnalysisFailed", f"at {s.weight}%: {verdict.message}")
    elif verdict.result == "NoData":
        w.hold_reason = ("AnalysisNoData", f"holding at {s.weight}%: {verdict.message}")
        if s.phase != "Paused":
            w.event("Warning", "AnalysisNoData", w.hold_reason[1])
    elif not _next_step_warm(w):
        return
    else:
        w.event("Normal", "AnalysisPassed", f"at {s.weight}%: {verdict.message}")
        w.advance()


def _next_step_warm(w: _Work) -> bool:
    """Whether the next step's prewarm Job (progressive placement) is done; holds or aborts."""
    s, o = w.s, w.o
    index = s.step_index
    if index is None or index + 1 >= len(o.steps) or not o.prewarm_enabled:
        return True
    if o.prewarm == "succeeded":
        return True
    if o.prewarm == "failed":
        w.abort("PrewarmFailed", f"the prewarm Job of step {index + 2} failed")
        return False
    w.hold_reason = (
        "Prewarming",
        f"holding at {s.weight}%: warming the canary pods of the next step ({o.steps[index + 1]}%)",
    )
    return False


def _between_rollouts(w: _Work) -> None:
    o, s = w.o, w.s
    stable = s.stable_slot
    assert stable is not None  # set by _first_deploy
    if o.track(stable).undone and not w.frozen(stable):
        _undone_stable(w, stable)
        return
    if o.annotations.abort:
        w.clear.append(ANNOTATION_ABORT)
        if s.previous_slot is not None:
            w.action("abort", "", "switched back to the previous track")
            _switch_back(w, f"{ANNOTATION_ABORT} annotation within the rollback window")
        else:
            w.action("abort", "", "nothing to abort")
            w.event("Normal", "AbortIgnored", "no rollout in progress and no warm previous track")
    if o.annotations.promote is not None:
        w.clear.append(ANNOTATION_PROMOTE)
        w.action("promote", o.annotations.promote, "nothing to promote")
        w.event("Normal", "PromoteIgnored", "no rollout in progress")
    if o.revision == s.stable_revision:
        s.rolled_back_revision = None
        return
    if o.revision == s.rolled_back_revision:
        return  # not retried until the spec changes
    _start_rollout(w, other(stable), restarted=False)


def _undone_stable(w: _Work, stable: Slot) -> None:
    w.freeze(stable)
    if w.s.previous_slot is not None:
        _switch_back(w, f"Deployment of track {stable} was rolled back by hand")
        return
    w.action("undo", stable, "kubectl rollout undo detected; template left as it is")
    w.rolled_back = (
        "RolloutUndo",
        f"Deployment of track {stable} was rolled back by hand; the operator leaves its "
        "template alone until the spec changes",
    )
    w.event("Warning", "RolloutUndo", w.rolled_back[1])


def _switch_back(w: _Work, why: str) -> None:
    s = w.s
    good = s.previous_slot
    assert good is not None  # only called with a warm previous track
    bad_revision = s.stable_revision
    s.stable_slot, s.stable_revision = good, s.slots[good].revision
    s.previous_slot = s.retire_at = None
    s.rolled_back_revision = bad_revision
    s.phase = "RolledBack"
    text = f"revision {bad_revision} rolled back to the warm track {good}: {why}"
    w.rolled_back = ("RolledBackToPrevious", text)
    w.event("Warning", "RolledBackToPrevious", text)


def _start_rollout(w: _Work, slot: Slot, *, restarted: bool) -> None:
    s, o = w.s, w.o
    if s.previous_slot == slot:
        s.previous_slot = s.retire_at = None
    w.set_slot(slot, o.revision, o.source)
    w.end_rollout()
    s.canary_slot, s.canary_revision = slot, o.revision
    s.rolled_back_revision = None
    s.phase = "Deploying"
    w.new_rollout = True
    verb = "restarted with" if restarted else "started for"
    w.event("Normal", "RolloutStarted", f"rollout {verb} revision {o.revision} on track {slot}")


def _finish_phase(w: _Work) -> None:
    s, o = w.s, w.o
    if w.hold_reason is not None:
        s.phase = "Paused"
        return
    if in_rollout(s):
        if s.phase == "Paused":  # data is back
            s.phase = "Progressing"
        return
    if s.rolled_back_revision is not None and o.revision == s.rolled_back_revision:
        s.phase = "RolledBack"
        return
    phase: Phase
    if o.track(s.stable_slot).ready:
        phase = "Available"
    elif s.phase in ("Pending", "Deploying"):
        phase = "Pending"
    else:
        phase = "Degraded"
    s.phase = phase


def slot_replicas(status: DeepSeekCacheDeploymentStatus, slot: str, replicas: int) -> int:
    """How many model pods track ``slot`` should run."""
    active = {status.stable_slot, status.canary_slot, status.previous_slot} - {None}
    return replicas if slot in active else 0
