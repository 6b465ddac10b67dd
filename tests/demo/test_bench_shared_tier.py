"""``dscache bench shared-tier``: the whole bench once (--quick), on real model servers,
sidecars and a real Redis Cluster; and its bookkeeping.

What a user relies on: sessions moved to a fresh pod find more of their prefix with
the shared tier than without, nothing fails while the cluster is frozen or killed,
and the JSON carries the keys of the command contract.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import run_quick_bench
from dscache_tools.bench.sharedtier import Outcome, Tally, sessions
from needs import need_binary


def test_tally_ratios_count_only_answered_requests() -> None:
    t = Tally()
    t.add(Outcome(True, 1000, 900, 0.2))
    t.add(Outcome(True, 1000, 100, 0.4))
    t.add(Outcome(False, error="boom"))
    assert t.failed == 1
    assert t.hit_ratio() == 0.5
    assert t.p50() is not None and abs(t.p50() - 0.3) < 1e-9  # type: ignore[operator]
    assert Tally().hit_ratio() is None and Tally().p50() is None


def test_sessions_have_at_least_three_turns_in_order() -> None:
    convs = sessions(quick=True, seed=0, count=6)
    assert len(convs) == 6
    for turns in convs:
        assert len(turns) >= 3
        assert [r.turn for r in turns] == list(range(len(turns)))
        # Each turn carries the whole conversation so far: a growing prefix.
        assert len(turns[-1].messages) > len(turns[0].messages)
    assert sessions(quick=True, seed=0, count=6) == convs


@pytest.mark.slow
def test_the_quick_bench_moves_sessions_and_survives_a_dead_cluster(tmp_path: Path) -> None:
    need_binary("redis-server", "redis-server")
    out = tmp_path / "shared.json"
    doc, printed = run_quick_bench("shared-tier", out, 1200)
    with_s, without = doc["with_shared"], doc["without_shared"]
    for arm in (with_s, without):
        assert {"token_hit_ratio", "ttft_p50_s"} <= arm.keys()
    assert doc["failed_requests"] == 0
    # The moved turns find more with the shared tier, and never more than all full blocks.
    assert with_s["token_hit_ratio"] > without["token_hit_ratio"]
    assert with_s["token_hit_ratio"] <= doc["moved_ideal_token_hit_ratio"] + 1e-9
    scale = doc["scale_out"]
    assert scale["with_shared"]["token_hit_ratio"] > scale["without_shared"]["token_hit_ratio"]
    for fault in ("frozen", "killed"):
        f = doc["faults"][fault]
        assert f["requests"] > 0 and f["failed"] == 0
    assert "with / without shared tier" in printed
