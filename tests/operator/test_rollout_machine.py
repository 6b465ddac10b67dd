"""Table tests of the rollout state machine: every transition of ``next_step``.

Each case starts from a status reached through the machine itself (never a
hand-built one where a real path exists), applies one observation, and checks
what a user would see: phase, weight, tracks, conditions, events, and which
annotations get cleared.

Longer than ~400 lines on purpose: it is one table, a case per transition of
the machine, and a reader checks coverage by reading it top to bottom.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from dscache_operator.conditions import get_condition
from dscache_operator.rollout import analysis_due, next_step, slot_replicas
from dscache_operator.rollout_types import (
    ANNOTATION_ABORT,
    ANNOTATION_PROMOTE,
    Annotations,
    Decision,
    Observed,
    TrackObservation,
    Verdict,
)
from dscache_operator.status import DeepSeekCacheDeploymentStatus, dump_status, parse_status
from hypothesis import given, settings
from hypothesis import strategies as st

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
REV_A, REV_B, REV_C = "aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"
READY = TrackObservation(exists=True, ready=True)
NOT_READY = TrackObservation(exists=True, ready=False)
PASS = Verdict(
    "Pass",
    "ok",
    hit_rate=0.93,
    stable_hit_rate=0.95,
    ttft_p99_seconds=0.2,
    stable_ttft_p99_seconds=0.25,
)
FAIL = Verdict(
    "Fail",
    "hit rate 0.40; stable 0.900 x 0.95 = 0.855: hit rate below stable's 0.900 x 0.95",
    hit_rate=0.4,
    stable_hit_rate=0.9,
    ttft_p99_seconds=0.2,
)
NODATA = Verdict("NoData", "no canary data for hit rate")


def obs(revision: str = REV_A, **kw: Any) -> Observed:
    base: dict[str, Any] = {
        "generation": 1,
        "revision": revision,
        "source": {"model": {"preset": revision}},
        "steps": (10, 25, 50, 100),
        "interval_s": 60.0,
        "rollback_window_s": 600.0,
        "prewarm_enabled": True,
        # The prewarm Job the next step needs, done (or none needed); tests of the
        # prewarm wait say otherwise.
        "prewarm": "succeeded",
        "tracks": {"blue": READY, "green": READY},
    }
    base.update(kw)
    return Observed(**base)


def run(status: DeepSeekCacheDeploymentStatus, o: Observed, t: datetime = T0) -> Decision:
    # Every decision goes through the wire form, as it does via the API server.
    d = next_step(status, o, t)
    return replace(d, status=parse_status(dump_status(d.status)))


def reasons(d: Decision) -> list[str]:
    return [e.reason for e in d.events]


def cond(d: Decision, type_: str) -> tuple[str, str]:
    c = get_condition(d.status.conditions, type_)
    assert c is not None
    return c.status, c.reason


@pytest.fixture
def available() -> DeepSeekCacheDeploymentStatus:
    """Revision A stable on blue and Available."""
    d = run(DeepSeekCacheDeploymentStatus(), obs(tracks={}))
    return run(d.status, obs()).status


def rollout_at(
    available: DeepSeekCacheDeploymentStatus, step: int, **kw: Any
) -> tuple[DeepSeekCacheDeploymentStatus, datetime]:
    """Revision B at step ``step`` (weight steps[step]), started at the returned time."""
    s = run(available, obs(REV_B, **kw)).status  # Deploying
    s = run(s, obs(REV_B, prewarm_enabled=False, **kw)).status  # step 0
    t = T0
    for _ in range(step):
        t += timedelta(seconds=61)
        s = run(s, obs(REV_B, verdict=PASS, **kw), t).status
    return s, t


# ----------------------------------------------------------------------------- first deploy


def test_first_deploy_creates_blue_and_waits_for_it() -> None:
    d = run(DeepSeekCacheDeploymentStatus(), obs(tracks={}))
    s = d.status
    assert (s.stable_slot, s.stable_revision, s.phase, s.weight) == ("blue", REV_A, "Pending", 0)
    assert reasons(d) == ["Created"]
    assert cond(d, "Available") == ("False", "StableNotReady")
    assert cond(d, "Ready") == ("False", "NotAvailable")
    assert s.observed_generation == 1

    d2 = run(s, obs(tracks={"blue": READY}))
    assert d2.status.phase == "Available" and reasons(d2) == []
    assert cond(d2, "Available") == ("True", "StableReady")
    assert cond(d2, "Progressing") == ("False", "NoRollout")
    assert cond(d2, "RolledBack") == ("False", "NoRollback")


def test_steady_state_is_a_fixed_point(available: DeepSeekCacheDeploymentStatus) -> None:
    d = run(available, obs(), T0 + timedelta(hours=1))
    assert d.status == available and d.events == () and d.clear_annotations == ()


def test_stable_losing_pods_is_degraded(available: DeepSeekCacheDeploymentStatus) -> None:
    d = run(available, obs(tracks={"blue": NOT_READY}))
    assert d.status.phase == "Degraded"
    assert cond(d, "Degraded") == ("True", "StableNotReady")
    assert cond(d, "Available") == ("False", "StableNotReady")


def test_available_needs_a_router_pod_as_well_as_the_stable_track(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    # `kubectl wait --for=condition=Available` means clients get answers: with the
    # model pods ready but no router pod, they would not.
    d = run(available, obs(router_ready=False))
    assert cond(d, "Available") == ("False", "RouterNotReady")
    assert cond(d, "Ready") == ("False", "NotAvailable")
    # The rollout itself is not the router's business: the phase and tracks hold.
    assert d.status.phase == "Available" and d.status.stable_slot == available.stable_slot
    back = run(d.status, obs())
    assert cond(back, "Available") == ("True", "StableReady")
    assert cond(back, "Ready") == ("True", "Available")
    # An unready stable track is named first: it is what a router could not fix.
    both = run(available, obs(tracks={"blue": NOT_READY}, router_ready=False))
    assert cond(both, "Available") == ("False", "StableNotReady")


def test_last_transition_time_moves_only_on_real_transitions(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    before = get_condition(available.conditions, "Available")
    later = run(available, obs(), T0 + timedelta(minutes=5)).status
    assert get_condition(later.conditions, "Available") == before
    t1 = T0 + timedelta(minutes=7)
    degraded = run(later, obs(tracks={"blue": NOT_READY}), t1).status
    c = get_condition(degraded.conditions, "Available")
    assert c is not None and c.last_transition_time == datetime(2026, 11, 30, 12, 7, tzinfo=UTC)


# ----------------------------------------------------------------------------- ramp


def test_new_revision_starts_a_rollout_on_the_other_track(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    d = run(available, obs(REV_B, tracks={"blue": READY}))
    s = d.status
    assert (s.canary_slot, s.canary_revision, s.weight, s.phase) == ("green", REV_B, 0, "Deploying")
    assert s.stable_slot == "blue" and s.slots["blue"].revision == REV_A
    assert s.slots["green"].revision == REV_B
    assert reasons(d) == ["RolloutStarted"]
    assert cond(d, "Progressing") == ("True", "Deploying")
    assert cond(d, "RolledBack") == ("False", "NewRollout")
    assert slot_replicas(s, "green", 3) == 3


@pytest.mark.parametrize(
    ("canary", "prewarm_enabled", "prewarm", "phase", "weight", "events"),
    [
        (NOT_READY, True, "absent", "Deploying", 0, []),
        (READY, True, "absent", "Prewarming", 0, ["Prewarming"]),
        (READY, False, "absent", "Progressing", 10, ["StepStarted"]),
    ],
)
def test_deploying(
    available: DeepSeekCacheDeploymentStatus,
    canary: TrackObservation,
    prewarm_enabled: bool,
    prewarm: str,
    phase: str,
    weight: int,
    events: list[str],
) -> None:
    s = run(available, obs(REV_B)).status
    o = obs(REV_B, tracks={"blue": READY, "green": canary}, prewarm_enabled=prewarm_enabled)
    d = run(s, replace(o, prewarm=prewarm))
    assert (d.status.phase, d.status.weight, reasons(d)) == (phase, weight, events)


@pytest.mark.parametrize(
    ("job", "phase", "weight", "events", "create"),
    [
        ("absent", "Prewarming", 0, [], 0),  # the first step's Job: create it
        ("running", "Prewarming", 0, [], None),
        ("succeeded", "Progressing", 10, ["Prewarmed", "StepStarted"], 1),  # the next one's
        ("failed", "RolledBack", 0, ["PrewarmFailed"], None),
    ],
)
def test_prewarming(
    available: DeepSeekCacheDeploymentStatus,
    job: str,
    phase: str,
    weight: int,
    events: list[str],
    create: int | None,
) -> None:
    d = run(available, obs(REV_B))
    assert d.prewarm_job is None  # the canary's pods are only being created
    s = run(d.status, obs(REV_B)).status
    assert s.phase == "Prewarming"
    d = run(s, obs(REV_B, prewarm=job))
    assert (d.status.phase, d.status.weight, reasons(d)) == (phase, weight, events)
    assert d.prewarm_job == create
    # Prewarm off: no Job, whatever the state.
    assert run(s, obs(REV_B, prewarm=job, prewarm_enabled=False)).prewarm_job is None


@pytest.mark.parametrize(
    ("job", "phase", "weight", "events", "reason"),
    [
        ("absent", "Paused", 10, [], "Prewarming"),
        ("running", "Paused", 10, [], "Prewarming"),
        ("succeeded", "Progressing", 25, ["AnalysisPassed", "StepStarted"], None),
        ("failed", "RolledBack", 0, ["PrewarmFailed"], None),
    ],
)
def test_a_passed_step_waits_for_the_next_steps_prewarm(
    available: DeepSeekCacheDeploymentStatus,
    job: str,
    phase: str,
    weight: int,
    events: list[str],
    reason: str | None,
) -> None:
    s, t = rollout_at(available, 0)
    d = run(s, obs(REV_B, verdict=PASS, prewarm=job), t + timedelta(seconds=61))
    assert (d.status.phase, d.status.weight, reasons(d)) == (phase, weight, events)
    # The step's Job is created while it is absent, and the next step's once it starts.
    assert d.prewarm_job == {"absent": 1, "running": None, "succeeded": 2, "failed": None}[job]
    if reason is not None:
        assert cond(d, "Progressing")[1] == reason
        # The Job done, the next analysis moves on.
        later = run(d.status, obs(REV_B, verdict=PASS), t + timedelta(seconds=70))
        assert (later.status.phase, later.status.weight) == ("Progressing", 25)


def test_a_step_waits_for_its_interval(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 0)
    assert not analysis_due(s, obs(REV_B), t + timedelta(seconds=59))
    assert analysis_due(s, obs(REV_B), t + timedelta(seconds=60))
    assert not analysis_due(s, obs(REV_B, annotations=Annotations(pause=True)), t + timedelta(1))
    d = run(s, obs(REV_B), t + timedelta(seconds=30))
    assert d.status == s and d.events == ()


def test_good_figures_promote_through_every_step(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 0)
    weights = [s.weight]
    for _ in range(3):
        t += timedelta(seconds=61)
        d = run(s, obs(REV_B, verdict=PASS), t)
        s = d.status
        weights.append(s.weight)
        assert reasons(d) == ["AnalysisPassed", "StepStarted"]
        assert s.last_analysis is not None and s.last_analysis.result == "Pass"
        assert s.hit_rate == "0.930"
        # What the canary was compared with is on record, on the wire too.
        assert s.last_analysis.stable_hit_rate == 0.95
        assert dump_status(s)["lastAnalysis"]["stableHitRate"] == 0.95
    assert weights == [10, 25, 50, 100]
    t += timedelta(seconds=61)
    d = run(s, obs(REV_B, verdict=PASS), t)
    s = d.status
    assert reasons(d) == ["AnalysisPassed", "Promoted"]
    assert (s.stable_slot, s.stable_revision, s.canary_slot, s.weight) == ("green", REV_B, None, 0)
    assert (s.previous_slot, s.phase) == ("blue", "Available")
    assert s.retire_at == datetime(2026, 11, 30, 12, 14, 4, tzinfo=UTC)  # t + rollbackWindow
    assert dump_status(s)["retireAt"] == "2026-11-30T12:14:04Z"  # as Kubernetes writes times
    assert slot_replicas(s, "blue", 2) == 2  # kept warm
    assert cond(d, "Progressing") == ("False", "NoRollout")


def test_bad_hit_rate_rolls_back_at_once(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 1)
    assert s.weight == 25
    d = run(s, obs(REV_B, verdict=FAIL), t + timedelta(seconds=61))
    s = d.status
    assert (s.weight, s.phase, s.canary_slot, s.rolled_back_revision) == (
        0,
        "RolledBack",
        None,
        REV_B,
    )
    assert reasons(d) == ["AnalysisFailed"]
    assert cond(d, "RolledBack") == ("True", "AnalysisFailed")
    c = get_condition(s.conditions, "RolledBack")
    assert c is not None and "hit rate 0.40" in c.message and "25%" in c.message
    assert s.last_analysis is not None and s.last_analysis.hit_rate == 0.4
    assert s.last_analysis.stable_hit_rate == 0.9
    assert slot_replicas(s, "green", 2) == 0
    # Not retried while the spec still asks for the rolled-back revision.
    again = run(s, obs(REV_B), t + timedelta(hours=1))
    assert again.status.phase == "RolledBack" and again.status.canary_slot is None
    assert again.events == ()


def test_no_data_holds_and_resumes(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 2)
    d = run(s, obs(REV_B, verdict=NODATA), t + timedelta(seconds=61))
    assert (d.status.phase, d.status.weight) == ("Paused", 50)
    assert cond(d, "Progressing") == ("False", "AnalysisNoData")
    assert reasons(d) == ["AnalysisNoData"]
    d2 = run(d.status, obs(REV_B, verdict=NODATA), t + timedelta(seconds=90))
    assert d2.status.weight == 50 and d2.events == ()  # warned once
    d3 = run(d2.status, obs(REV_B, verdict=PASS), t + timedelta(seconds=120))
    assert (d3.status.phase, d3.status.weight) == ("Progressing", 100)


def test_blue_green_switches_everything_then_promotes(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    s, t = rollout_at(available, 0, steps=(100,))
    assert s.weight == 100 and s.canary_slot == "green"
    d = run(s, obs(REV_B, steps=(100,), verdict=PASS), t + timedelta(seconds=61))
    assert d.status.stable_slot == "green" and d.status.previous_slot == "blue"


def test_blue_green_failure_switches_back(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 0, steps=(100,))
    d = run(s, obs(REV_B, steps=(100,), verdict=FAIL), t + timedelta(seconds=61))
    assert (d.status.weight, d.status.stable_slot, d.status.phase) == (0, "blue", "RolledBack")


# ----------------------------------------------------------------------------- annotations


def test_pause_holds_the_weight(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 1)
    paused = obs(REV_B, annotations=Annotations(pause=True))
    d = run(s, paused, t + timedelta(hours=1))
    assert (d.status.phase, d.status.weight) == ("Paused", 25)
    assert cond(d, "Progressing") == ("False", "Paused")
    assert d.clear_annotations == ()  # pause is a level, not a one-shot
    d2 = run(d.status, obs(REV_B, verdict=PASS), t + timedelta(hours=1, seconds=1))
    assert (d2.status.phase, d2.status.weight) == ("Progressing", 50)


@pytest.mark.parametrize(
    ("value", "weight", "stable"), [("", 25, "blue"), ("next", 25, "blue"), ("full", 0, "green")]
)
def test_promote_annotation(
    available: DeepSeekCacheDeploymentStatus, value: str, weight: int, stable: str
) -> None:
    s, t = rollout_at(available, 0)
    d = run(s, obs(REV_B, annotations=Annotations(promote=value)), t + timedelta(seconds=1))
    assert (d.status.weight, d.status.stable_slot) == (weight, stable)
    assert d.clear_annotations == (ANNOTATION_PROMOTE,)
    assert d.status.last_action is not None and d.status.last_action.type == "promote"


def test_promote_skips_the_prewarm_wait(available: DeepSeekCacheDeploymentStatus) -> None:
    s = run(run(available, obs(REV_B)).status, obs(REV_B)).status
    assert s.phase == "Prewarming"
    d = run(s, obs(REV_B, prewarm="running", annotations=Annotations(promote="")))
    assert (d.status.phase, d.status.weight) == ("Progressing", 10)


def test_abort_annotation_during_a_rollout(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 2)
    d = run(s, obs(REV_B, annotations=Annotations(abort=True)), t)
    assert (d.status.weight, d.status.phase) == (0, "RolledBack")
    assert cond(d, "RolledBack") == ("True", "Aborted")
    assert d.clear_annotations == (ANNOTATION_ABORT,)


def test_abort_in_the_rollback_window_switches_back(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    s = run(available, obs(REV_B)).status
    s = run(s, obs(REV_B, annotations=Annotations(promote="full"))).status
    assert s.stable_slot == "green" and s.previous_slot == "blue"
    d = run(s, obs(REV_B, annotations=Annotations(abort=True)), T0 + timedelta(minutes=1))
    s2 = d.status
    assert (s2.stable_slot, s2.stable_revision, s2.previous_slot) == ("blue", REV_A, None)
    assert (s2.phase, s2.rolled_back_revision) == ("RolledBack", REV_B)
    assert cond(d, "RolledBack") == ("True", "RolledBackToPrevious")
    assert slot_replicas(s2, "green", 2) == 0


def test_abort_and_promote_with_nothing_to_do(available: DeepSeekCacheDeploymentStatus) -> None:
    d = run(available, obs(annotations=Annotations(abort=True, promote="full")))
    assert reasons(d) == ["AbortIgnored", "PromoteIgnored"]
    assert set(d.clear_annotations) == {ANNOTATION_ABORT, ANNOTATION_PROMOTE}
    assert d.status.phase == "Available"


def test_annotation_values() -> None:
    a = Annotations.from_metadata(
        {"dscache.io/pause": "", "dscache.io/abort": "false", "dscache.io/promote": "full"}
    )
    assert a == Annotations(promote="full", pause=True, abort=False)
    assert Annotations.from_metadata(None) == Annotations()


# ----------------------------------------------------------------------------- undo, spec changes


def test_rollout_undo_of_the_canary_aborts_and_freezes(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    s, t = rollout_at(available, 1)
    undone = TrackObservation(exists=True, ready=True, undone=True)
    d = run(s, obs(REV_B, tracks={"blue": READY, "green": undone}), t)
    s2 = d.status
    assert (s2.weight, s2.phase, s2.slots["green"].frozen) == (0, "RolledBack", True)
    assert cond(d, "RolledBack") == ("True", "RolloutUndo")
    assert s2.last_action is not None and s2.last_action.type == "undo"
    # Recorded once; the frozen track is not fought on later ticks.
    d2 = run(s2, obs(REV_B, tracks={"blue": READY, "green": undone}), t + timedelta(minutes=5))
    assert d2.events == () and d2.status.slots["green"].frozen
    # A spec change gives the track a new revision and unfreezes it.
    d3 = run(d2.status, obs(REV_C, generation=2))
    assert d3.status.canary_slot == "green" and not d3.status.slots["green"].frozen
    assert d3.status.canary_revision == REV_C


def test_rollout_undo_of_the_stable_track_is_recorded(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    undone = TrackObservation(exists=True, ready=True, undone=True)
    d = run(available, obs(tracks={"blue": undone}))
    assert d.status.slots["blue"].frozen and reasons(d) == ["RolloutUndo"]
    assert cond(d, "RolledBack") == ("True", "RolloutUndo")
    assert run(d.status, obs(tracks={"blue": undone})).events == ()


def test_rollout_undo_after_promotion_returns_to_the_warm_track(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    s = run(available, obs(REV_B)).status
    s = run(s, obs(REV_B, annotations=Annotations(promote="full"))).status
    undone = TrackObservation(exists=True, ready=True, undone=True)
    d = run(s, obs(REV_B, tracks={"blue": READY, "green": undone}))
    assert (d.status.stable_slot, d.status.stable_revision) == ("blue", REV_A)
    assert d.status.slots["green"].frozen


def test_spec_change_mid_rollout_restarts_it(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 2)
    d = run(s, obs(REV_C, generation=2), t)
    s2 = d.status
    assert (s2.canary_revision, s2.canary_slot, s2.weight, s2.phase) == (
        REV_C,
        "green",
        0,
        "Deploying",
    )
    assert s2.step_index is None and reasons(d) == ["RolloutStarted"]


def test_spec_back_to_stable_cancels(available: DeepSeekCacheDeploymentStatus) -> None:
    s, t = rollout_at(available, 1)
    d = run(s, obs(REV_A, generation=3), t)
    assert (d.status.canary_slot, d.status.weight, d.status.phase) == (None, 0, "Available")
    assert reasons(d) == ["RolloutCancelled"]
    assert slot_replicas(d.status, "green", 2) == 0


def test_spec_back_to_stable_after_rollback_clears_it(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    s, t = rollout_at(available, 1)
    s = run(s, obs(REV_B, verdict=FAIL), t + timedelta(seconds=61)).status
    d = run(s, obs(REV_A, generation=2))
    assert d.status.phase == "Available" and d.status.rolled_back_revision is None


def test_old_track_retires_after_the_window(available: DeepSeekCacheDeploymentStatus) -> None:
    s = run(available, obs(REV_B)).status
    s = run(s, obs(REV_B, annotations=Annotations(promote="full"))).status
    assert run(s, obs(REV_B), T0 + timedelta(seconds=599)).status.previous_slot == "blue"
    d = run(s, obs(REV_B), T0 + timedelta(seconds=600))
    assert d.status.previous_slot is None and reasons(d) == ["Retired"]
    assert slot_replicas(d.status, "blue", 2) == 0


def test_next_rollout_reuses_the_retired_track(available: DeepSeekCacheDeploymentStatus) -> None:
    s = run(available, obs(REV_B)).status
    s = run(s, obs(REV_B, annotations=Annotations(promote="full"))).status
    d = run(s, obs(REV_C, generation=2))  # still inside the window: the warm track is reused
    assert (d.status.canary_slot, d.status.previous_slot) == ("blue", None)
    assert d.status.slots["blue"].revision == REV_C


# ----------------------------------------------------------------------------- restart


def test_restart_mid_ramp_resumes_without_repeating_or_skipping(
    available: DeepSeekCacheDeploymentStatus,
) -> None:
    s, t = rollout_at(available, 1)
    # A restarted operator only has the status as stored (JSON) and a fresh clock.
    stored = parse_status(dump_status(s))
    early = run(stored, obs(REV_B), t + timedelta(seconds=10))
    assert early.status.weight == 25 and early.events == ()
    late = run(stored, obs(REV_B, verdict=PASS), t + timedelta(seconds=61))
    assert late.status.weight == 50 and reasons(late) == ["AnalysisPassed", "StepStarted"]


_verdicts = st.sampled_from([None, PASS, FAIL, NODATA])
_annotations = st.sampled_from(
    [Annotations(), Annotations(pause=True), Annotations(promote=""), Annotations(abort=True)]
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(_verdicts, _annotations, st.booleans(), st.sampled_from([REV_A, REV_B, REV_C])),
        max_size=25,
    )
)
@pytest.mark.slow
def test_weight_rises_only_on_pass_or_promote(
    steps: list[tuple[Verdict | None, Annotations, bool, str]],
) -> None:
    s = run(DeepSeekCacheDeploymentStatus(), obs()).status
    t = T0
    for verdict, ann, ready, revision in steps:
        t += timedelta(seconds=61)
        o = obs(
            revision,
            verdict=verdict if analysis_due(s, obs(revision, annotations=ann), t) else None,
            annotations=ann,
            tracks={"blue": READY, "green": READY if ready else NOT_READY},
            prewarm="succeeded",
        )
        d = run(s, o, t)
        new = d.status
        assert new.weight in (0, *o.steps)
        if new.weight > s.weight and new.canary_revision == s.canary_revision:
            assert o.verdict in (PASS,) or ann.promote is not None or s.weight == 0
        if "AnalysisFailed" in reasons(d) or "Aborted" in reasons(d):
            assert new.weight == 0 and new.canary_slot is None
        if new.canary_slot is not None:
            assert new.canary_slot != new.stable_slot
        assert new.stable_slot is not None and new.stable_slot in new.slots
        s = new
