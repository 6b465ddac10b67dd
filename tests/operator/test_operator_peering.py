"""Two operator replicas on a real control plane: kopf peering lets exactly one act.

What an SRE running the chart's two replicas relies on: while both run, only
one reconciles (the standby's ``dscache_operator_reconciles_total`` stays at
zero); when the active one dies without a word (``kill -9``), the standby
takes over once the dead one's peering record goes stale, and a rollout in
flight continues from where it was, no step repeated or skipped.

Its own module: the other modules' standalone operator (which ignores peering)
must not run at the same time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from dscache_tools.devcluster import DevCluster, wait_until
from fakes.server_metrics import FakeServerMetrics
from operator_harness import (
    OperatorProcess,
    PrometheusProcess,
    apply,
    available,
    events,
    spec_doc,
    start_rollout,
    status,
    wait_for,
)

pytestmark = pytest.mark.cluster

LIFETIME_S = 6


def _peers(c: DevCluster, name: str) -> dict[str, Any]:
    done = c.kubectl("get", "clusterkopfpeering", name, "-o", "json", check=False)
    if done.returncode != 0:
        return {}
    out: dict[str, Any] = yaml.safe_load(done.stdout).get("status") or {}
    return out


def test_one_replica_acts_and_a_standby_takes_over_after_kill_9(
    dev_cluster: DevCluster,
    chart: str,
    prometheus: PrometheusProcess,
    server_metrics: FakeServerMetrics,
    ns: str,
    tmp_path: Path,
) -> None:
    c = dev_cluster
    peering = f"peering-test-{os.getpid()}"
    doc = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}}
    c.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    env = {"DSCACHE_OPERATOR_PEERING_LIFETIME_SECONDS": str(LIFETIME_S)}

    def replica(name: str) -> OperatorProcess:
        return OperatorProcess(
            c, tmp_path, prometheus.url, name=name, peering=peering, metrics=True, env=env
        )

    a = replica("a")
    b: OperatorProcess | None = None
    try:
        started_a = time.time()
        wait_until("replica a in the peering", lambda: len(_peers(c, peering)) == 1, 60)
        # The older replica has the higher priority; start b in a later second.
        time.sleep(max(0.0, started_a + 1.1 - time.time()))
        b = replica("b")
        wait_until("both replicas in the peering", lambda: len(_peers(c, peering)) == 2, 60)

        name = "peered"
        apply(c, ns, [spec_doc(name, prometheus, interval="4s")])
        available(c, ns, name, a)
        time.sleep(3)  # three ticks of a
        assert a.reconciles() > 0
        assert b.reconciles() == 0, b.tail()  # exactly one acts
        # kopf starts a peered replica paused; only the active one resumed.
        assert "Resuming operations" in a.tail() and "Resuming operations" not in b.tail()

        _, canary = start_rollout(c, ns, name, a, server_metrics, "2")
        wait_for(c, ns, name, "weight 25", lambda s: s.get("weight") == 25, a)
        a.kill()  # SIGKILL: no goodbye in the peering object
        killed = time.monotonic()
        wait_until("b takes over", lambda: b.reconciles() > 0, LIFETIME_S + 30)
        took = time.monotonic() - killed
        # a's record goes stale LIFETIME_S after its last keep-alive (sent every second).
        assert took <= LIFETIME_S + 10, (took, b.tail())
        assert "Resuming operations after the pause" in b.tail()

        seen: list[int] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            st = status(c, ns, name)
            if not seen or seen[-1] != st["weight"]:
                seen.append(st["weight"])
            if st.get("stableRevision") == canary and st["phase"] == "Available":
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"no promotion after the takeover: {seen}\n{b.tail()}")
        assert seen[0] in (25, 50) and seen[-1] == 0, seen  # 0: promoted
        assert events(c, ns, name).count("StepStarted") == 4  # no step repeated or skipped
        # The dead replica's record was cleaned out; b's is the one left.
        wait_until("a's stale record cleaned", lambda: len(_peers(c, peering)) == 1, 30)
    finally:
        a.stop()
        if b is not None:
            b.stop()
        c.kubectl("delete", "clusterkopfpeering", peering, "--wait=false", check=False)


def test_a_replica_without_its_peering_object_says_so_and_waits_for_it(
    dev_cluster: DevCluster,
    chart: str,
    prometheus: PrometheusProcess,
    ns: str,
    tmp_path: Path,
) -> None:
    c = dev_cluster
    peering = f"peering-late-{os.getpid()}"
    op = OperatorProcess(c, tmp_path, prometheus.url, name="late", peering=peering, metrics=True)
    try:
        wait_until(
            "a warning naming the missing object",
            lambda: f"no ClusterKopfPeering {peering!r}" in op.tail(),
            30,
        )
        apply(c, ns, [spec_doc("late", prometheus)])
        time.sleep(3)  # three ticks, were it acting
        assert op.reconciles() == 0  # paused: never acts without its peers' agreement
        doc = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": peering},
        }
        c.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
        wait_until("acting once the object exists", lambda: op.reconciles() > 0, 30)
        available(c, ns, "late", op)
    finally:
        op.stop()
        c.kubectl("delete", "clusterkopfpeering", peering, "--wait=false", check=False)
