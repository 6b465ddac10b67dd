"""``dscache bench respell`` (--quick): a restarted server continuing conversations
whose answers were stored under the ids a model generated.

What a user relies on: the workload's stored ids spell exactly the conversation's
text; the JSON carries both arms and the ratios; following the stored tokenization
serves more of the next turns from the cache than encoding the text anew (every
re-split answer's blocks are lost to the ``encode`` arm), and the restarted server
answers every turn. TTFT and tokenize times are reported, not asserted: they
depend on the machine's load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import run_quick_bench
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_tools.bench.respell import QUICK, conversations


def test_the_workload_stores_the_conversations_text_under_other_ids() -> None:
    tok = DeepSeekTokenizer()
    convs = conversations(QUICK, 1.0, seed=2, tokenizer=tok)
    assert convs == conversations(QUICK, 1.0, seed=2, tokenizer=tok)  # pure
    for conv in convs:
        chat = [ChatMessage(m["role"], m["content"]) for m in conv.messages]
        canonical = tok.apply_chat_template(chat)
        assert conv.resplit == QUICK.turns
        assert conv.ids != canonical
        assert tok.decode(conv.ids, skip_special=False) == tok.decode(canonical, skip_special=False)
    assert all(c.resplit == 0 for c in conversations(QUICK, 0.0, seed=2, tokenizer=tok))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_quick_respell_bench_serves_more_of_the_next_turns_from_the_cache(
    tmp_path: Path,
) -> None:
    out = tmp_path / "respell.json"
    doc, printed = run_quick_bench("respell", out, 800, "--resplit-share", "1.0")
    arms = doc["arms"]
    assert set(arms) == {"encode", "respell"}
    for arm in arms.values():
        assert 0 < arm["cached_tokens"] <= arm["prompt_tokens"]
        assert arm["ttft_p50_s"] > 0 and arm["ttft_p99_s"] >= arm["ttft_p50_s"]
    assert doc["workload"]["answers_resplit"] == doc["workload"]["answers"]
    assert arms["respell"]["token_hit_ratio"] > arms["encode"]["token_hit_ratio"]
    assert set(doc["ratios"]) == {
        "hit_ratio_respell_vs_encode",
        "ttft_p50_respell_vs_encode",
        "usual_tokenize_p50_respell_vs_encode",
    }
    assert doc["ratios"]["hit_ratio_respell_vs_encode"] > 1.0
    assert "hit_ratio_respell_vs_encode" in printed
