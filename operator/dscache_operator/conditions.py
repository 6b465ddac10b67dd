"""metav1.Condition bookkeeping and timestamps (pure).

Invariant: a condition's ``lastTransitionTime`` changes only when its
``status`` changes; a new reason or message alone keeps the old time.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Literal

from dscache_operator.spec import Condition

CONDITION_TYPES = ("Ready", "Available", "Progressing", "Degraded", "RolledBack")


def rfc3339(t: datetime) -> str:
    """``2026-11-30T12:00:00Z`` (UTC, whole seconds, as Kubernetes writes times)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> datetime:
    """Inverse of :func:`rfc3339` (also accepts fractional seconds and offsets)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)


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
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type != type_:
            out.append(c)
            continue
        found = True
        when = c.last_transition_time if c.status == value else rfc3339(now)
        out.append(
            Condition(
                type=type_,
                status=value,
                reason=reason,
                message=message,
                last_transition_time=when,
                observed_generation=generation,
            )
        )
    if not found:
        out.append(
            Condition(
                type=type_,
                status=value,
                reason=reason,
                message=message,
                last_transition_time=rfc3339(now),
                observed_generation=generation,
            )
        )
    return out


def get_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of ``type_``, if set."""
    return next((c for c in conditions if c.type == type_), None)
