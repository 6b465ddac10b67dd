"""``dscache bench coldstart`` (--quick): a cold pod prewarmed with mined templates.

What a user relies on: the JSON carries the three modes with their token hit
ratio, TTFT and prewarm cost, and the ratios; no request fails; templates mined
from earlier sessions match the new sessions' prompts (an infinite cache warmed
with them would hit more), and the real pod prewarmed with them reuses at least
as much of its first requests as one that was not prewarmed. TTFT figures are
reported, not asserted: they depend on the machine's load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import run_quick_bench
from dscache_tools.bench.coldstart import QUICK, samples


def test_the_history_and_the_new_traffic_share_no_session() -> None:
    history, new = samples(QUICK, seed=0)
    assert len(new) == QUICK.requests
    assert not {r.session for r in history} & {r.session for r in new}
    assert history and new[0].turn == 0  # the pod's first request opens a session
    # Same documents on both sides: the history's companies are the new traffic's too.
    assert {r.company for r in new} <= {r.company for r in history}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_quick_coldstart_bench_reuses_more_with_mined_templates(tmp_path: Path) -> None:
    out = tmp_path / "coldstart.json"
    doc, _ = run_quick_bench("coldstart", out, 850)
    modes = {m["name"]: m for m in doc["modes"]}
    assert list(modes) == ["none", "user_list", "mined"]
    for m in modes.values():
        assert set(m) >= {"name", "token_hit_ratio", "ttft_p50_s", "prewarm_prompts", "prewarm_s"}
        assert m["errors"] == 0 and m["requests"] == doc["workload"]["requests"]
        assert m["ttft_p50_s"] > 0
        assert 0.0 <= m["token_hit_ratio"] <= m["ideal_token_hit_ratio"] + 1e-9
    assert modes["none"]["prewarm_prompts"] == 0
    assert modes["mined"]["prewarm_prompts"] == doc["workload"]["templates"] > 0
    assert modes["mined"]["ideal_token_hit_ratio"] > modes["none"]["ideal_token_hit_ratio"]
    assert modes["mined"]["token_hit_ratio"] >= modes["none"]["token_hit_ratio"]
    assert set(doc["ratios"]) == {
        "token_hit_mined_vs_none", "token_hit_user_list_vs_none", "token_hit_mined_vs_user_list",
        "ttft_p50_mined_vs_none", "ttft_p50_user_list_vs_none",
    }  # fmt: skip
    assert doc["ratios"]["token_hit_mined_vs_none"] >= 1.0
