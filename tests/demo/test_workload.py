"""The finance workload: determinism, structure, shares, and the ideal hit ratio."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from dscache_tools import democli
from dscache_tools.workload import (
    COMPANIES,
    ChatRequest,
    WorkloadConfig,
    generate,
    ideal_hit_ratio,
    load_server_tokenizer,
    prewarm_requests,
    prompt_ids,
    read_jsonl,
    sessions_of,
    summary,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_server_tokenizer()


def test_same_seed_same_bytes_other_seed_other_bytes() -> None:
    a = [r.to_json() for r in generate(WorkloadConfig(sessions=30, seed=7))]
    b = [r.to_json() for r in generate(WorkloadConfig(sessions=30, seed=7))]
    c = [r.to_json() for r in generate(WorkloadConfig(sessions=30, seed=8))]
    assert a == b
    assert a != c


def test_default_workload_shape() -> None:
    reqs = generate(WorkloadConfig())
    info = summary(reqs)
    assert 900 <= info["requests"] <= 1100  # "about 1,000 question-answer turns"
    assert info["companies"] == len(COMPANIES)
    assert 0.3 <= info["zh_share"] <= 0.7  # Chinese and English
    assert info["dropped_id_share"] == pytest.approx(0.4, abs=0.05)
    assert 5 <= info["reconnected_sessions"] <= 40


def test_history_grows_by_one_exchange_and_documents_are_shared() -> None:
    reqs = generate(WorkloadConfig(sessions=40, seed=1))
    system_by_company: dict[str, list[dict[str, str]]] = {}
    for turns in sessions_of(reqs).values():
        head = turns[0].messages[:2]
        assert [m["role"] for m in head] == ["system", "system"]
        assert len(head[1]["content"]) > 3000  # the dossier: background + statements
        assert system_by_company.setdefault(turns[0].company, head) == head
        for prev, cur in itertools.pairwise(turns):
            assert cur.turn == prev.turn + 1
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in cur.messages[len(prev.messages) :]] == [
                "assistant",
                "user",
            ]
    assert len(system_by_company) > 3


def test_reconnect_changes_the_id_and_drops_carry_none() -> None:
    reqs = generate(WorkloadConfig(sessions=120, seed=2, reconnect_share=0.5, drop_id_share=0.3))
    changed = 0
    for turns in sessions_of(reqs).values():
        ids = [r.session_id for r in turns if r.session_id is not None]
        if any(r.reconnected for r in turns):
            before = {r.session_id for r in turns if not r.reconnected} - {None}
            after = {r.session_id for r in turns if r.reconnected} - {None}
            if before and after:
                assert not before & after
                changed += 1
        else:
            assert len(set(ids)) <= 1
    assert changed > 10
    none = generate(WorkloadConfig(sessions=20, seed=2, drop_id_share=1.0))
    assert all(r.session_id is None for r in none)


def test_session_drop_mode_drops_whole_sessions() -> None:
    reqs = generate(WorkloadConfig(sessions=300, seed=6, drop_mode="session", reconnect_share=0))
    groups = list(sessions_of(reqs).values())
    dropped = [all(r.session_id is None for r in t) for t in groups]
    assert all(
        d or all(r.session_id is not None for r in t) for d, t in zip(dropped, groups, strict=True)
    )
    assert sum(dropped) / len(groups) == pytest.approx(0.4, abs=0.07)
    with pytest.raises(ValueError, match="drop_mode"):
        WorkloadConfig(drop_mode="turn")  # type: ignore[arg-type]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    reqs = generate(WorkloadConfig(sessions=5, seed=4))
    path = tmp_path / "w.jsonl"
    assert write_jsonl(reqs, path) == len(reqs)
    assert read_jsonl(path) == reqs
    path.write_text('{"session": 1}\n')
    with pytest.raises(ValueError, match=r"w\.jsonl:1"):
        read_jsonl(path)


def test_prompt_of_a_turn_is_a_token_prefix_of_the_next(tokenizer: Any) -> None:
    reqs = generate(WorkloadConfig(sessions=6, seed=5, companies=4))
    lengths = []
    for turns in sessions_of(reqs).values():
        prev_ids: list[int] | None = None
        for r in turns:
            ids = prompt_ids(tokenizer, r)
            lengths.append(len(ids))
            if prev_ids is not None:
                assert ids[: len(prev_ids)] == prev_ids
            prev_ids = ids
    # "A few thousand tokens" of shared documents per session.
    assert min(lengths) >= 1500
    assert sum(lengths) / len(lengths) >= 2000


class _CharTokenizer:
    """One id per character, messages joined by a separator id: prefix-stable."""

    def apply_chat_template(
        self, messages: Sequence[Any], *, add_generation_prompt: bool = True
    ) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids.extend(ord(ch) for ch in m.content)
            ids.append(0)
        return ids


def _req(session: str, *texts: str) -> ChatRequest:
    return ChatRequest(
        session=session,
        turn=0,
        company="X",
        lang="en",
        session_id=None,
        reconnected=False,
        messages=[{"role": "user", "content": t} for t in texts],
    )


def test_ideal_hit_ratio_counts_full_blocks_seen_before() -> None:
    tok = _CharTokenizer()
    a = _req("a", "abcdefg")  # 8 ids: 2 blocks of 4
    b = _req("b", "abcdefg", "hij")  # 12 ids: 3 blocks; first 2 seen in a
    c = _req("c", "abcdefX")  # 8 ids: block 0 seen, block 1 differs
    ideal = ideal_hit_ratio([a, b, c], tok, block_tokens=4)
    assert ideal.prompt_tokens == 28
    assert ideal.hit_tokens == 0 + 8 + 4
    assert ideal.token_hit_ratio == pytest.approx(12 / 28)
    # Order-independent totals when each session's turns keep their order.
    assert ideal_hit_ratio([c, a, b], tok, block_tokens=4).hit_tokens == 0 + 4 + 8
    # A prewarm fills the cache first and is not counted.
    warm = ideal_hit_ratio([b], tok, block_tokens=4, warm=[a])
    assert (warm.requests, warm.hit_tokens) == (1, 8)
    # The last token is always recomputed, so a repeated prompt is not a 100% hit.
    again = ideal_hit_ratio([a, a], tok, block_tokens=4)
    assert again.hit_tokens == 7


def test_ideal_hit_ratio_of_the_finance_workload(tokenizer: Any) -> None:
    reqs = generate(WorkloadConfig(sessions=40, seed=0, companies=4))
    ideal = ideal_hit_ratio(reqs, tokenizer)
    assert 0.8 < ideal.token_hit_ratio < 0.97
    warm = ideal_hit_ratio(reqs, tokenizer, warm=prewarm_requests(reqs))
    assert warm.token_hit_ratio > ideal.token_hit_ratio
    assert len(prewarm_requests(reqs)) == len({r.company for r in reqs}) == 4


def test_cli_writes_the_file_and_prints_the_ideal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    democli.register(sub, sub)
    out = tmp_path / "finance.jsonl"
    args = parser.parse_args(
        ["workload", "finance", "--sessions", "12", "--seed", "9", "--out", str(out)]
    )
    assert args.handler(args) == 0
    text = capsys.readouterr().out
    assert "ideal token hit ratio 0." in text
    assert len(read_jsonl(out)) == sum(1 for _ in out.open())
