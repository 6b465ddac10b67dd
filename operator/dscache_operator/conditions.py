"""metav1.Condition bookkeeping, and the conditions a rollout decision sets (pure).

Invariant: a condition's ``lastTransitionTime`` changes only when its
``status`` changes; a new reason or message alone keeps the old time.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from dscache_operator.rollout_types import Observed
from dscache_operator.status import Condition, DeepSeekCacheDeploymentStatus

CONDITION_TYPES = ("Ready", "Available", "Progressing", "Degraded", "RolledBack")


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """``conditions`` with ``type_`` set; other types untouched, order kept."""
    value: Literal["True", "False"] = "True" if status else "False"
    old = get_condition(conditions, type_)
    new = Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=old.last_transition_time if old and old.status == value else now,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def get_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of ``type_``, if set."""
    return next((c for c in conditions if c.type == type_), None)


def rollout_conditions(
    st: DeepSeekCacheDeploymentStatus,
    observed: Observed,
    now: datetime,
    *,
    hold: tuple[str, str] | None,
    rolled_back: tuple[str, str] | None,
    new_rollout: bool,
) -> list[Condition]:
    """The five condition types for the status the rollout machine just decided.

    Args:
        st: the new status (phase, tracks and step already set).
        observed: what the machine saw (track readiness, steps, generation).
        now: the decision's time (a transition's ``lastTransitionTime``).
        hold: ``(reason, message)`` when the rollout is held (pause, no data).
        rolled_back: ``(reason, message)`` when this decision rolled back.
        new_rollout: this decision started a rollout.
    """
    stable_ready = observed.track(st.stable_slot).ready
    # Available: clients get answers from the stable revision, which needs its track
    # and a router pod in front of it.
    available = stable_ready and observed.router_ready
    track = f"track {st.stable_slot} ({st.stable_revision})"
    if not stable_ready:
        available_reason, available_message = "StableNotReady", track
    elif not observed.router_ready:
        available_reason = "RouterNotReady"
        available_message = f"{track} is ready; no router pod is available"
    else:
        available_reason, available_message = "StableReady", f"{track} and the router"
    degraded = st.phase == "Degraded"
    wanted: list[tuple[str, bool, str, str]] = [
        ("Available", available, available_reason, available_message),
        ("Progressing", *_progressing(st, observed, hold)),
        (
            "Degraded",
            degraded,
            "StableNotReady" if degraded else "AsExpected",
            "the stable track has unready pods" if degraded else "",
        ),
    ]
    if rolled_back is not None:
        wanted.append(("RolledBack", True, *rolled_back))
    elif new_rollout:
        wanted.append(("RolledBack", False, "NewRollout", f"rolling out {st.canary_revision}"))
    elif get_condition(st.conditions, "RolledBack") is None:
        wanted.append(("RolledBack", False, "NoRollback", ""))
    wanted.append(
        (
            "Ready",
            available,
            "Available" if available else "NotAvailable",
            f"phase {st.phase}",
        )
    )
    conds = list(st.conditions)
    for type_, value, reason, message in wanted:
        conds = set_condition(
            conds, type_, value, reason, message, now=now, generation=observed.generation
        )
    return conds


def _progressing(
    st: DeepSeekCacheDeploymentStatus, observed: Observed, hold: tuple[str, str] | None
) -> tuple[bool, str, str]:
    if hold is not None:
        return (False, *hold)
    if st.canary_slot is None or st.canary_revision is None:
        return False, "NoRollout", "no rollout in progress"
    step = (
        f"step {st.step_index + 1}/{len(observed.steps)} at {st.weight}%"
        if st.step_index is not None
        else st.phase
    )
    return True, st.phase, f"revision {st.canary_revision}: {step}"
