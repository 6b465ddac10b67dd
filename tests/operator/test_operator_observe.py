"""Reading the cluster's objects into observations (pure helpers of the reconciler)."""

from __future__ import annotations

from typing import Any

import pytest
from dscache_operator.desired import TEMPLATE_HASH
from dscache_operator.reconcile import observe_job, observe_router, observe_track, ready_pod_ips
from dscache_operator.rollout_types import TrackObservation


def deployment(
    *,
    replicas: int = 2,
    ready: int = 2,
    updated: int = 2,
    total: int = 2,
    stale: bool = False,
    applied: str = "h1",
    running: str = "h1",
) -> dict[str, Any]:
    return {
        "metadata": {"generation": 3, "labels": {TEMPLATE_HASH: applied}},
        "spec": {
            "replicas": replicas,
            "template": {"metadata": {"annotations": {TEMPLATE_HASH: running}}},
        },
        "status": {
            "observedGeneration": 2 if stale else 3,
            "replicas": total,
            "updatedReplicas": updated,
            "availableReplicas": ready,
        },
    }


@pytest.mark.parametrize(
    ("dep", "expected"),
    [
        (None, TrackObservation()),
        (deployment(), TrackObservation(exists=True, ready=True)),
        (deployment(ready=1), TrackObservation(exists=True, ready=False)),
        (deployment(updated=1, total=3), TrackObservation(exists=True, ready=False)),
        (deployment(stale=True), TrackObservation(exists=True, ready=False)),
        (deployment(replicas=0, ready=0, updated=0, total=0), TrackObservation(True, True)),
        (deployment(running="h0"), TrackObservation(exists=True, ready=True, undone=True)),
    ],
)
def test_observe_track(dep: dict[str, Any] | None, expected: TrackObservation) -> None:
    assert observe_track(dep) == expected


@pytest.mark.parametrize(
    ("dep", "answers"),
    [
        (None, False),
        (deployment(), True),
        # One available router pod answers clients, even mid-rollout of its config.
        (deployment(ready=1, updated=1, total=3), True),
        (deployment(ready=0), False),
        ({"metadata": {}, "spec": {}}, False),  # just created: no status yet
    ],
)
def test_observe_router(dep: dict[str, Any] | None, answers: bool) -> None:
    assert observe_router(dep) is answers


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ({}, "running"),
        ({"active": 1}, "running"),
        ({"succeeded": 1}, "succeeded"),
        ({"conditions": [{"type": "Failed", "status": "True"}]}, "failed"),
        ({"conditions": [{"type": "Complete", "status": "True"}]}, "succeeded"),
    ],
)
def test_observe_job(status: dict[str, Any], state: str) -> None:
    assert observe_job({"status": status}) == state
    assert observe_job(None) == "absent"


def test_only_ready_pods_are_routed_in_name_order() -> None:
    def pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name}
        if deleting:
            meta["deletionTimestamp"] = "2026-11-30T12:00:00Z"
        return {
            "metadata": meta,
            "status": {
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    pods = [
        pod("b", "10.0.0.2", True),
        pod("a", "10.0.0.1", True),
        pod("c", "10.0.0.3", False),
        pod("d", None, True),
        pod("e", "10.0.0.5", True, deleting=True),
    ]
    assert ready_pod_ips(pods) == ["10.0.0.1", "10.0.0.2"]
