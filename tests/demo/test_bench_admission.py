"""``dscache bench admission`` (--quick): cost-based admission against the fixed
512-token threshold and against no cache, on a chat-like workload of short turns.

What a user relies on: the JSON carries the three modes with reused tokens and
TTFT, and the ratios; no request fails; the old threshold reuses nothing of a
prompt under 512 tokens and stores none of them, so the cost model (which loads
wherever loading beats recomputing; on this machine from the first block) reuses
strictly more of the same traffic. TTFT figures are reported, not asserted: they
depend on the machine's load.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from bench_helpers import run_quick_bench
from dscache_tools.workload import load_server_tokenizer, prompt_ids
from dscache_tools.workload.chat import chat_workload


def test_the_chat_workload_is_short_turns_that_extend_each_other() -> None:
    reqs = chat_workload(6, seed=3, min_turns=4, max_turns=8)
    assert reqs == chat_workload(6, seed=3, min_turns=4, max_turns=8)  # pure
    tok = load_server_tokenizer()
    by_session: dict[str, list[list[int]]] = {}
    for r in reqs:
        assert r.session_id == r.session and r.company == "chat"
        by_session.setdefault(r.session, []).append(prompt_ids(tok, r))
    assert len(by_session) == 6
    lengths = []
    for turns in by_session.values():
        assert 4 <= len(turns) <= 8
        for before, after in itertools.pairwise(turns):
            assert after[: len(before)] == before  # each turn extends the last
            assert 40 < len(after) - len(before) < 400  # a short turn
        lengths += [len(t) for t in turns]
    assert min(lengths) < 256 and max(lengths) < 3000
    assert sum(n < 512 for n in lengths) > len(lengths) / 4  # much of it under 512


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_quick_admission_bench_reuses_more_than_the_fixed_threshold(
    tmp_path: Path,
) -> None:
    out = tmp_path / "admission.json"
    doc, _ = run_quick_bench("admission", out, 1100)
    modes = doc["modes"]
    assert set(modes) == {"off", "fixed", "cost"}
    for m in modes.values():
        assert m["errors"] == 0 and m["requests"] == doc["workload"]["requests"]
        assert m["ttft_p50_s"] > 0 and m["ttft_p99_s"] >= m["ttft_p50_s"]
    assert modes["off"]["reused_tokens"] == 0
    assert modes["fixed"]["admission"].get("short", 0) > 0
    assert modes["cost"]["admission"].get("short", 0) == 0
    assert modes["cost"]["reused_tokens"] > modes["fixed"]["reused_tokens"]
    w = doc["workload"]
    assert modes["cost"]["token_hit_ratio"] <= w["ideal_token_hit_ratio"] + 1e-9
    assert set(doc["ratios"]) == {
        "reused_cost_vs_fixed", "ttft_p50_cost_vs_fixed", "ttft_p99_cost_vs_fixed",
        "ttft_p50_cost_vs_off", "ttft_p99_cost_vs_off",
    }  # fmt: skip
    assert doc["ratios"]["reused_cost_vs_fixed"] > 1.0
