"""``dscache bench operator`` at a small scale: a real control plane of its own with
simulated nodes, the chart's CRDs, two peered operator processes, every revision
changed at once. What an SRE reads off it must be there and sane: every rollout
finished, every resource's first child of the new revision seen, the standby idle
through the wave, and the operator's own API request counter behind the figure.
Figures are bounded, not asserted: the bench is for the numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dscache_tools.bench.operatorbench import Profile, run, table

pytestmark = pytest.mark.cluster


def test_a_small_wave_of_rollouts_all_finish_under_the_peered_operators(tmp_path: Path) -> None:
    doc = run(Profile(resources=4, namespaces=2, nodes=4, timeout_s=300.0), tmp_path)
    assert (doc["resources"], doc["namespaces"], doc["nodes"]) == (4, 2, 4)
    assert doc["stuck_rollouts"] == 0
    assert doc["children_written"] == 4
    assert 0 < doc["reconcile_p50_s"] <= doc["reconcile_p99_s"] < 120
    assert doc["reconciles"] >= 4 and doc["api_requests_per_reconcile"] > 1
    assert doc["standby_reconciles"] == 0
    assert 0 < doc["operator_rss_mib"] < 2048
    assert "stuck rollouts" in table(doc)
