"""``dscache templates mine`` / ``match``: prewarm templates mined from captured chats.

What a user relies on: the templates are the block-aligned prefixes many
conversations share (a common system prompt, each group's document), counted and
ranked by the prefill they save without counting a shared block twice; a
conversation's own history is not a template; each template replays through
``dscache prewarm``'s reader and renders to the template's tokens; the Bloom file
is the sidecar's holdings format and ``match`` recognises requests that start
with a template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from dscache_server.prewarm import read_prompts
from dscache_sidecar.holdings import HoldingsFilter
from dscache_tools.templates import (
    DEFAULT_ROOT,
    Chat,
    MineOptions,
    chat_ids,
    match,
    mine,
    template_filter,
)
from dscache_tools.workload import ChatRequest, ChatTokenizer, load_server_tokenizer, write_jsonl

from dscache.cli import main

BT = 256


def _text(tag: str, sentences: int) -> str:
    # About ten tokens per sentence with the DeepSeek tokenizer.
    return " ".join(f"{tag} clause {i} says the {tag} terms hold." for i in range(sentences))


POLICY = _text("policy", 70)  # the system prompt every group shares: 2 full blocks
DOC_A = _text("alpha", 150)  # group A's document: its prompts reach 8 full blocks
DOC_B = _text("beta", 40)  # group B's: 4 full blocks
NOTES = _text("gamma", 60)  # one conversation's own context


def _group(doc: str, name: str, n: int) -> list[Chat]:
    return [
        Chat(
            [
                {"role": "system", "content": POLICY},
                {"role": "system", "content": doc},
                {"role": "user", "content": f"{name} question {i}: what changed in year {i}?"},
            ],
            conversation=f"{name}{i}",
        )
        for i in range(n)
    ]


def _history() -> list[Chat]:
    """Two groups sharing the policy, plus one two-turn conversation on its own."""
    long_question = "Please review: " + _text("delta", 30)
    own = [{"role": "system", "content": NOTES}, {"role": "user", "content": long_question}]
    return [
        *_group(DOC_A, "a", 4),
        *_group(DOC_B, "b", 3),
        Chat(own, "solo"),
        Chat(
            [*own, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "And?"}],
            "solo",
        ),
    ]


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return load_server_tokenizer()


def _common(tok: ChatTokenizer, chats: list[Chat]) -> int:
    """Full blocks of tokens all ``chats`` start with."""
    ids = [chat_ids(tok, c.messages) for c in chats]
    n = 0
    while all(len(i) > n for i in ids) and len({i[n] for i in ids}) == 1:
        n += 1
    return n // BT * BT


def test_the_templates_are_the_shared_prefixes_ranked_by_saved_prefill(tok: ChatTokenizer) -> None:
    chats = _history()
    a, b = chats[:4], chats[4:7]
    shared, ta, tb = _common(tok, a + b), _common(tok, a), _common(tok, b)
    assert (shared, ta, tb) == (512, 2048, 1024)  # the fixture is what it claims

    mined = mine(chats, tok, MineOptions(top=10, block_tokens=BT))
    got = [(len(t.ids), t.count, t.conversations, t.saved_tokens) for t in mined.templates]
    # Group A's document saves most; the policy shared by all 7 is listed because
    # more requests share it than either longer template; its blocks are not
    # counted again in the groups' savings.
    assert got == [
        (ta, 4, 4, 3 * (ta - shared)),
        (shared, 7, 7, 6 * shared),
        (tb, 3, 3, 2 * (tb - shared)),
    ]
    for t in mined.templates:
        assert len(t.ids) % BT == 0 and t.blocks(BT) == len(t.ids) // BT
    # The solo conversation shares three blocks with itself only: not a template.
    assert all(t.messages[0]["content"] != NOTES for t in mined.templates)
    assert mined.requests == len(chats)
    total = sum(len(chat_ids(tok, c.messages)) for c in chats)
    assert mined.total_prompt_tokens == total
    assert mined.coverage == pytest.approx(sum(s for *_, s in got) / total)


def test_each_template_replays_as_its_shortest_message_prefix(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    chats = _history()
    mined = mine(chats, tok, MineOptions(block_tokens=BT))
    by_tokens = {len(t.ids): t for t in mined.templates}
    assert by_tokens[512].messages == [{"role": "system", "content": POLICY}]
    assert by_tokens[2048].messages == chats[0].messages[:2]  # ends inside the document
    assert by_tokens[1024].messages == chats[4].messages[:2]
    for t in mined.templates:
        rendered = chat_ids(tok, t.messages)  # as the chat API renders it
        assert tuple(rendered[: len(t.ids)]) == t.ids
        if len(t.messages) > 1:  # one message fewer would not reach it
            assert len(chat_ids(tok, t.messages[:-1])) < len(t.ids)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(mined.prompts_jsonl(), encoding="utf-8")
    assert read_prompts(prompts) == [t.messages for t in mined.templates]


def test_top_keeps_the_best_and_counts_their_whole_prefix(tok: ChatTokenizer) -> None:
    mined = mine(_history(), tok, MineOptions(top=1, block_tokens=BT))
    (best,) = mined.templates
    # Without the policy listed, group A's template saves its whole length.
    assert (len(best.ids), best.count, best.saved_tokens) == (2048, 4, 3 * 2048)


def test_one_conversation_is_a_template_only_when_asked(tok: ChatTokenizer) -> None:
    mined = mine(_history(), tok, MineOptions(block_tokens=BT, min_conversations=1))
    solo = [t for t in mined.templates if t.messages[0]["content"] == NOTES]
    assert [(t.count, t.conversations, len(t.ids)) for t in solo] == [(2, 1, 768)]


def test_the_bloom_file_round_trips_and_matches_requests_that_start_with_a_template(
    tok: ChatTokenizer,
) -> None:
    chats = _history()
    mined = mine(chats, tok, MineOptions(block_tokens=BT))
    keys = mined.keys()
    assert len(keys) == 2 + 6 + 2  # the policy's blocks, then each document's own
    loaded = HoldingsFilter.from_bytes(template_filter(mined).to_bytes())
    assert all(k in loaded for k in keys)
    report = match(chats, tok, loaded, block_tokens=BT)
    assert (report.requests, report.first_block_matches) == (9, 7)  # not the solo turns
    assert report.matched_tokens == 4 * 2048 + 3 * 1024

    other_root = bytes(32)
    elsewhere = HoldingsFilter.from_bytes(template_filter(mined, other_root).to_bytes())
    assert match(chats, tok, elsewhere, root=other_root, block_tokens=BT).first_block_matches == 7
    assert match(chats, tok, elsewhere, root=DEFAULT_ROOT, block_tokens=BT).first_block_matches == 0


def _workload_file(chats: list[Chat], path: Path) -> Path:
    write_jsonl(
        (
            ChatRequest(c.conversation or "", n, "x", "en", None, False, messages=c.messages)
            for n, c in enumerate(chats)
        ),
        path,
    )
    return path


@pytest.mark.slow  # a CLI run: a process, or a real tokenizer loaded twice
def test_the_cli_writes_prompts_report_and_filter_and_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chats = _history()
    workload = _workload_file(chats, tmp_path / "w.jsonl")
    out, report, bloom = tmp_path / "p.jsonl", tmp_path / "r.json", tmp_path / "t.bloom"
    root = "ab" * 32
    code = main(
        [
            "templates", "mine", "--workload", str(workload), "--top", "2",
            "--out", str(out), "--json", str(report), "--bloom", str(bloom), "--root-hex", root,
        ]
    )  # fmt: skip
    assert code == 0
    doc = json.loads(report.read_text())
    assert set(doc) >= {"templates", "requests", "total_prompt_tokens", "coverage"}
    assert [(t["tokens"], t["blocks"], t["count"]) for t in doc["templates"]] == [
        (2048, 8, 4),
        (512, 2, 7),
    ]
    assert set(doc["templates"][0]) >= {"tokens", "blocks", "count", "saved_tokens", "messages"}
    assert read_prompts(out) == [t["messages"] for t in doc["templates"]]
    assert "coverage" in capsys.readouterr().out  # the table

    match_json = tmp_path / "m.json"
    args = ["templates", "match", "--bloom", str(bloom), "--workload", str(workload)]
    assert main([*args, "--root-hex", root, "--json", str(match_json)]) == 0
    m = json.loads(match_json.read_text())
    assert (m["requests"], m["first_block_matches"]) == (9, 7)
    assert m["match_share"] == pytest.approx(7 / 9)
    assert main([*args, "--root-hex", "not-hex"]) == 2


def test_a_prompt_log_is_mined_with_each_record_its_own_conversation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records: list[list[Any]] = [list(c.messages) for c in _history()]
    # An OpenAI client may send content as parts; the server joins the text parts.
    parts = [{"type": "text", "text": POLICY[:99]}, {"type": "text", "text": POLICY[99:]}]
    policy: dict[str, Any] = {"role": "system", "content": parts}
    records[0] = [policy, *records[0][1:]]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"messages": r}) + "\n" for r in records), encoding="utf-8")
    report = tmp_path / "r.json"
    args = ["templates", "mine", "--log", str(log), "--out", os.devnull, "--json", str(report)]
    assert main(args) == 0
    got = {(t["tokens"], t["count"]) for t in json.loads(report.read_text())["templates"]}
    # Without conversation ids the solo chat's two turns look like two conversations.
    assert got == {(2048, 4), (512, 7), (1024, 3), (768, 2)}
    capsys.readouterr()
    assert main(["templates", "mine", "--out", os.devnull]) == 2  # no input given
    log.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}]}]}))
    assert main(["templates", "mine", "--log", str(log), "--out", os.devnull]) == 2
