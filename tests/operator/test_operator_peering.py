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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from dscache_tools.devcluster import DevCluster, wait_until
from fakes.server_metrics import FakeServerMetrics
from operator_harness import (
    OperatorProcess,
    PrometheusProcess,
    Rig,
    apply,
    available,
    spec_doc,
)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("chart")]

LIFETIME_S = 6


@dataclass(frozen=True)
class Peers:
    """A peering test's cluster, namespace, Prometheus, work dir and peering object name."""

    c: DevCluster
    ns: str
    prom: PrometheusProcess
    workdir: Path
    peering: str

    def create_peering(self) -> None:
        doc = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": self.peering},
        }
        self.c.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))

    def replica(self, name: str, env: dict[str, str] | None = None) -> OperatorProcess:
        """An operator replica of this peering, serving its metrics."""
        return OperatorProcess(
            self.c,
            self.workdir,
            self.prom.url,
            name=name,
            peering=self.peering,
            metrics=True,
            env=env,
        )

    def count(self) -> int:
        """Replicas in the peering object (0 while it does not exist)."""
        return len(_peers(self.c, self.peering))


@pytest.fixture
def peers(
    dev_cluster: DevCluster, prometheus: PrometheusProcess, ns: str, tmp_path: Path
) -> Iterator[Peers]:
    name = f"peering-{os.getpid()}-{ns}"
    yield Peers(dev_cluster, ns, prometheus, tmp_path, name)
    dev_cluster.kubectl("delete", "clusterkopfpeering", name, "--wait=false", check=False)


def _peers(c: DevCluster, name: str) -> dict[str, Any]:
    done = c.kubectl("get", "clusterkopfpeering", name, "-o", "json", check=False)
    if done.returncode != 0:
        return {}
    out: dict[str, Any] = yaml.safe_load(done.stdout).get("status") or {}
    return out


def test_one_replica_acts_and_a_standby_takes_over_after_kill_9(
    peers: Peers, server_metrics: FakeServerMetrics
) -> None:
    c, ns = peers.c, peers.ns
    peers.create_peering()
    env = {"DSCACHE_OPERATOR_PEERING_LIFETIME_SECONDS": str(LIFETIME_S)}
    a = peers.replica("a", env)
    b: OperatorProcess | None = None
    try:
        started_a = time.time()
        wait_until("replica a in the peering", lambda: peers.count() == 1, 60)
        # The older replica has the higher priority; start b in a later second.
        time.sleep(max(0.0, started_a + 1.1 - time.time()))
        b = peers.replica("b", env)
        wait_until("both replicas in the peering", lambda: peers.count() == 2, 60)

        name = "peered"
        rig_a = Rig(c, ns, a, peers.prom, server_metrics)
        rig_a.deploy(name, interval="4s")
        time.sleep(3)  # three ticks of a
        assert a.reconciles() > 0
        assert b.reconciles() == 0, b.tail()  # exactly one acts
        # kopf starts a peered replica paused; only the active one resumed.
        assert "Resuming operations" in a.tail() and "Resuming operations" not in b.tail()

        _, canary = rig_a.rollout(name, "2")
        rig_a.wait(name, "weight 25", lambda s: s.get("weight") == 25)
        # The 25% step's Event is out before the kill (an Event still in kopf's
        # posting queue dies with the process: Events are best effort).
        rig_a.events(name, lambda r: r.count("StepStarted") == 2)
        a.kill()  # SIGKILL: no goodbye in the peering object
        killed = time.monotonic()
        standby = b
        wait_until("b takes over", lambda: standby.reconciles() > 0, LIFETIME_S + 30)
        took = time.monotonic() - killed
        # a's record goes stale LIFETIME_S after its last keep-alive (sent every second).
        assert took <= LIFETIME_S + 10, (took, b.tail())
        assert "Resuming operations after the pause" in b.tail()

        rig_b = Rig(c, ns, b, peers.prom, server_metrics)
        weights = [w for _, w in rig_b.weights_until_promoted(name, canary, 90, lambda st: None)]
        assert weights[0] in (25, 50) and weights[-1] == 0, weights  # 0: promoted
        # No step repeated or skipped (the last Event may trail the status).
        reasons = rig_b.events(name, lambda r: "Promoted" in r)
        assert reasons.count("StepStarted") == 4, reasons
        # The dead replica's record was cleaned out; b's is the one left.
        wait_until("a's stale record cleaned", lambda: peers.count() == 1, 30)
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_replica_without_its_peering_object_says_so_and_waits_for_it(peers: Peers) -> None:
    c, ns = peers.c, peers.ns
    op = peers.replica("late")
    try:
        wait_until(
            "a warning naming the missing object",
            lambda: f"no ClusterKopfPeering {peers.peering!r}" in op.tail(),
            30,
        )
        apply(c, ns, [spec_doc("late", peers.prom)])
        time.sleep(3)  # three ticks, were it acting
        assert op.reconciles() == 0  # paused: never acts without its peers' agreement
        peers.create_peering()
        wait_until("acting once the object exists", lambda: op.reconciles() > 0, 30)
        available(c, ns, "late", op)
    finally:
        op.stop()
