"""``dscache bench router``: the latency the picker's KV-aware choice adds per request.

What a user relies on: the JSON carries one row per concurrency with both routers'
P50 / P99, the difference and the ratio; every request got its answer; the kv
router consulted the picker for each of its requests and the picker answered in
time (no ``failed`` pick), placing the held requests by the prefix it found in
the stand-ins' filters. The latency bound is loose on purpose (a shared 2-core
machine): it catches a picker that stalls requests, not a slow millisecond.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import run_quick_bench
from dscache_tools.bench.router import CONCURRENCIES, QUICK, Pass, rows, table
from needs import need_nginx

ROW_KEYS = {
    "concurrency",
    "hash_p50_ms",
    "hash_p99_ms",
    "kv_p50_ms",
    "kv_p99_ms",
    "added_p50_ms",
    "added_p99_ms",
    "p50_ratio",
    "p99_ratio",
}


def test_rows_pool_the_rounds_and_compare_kv_with_hash() -> None:
    passes = [
        Pass("hash", 1, [1.0, 3.0], 0),
        Pass("kv", 1, [2.0, 4.0], 0),
        Pass("hash", 1, [2.0], 0),  # a second round of hash
        Pass("kv", 1, [6.0], 0),
        Pass("hash", 4, [5.0], 0),
        Pass("kv", 4, [], 1),  # every kv request at concurrency 4 failed
    ]
    one, four = rows(passes)
    assert one["concurrency"] == 1 and one["hash_p50_ms"] == 2.0 and one["kv_p50_ms"] == 4.0
    assert one["added_p50_ms"] == 2.0 and one["p50_ratio"] == 2.0
    assert four["kv_p50_ms"] is None and four["added_p50_ms"] is None
    assert four["p50_ratio"] is None
    doc = {
        "rows": [one, four],
        "picker_decision_mean_ms": 1.5,
        "picks": {"prefix": 3, "failed": 0},
        "requests": 7,
        "failed": 1,
        "workload_requests": 1,
        "rounds": 2,
    }
    text = table(doc)
    assert "+2.00" in text and "prefix 3, failed 0" in text
    assert "1 failed" in text


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_quick_router_bench_measures_a_picker_that_really_decides(tmp_path: Path) -> None:
    need_nginx()
    out, png = tmp_path / "router.json", tmp_path / "router.png"
    per_pass = 20
    doc, _ = run_quick_bench("router", out, 380, "--requests", str(per_pass), "--png", str(png))
    assert set(doc) == {
        "epp",
        "feeds",
        "rows",
        "picker_decision_mean_ms",
        "picks",
        "requests",
        "failed",
        "workload_requests",
        "rounds",
    }
    assert [r["concurrency"] for r in doc["rows"]] == list(CONCURRENCIES)
    for row in doc["rows"]:
        assert set(row) == ROW_KEYS
        assert all(isinstance(row[k], int | float) for k in ROW_KEYS), row
        assert row["added_p50_ms"] == pytest.approx(row["kv_p50_ms"] - row["hash_p50_ms"])
        assert row["p99_ratio"] == pytest.approx(row["kv_p99_ms"] / row["hash_p99_ms"])
        assert row["added_p50_ms"] < 100.0, row  # a stalling picker, not a slow ms
    # Every request answered: both routers, every round, both concurrencies.
    assert doc["workload_requests"] == per_pass and doc["rounds"] == QUICK.rounds
    assert doc["requests"] == per_pass * QUICK.rounds * 2 * len(CONCURRENCIES)
    assert doc["failed"] == 0
    # The kv router asked the picker for each of its requests; an answer later than the
    # timeout (a loaded machine) falls back to the hash, so failures are bounded, not zero.
    picks = doc["picks"]
    assert picks["failed"] <= max(1, doc["requests"] // 100)
    assert sum(picks.values()) == doc["requests"] // 2
    assert picks["prefix"] > 0  # the filters' keys are the ones the picker computes
    assert doc["picker_decision_mean_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Both feeds saw every chain the sidecar stored; the events' picture is the
    # fresher one (a filter waits for a rebuild and a fetch: seconds, bounded loosely).
    feeds = doc["feeds"]
    assert feeds["chains"] > 0 and feeds["events"]["missed"] == feeds["filters"]["missed"] == 0
    assert feeds["events"]["staleness_p50_ms"] < feeds["filters"]["staleness_p50_ms"]
    assert feeds["events"]["bytes_per_s"] > 0 and feeds["filters"]["bytes_per_s"] > 0
    # The endpoint picker face: every request picked over gRPC, the null processor's
    # round trip measured beside it, and routing by what the picker knows reuses at
    # least what the ring's hash does (the same requests, simulated pod caches).
    lat, hits = doc["epp"]["latency"], doc["epp"]["hits"]
    assert lat["requests"] == per_pass * 2  # two quick rounds
    assert lat["null_p50_ms"] > 0 and 0 < lat["epp_p50_ms"] < 1000.0  # a stall, not a ms
    assert lat["added_p99_ms"] == pytest.approx(lat["epp_p99_ms"] - lat["null_p99_ms"])
    assert hits["requests"] >= 20 and 0 < hits["ideal"] <= 1
    assert hits["hash"] <= hits["epp"] <= hits["ideal"]
    assert hits["epp_of_ideal"] == pytest.approx(hits["epp"] / hits["ideal"])
