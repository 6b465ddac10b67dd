"""The finance workload: determinism, structure, shares, variants, files, the ideal hit ratio."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from dscache_tools import democli
from dscache_tools.workload import (
    COMPANIES,
    SYSTEM_PROMPT,
    ChatRequest,
    WorkloadConfig,
    dossier,
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


_GOOD = (
    '{"session":"s","turn":0,"company":"X","lang":"en","session_id":null,'
    '"messages":[{"role":"user","content":"hi"}]}'
)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("{not json", "Expecting"),
        ('{"session":"s","turn":0}', "missing key 'company'"),
        ('["a list"]', "not a workload request"),
        (_GOOD.replace('[{"role":"user","content":"hi"}]', "[]"), "no messages"),
        (_GOOD.replace('"user"', '"robot"'), "unknown role 'robot'"),
        (_GOOD.replace('"turn":0', '"turn":"first"'), "invalid literal"),
        (_GOOD.replace('"turn":0', '"turn":-1'), "turn must be >= 0"),
    ],
)
def test_a_malformed_line_is_named_with_the_reason(tmp_path: Path, bad: str, why: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(f"{_GOOD}\n\n{bad}\n{_GOOD}\n")
    with pytest.raises(ValueError, match=rf"w\.jsonl:3: .*{why}"):
        read_jsonl(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(_GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"w\.jsonl:2: .*utf-8"):
        read_jsonl(path)


def test_standard_sessions_open_with_the_system_prompt_and_the_dossier() -> None:
    cfg = WorkloadConfig(sessions=30, seed=3, companies=4)
    assert cfg.variant == "standard"
    by_ticker = {c.ticker: c for c in COMPANIES}
    for turns in sessions_of(generate(cfg)).values():
        company = by_ticker[turns[0].company]
        assert turns[0].messages[:2] == [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "system", "content": dossier(company, 3)},
        ]
        assert turns[0].messages[2]["role"] == "user"


def _varied(sessions: int = 60, seed: int = 1) -> list[ChatRequest]:
    return generate(WorkloadConfig(sessions=sessions, seed=seed, companies=3, variant="varied"))


def _sections(text: str) -> list[str]:
    return text.split("\n\n### ")


def test_varied_sessions_open_differently_about_the_same_filings() -> None:
    sessions = list(sessions_of(_varied()).values())
    firsts = [turns[0].messages[0]["content"] for turns in sessions]
    assert len(set(firsts)) == len(firsts)  # no two sessions open alike
    # The first line differs too, so no phrasing is a shared prefix of two sessions.
    assert len({f.split("\n", 1)[0] for f in firsts}) == len(firsts)
    by_company: dict[str, list[list[ChatRequest]]] = {}
    for turns in sessions:
        by_company.setdefault(turns[0].company, []).append(turns)
    for company, group in by_company.items():
        docs = [t[0].messages[1]["content"] for t in group]
        expected = dossier(next(c for c in COMPANIES if c.ticker == company), 1)
        for doc in docs:  # the same dossier, header first, sections reordered
            assert sorted(_sections(doc)) == sorted(_sections(expected))
            assert _sections(doc)[0] == _sections(expected)[0]
        assert len(set(docs)) > len(docs) // 2
    # A greeting or not: two system messages, then a greeting exchange or the question.
    greeted = [t[0].messages for t in sessions if len(t[0].messages) == 5]
    assert 0 < len(greeted) < len(sessions)
    assert all(len(t[0].messages) in (3, 5) for t in sessions)
    for messages in greeted:
        assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "user"]


def test_varied_sessions_keep_each_turn_a_prefix_of_the_next() -> None:
    for turns in sessions_of(_varied(sessions=20)).values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.messages[: len(prev.messages)] == prev.messages


def test_varied_differs_from_standard_only_in_the_opening() -> None:
    cfg = WorkloadConfig(sessions=40, seed=2, companies=4)
    standard = generate(cfg)
    varied = generate(replace(cfg, variant="varied"))
    assert len(standard) == len(varied)
    for s, v in zip(standard, varied, strict=True):
        assert (s.session, s.turn, s.company, s.lang, s.session_id, s.reconnected) == (
            v.session,
            v.turn,
            v.company,
            v.lang,
            v.session_id,
            v.reconnected,
        )
        assert s.messages[0] != v.messages[0]
        # Everything after the opening (two system messages; a greeting) is the same.
        tail = len(s.messages) - 2
        assert v.messages[-tail:] == s.messages[-tail:]


def test_varied_is_deterministic_by_seed() -> None:
    a = [r.to_json() for r in _varied(sessions=10, seed=7)]
    assert a == [r.to_json() for r in _varied(sessions=10, seed=7)]
    assert a != [r.to_json() for r in _varied(sessions=10, seed=8)]
    with pytest.raises(ValueError, match="variant"):
        WorkloadConfig(variant="shuffled")  # type: ignore[arg-type]


def test_varied_sessions_share_no_first_block(tokenizer: Any) -> None:
    """What the variant is for: sessions about the same filings share no prefix block."""
    cfg = WorkloadConfig(sessions=24, seed=4, companies=2, min_turns=1, max_turns=2)
    standard, varied = generate(cfg), generate(replace(cfg, variant="varied"))

    def first_blocks(reqs: list[ChatRequest]) -> list[tuple[int, ...]]:
        return [tuple(prompt_ids(tokenizer, t[0])[:256]) for t in sessions_of(reqs).values()]

    assert len(set(first_blocks(standard))) == 2  # one per company
    assert len(set(first_blocks(varied))) == 24  # one per session
    ideal_standard = ideal_hit_ratio(standard, tokenizer).token_hit_ratio
    assert ideal_hit_ratio(varied, tokenizer).token_hit_ratio < ideal_standard - 0.1


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


def _workload_cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    democli.register(sub, sub)
    return parser.parse_args(["workload", "finance", *argv])


def test_cli_writes_the_varied_variant(tmp_path: Path) -> None:
    out = tmp_path / "varied.jsonl"
    args = _workload_cli(
        "--variant", "varied", "--sessions", "6", "--seed", "9", "--out", str(out), "--no-ideal"
    )
    assert args.handler(args) == 0
    assert read_jsonl(out) == generate(WorkloadConfig(sessions=6, seed=9, variant="varied"))


def test_cli_refuses_a_prewarm_file_for_the_varied_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "varied.jsonl"
    args = _workload_cli(
        "--variant", "varied", "--out", str(out), "--prewarm-out", str(tmp_path / "p.jsonl")
    )
    assert args.handler(args) == 2
    assert "--prewarm-out needs --variant standard" in capsys.readouterr().err
    assert not out.exists()


def test_the_chat_workload_drops_ids_per_request_without_changing_the_chats(
    tmp_path: Path,
) -> None:
    from dscache_tools.workload.chat import chat_workload

    from dscache.cli import main

    kept = chat_workload(30, seed=5)
    dropped = chat_workload(30, seed=5, drop_id_share=0.4)
    assert [r.messages for r in dropped] == [r.messages for r in kept]
    assert all(r.session_id == r.session for r in kept)
    share = sum(r.session_id is None for r in dropped) / len(dropped)
    assert 0.25 < share < 0.55, share
    # Within one conversation some turns carry the id and some do not: the split case.
    by_session: dict[str, set[bool]] = {}
    for r in dropped:
        by_session.setdefault(r.session, set()).add(r.session_id is None)
    assert sum(len(v) == 2 for v in by_session.values()) > 10
    with pytest.raises(ValueError, match="drop_id_share"):
        chat_workload(3, drop_id_share=1.5)
    out = tmp_path / "chat.jsonl"
    argv = ["workload", "chat", "--sessions", "30", "--seed", "5", "--out", str(out)]
    assert main(argv) == 0
    assert read_jsonl(out) == dropped
