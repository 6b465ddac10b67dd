"""``dscache bench prewarm`` (--quick): a canary warmed all at once or through the router's hash.

What a user relies on: the JSON carries the four modes with their prewarm cost and
token hit ratio, and the ratios; no request fails; warming each prompt once, on the
pod the router's hash tries first, costs one request per prompt (not one per pod),
and with the picker deciding it reuses as much as warming every pod (new sessions
go to the pod holding their document). TTFT figures are reported, not asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import run_quick_bench
from dscache_tools.bench.prewarmbench import QUICK, traffic


def test_the_traffic_opens_sessions_with_and_without_ids() -> None:
    reqs = traffic(QUICK, seed=0, drop_id_share=0.4)
    assert len(reqs) == QUICK.requests
    assert any(r.session_id is None for r in reqs) and any(r.session_id for r in reqs)
    assert any(r.turn == 0 for r in reqs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ring_placement_with_the_picker_warms_as_well_as_every_pod_for_less(
    tmp_path: Path,
) -> None:
    out = tmp_path / "prewarm.json"
    doc, _ = run_quick_bench("prewarm", out, 850)
    modes = {m["name"]: m for m in doc["modes"]}
    assert list(modes) == ["none", "all", "ring", "ring_kv"]
    prompts, pods = doc["workload"]["prewarm_prompts"], doc["workload"]["pods"]
    for m in modes.values():
        assert m["errors"] == 0 and m["requests"] == doc["workload"]["requests"]
        assert 0.0 <= m["token_hit_ratio"] <= 1.0
    assert modes["none"]["prewarm_requests"] == 0
    assert modes["all"]["prewarm_requests"] == prompts * pods
    assert modes["ring"]["prewarm_requests"] == modes["ring_kv"]["prewarm_requests"] == prompts
    assert modes["all"]["token_hit_ratio"] > modes["none"]["token_hit_ratio"]
    # One copy on the right pod, found by the picker: no worse than a copy on every pod.
    assert modes["ring_kv"]["token_hit_ratio"] >= modes["all"]["token_hit_ratio"] - 0.02
    assert set(doc["ratios"]) == {
        "prewarm_requests_ring_vs_all", "prewarm_s_ring_vs_all", "token_hit_ring_vs_all",
        "token_hit_ring_kv_vs_all", "token_hit_all_vs_none",
    }  # fmt: skip
    assert doc["ratios"]["prewarm_requests_ring_vs_all"] == pytest.approx(1 / pods)
