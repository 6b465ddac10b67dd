"""Pure pieces of the model server: attention merging, block round trip, sampling,
stop strings, the chat template, the cost model, the generation slots and the settings."""

from __future__ import annotations

import argparse
import asyncio
import os
import threading

import numpy as np
import pytest
import torch
from dscache_server.admission import CostModel
from dscache_server.config import ServerSettings, add_server_arguments, settings_from_args
from dscache_server.generate import (
    IncrementalDetokenizer,
    SamplingParams,
    SessionTracker,
    StopMatcher,
    sample,
)
from dscache_server.kv import flash_part, latent_part, merge_parts
from dscache_server.metrics import ServerMetrics
from dscache_server.presets import PRESETS
from dscache_server.slots import GenerationSlots, QueueFullError
from dscache_server.tokenizer import (
    ChatMessage,
    Continuations,
    DeepSeekTokenizer,
    PieceCache,
    TemplateError,
)
from dscache_server.writer import BlockWriter
from srv_helpers import engine_for

from dscache.keys import KeyChain, tenant_salt


def test_merged_chunks_equal_attention_over_the_concatenation() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 7, 16, generator=g)
    chunks = [torch.randn(1, 4, n, 16, generator=g) for n in (5, 32, 1)]
    values = [torch.randn(1, 4, n, 16, generator=g) for n in (5, 32, 1)]
    parts = [
        flash_part(q, k, v, causal=False, scale=0.25) for k, v in zip(chunks, values, strict=True)
    ]
    merged, lse = merge_parts(parts)
    full = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat(chunks, 2), torch.cat(values, 2), scale=0.25
    )
    assert float((merged - full).abs().max()) < 1e-5
    scores = q @ torch.cat(chunks, 2).transpose(-1, -2) * 0.25
    assert float((lse - torch.logsumexp(scores, -1)).abs().max()) < 1e-4


def test_latent_part_is_attention_with_shared_keys() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 24, generator=g)
    latent = torch.randn(9, 24, generator=g)
    out, lse = latent_part(q, latent, 16, 0.3)
    p = torch.softmax(q @ latent.t() * 0.3, dim=-1)
    assert float((out - p @ latent[:, :16]).abs().max()) < 1e-5
    assert float((lse - torch.logsumexp(q @ latent.t() * 0.3, -1)).abs().max()) < 1e-5


@pytest.mark.slow
def test_engine_matches_transformers_forward_and_blocks_round_trip() -> None:
    engine = engine_for("mini-gqa")
    ids = [int(t) for t in np.random.default_rng(3).integers(2, 100_000, size=75)]
    seq = engine.new_sequence()
    ours = engine.forward(seq, ids)
    ref = engine.reference_logits(ids)
    assert float((ours - ref).abs().max()) <= 1e-4
    blocks = [engine.adapter.export(seq, i) for i in range(2)]
    assert blocks[0].shape == engine.adapter.block_shape
    again = engine.new_sequence()
    engine.adapter.restore(again, blocks)
    assert again.restored_tokens == 64
    np.testing.assert_array_equal(engine.adapter.export(again, 1), blocks[1])
    with pytest.raises(ValueError):
        engine.adapter.restore(engine.new_sequence(), [blocks[0][:, :, :1]])


def test_greedy_and_seeded_sampling() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(logits, SamplingParams(temperature=0), torch.Generator()) == 1
    draws = [
        sample(logits, SamplingParams(temperature=1.0, seed=5), torch.Generator().manual_seed(5))
        for _ in range(3)
    ]
    assert len(set(draws)) == 1
    nucleus = SamplingParams(temperature=1.0, top_p=0.01)
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, nucleus, g) for _ in range(20)} == {1}


def test_stop_strings_are_cut_and_never_emitted() -> None:
    m = StopMatcher(["END"])
    emitted = ""
    stopped = False
    for piece in ["hello E", "N", "D and more"]:
        out, stopped = m.feed(piece)
        emitted += out
        if stopped:
            break
    assert stopped and emitted + m.flush() == "hello " and m.text == "hello "
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)


def test_incremental_detokenizer_matches_full_decode(tokenizer: DeepSeekTokenizer) -> None:
    text = "Bonds yield 4.5% — 债券收益率 上升 🚀 end"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(i) for i in ids) == tokenizer.decode(ids)


def test_chat_template_turns_extend_each_other(tokenizer: DeepSeekTokenizer) -> None:
    turn1 = [ChatMessage("system", "You are terse."), ChatMessage("user", "Hi there")]
    ids1 = tokenizer.apply_chat_template(turn1)
    turn2 = [*turn1, ChatMessage("assistant", "Hello!"), ChatMessage("user", "More?")]
    ids2 = tokenizer.apply_chat_template(turn2)
    assert ids2[: len(ids1)] == ids1
    assert ids1[0] == tokenizer.bos_id and ids1[-1] == tokenizer.assistant_id
    assert tokenizer.eos_id in ids2
    rendered = tokenizer.decode(ids2, skip_special=False)
    assert rendered.startswith(tokenizer.decode([tokenizer.bos_id], skip_special=False))
    with pytest.raises(TemplateError):
        tokenizer.apply_chat_template([])
    # Every id the tokenizer makes is in the models' vocabulary (the preset's config:
    # building the model to ask it took 10 s in the fast tier).
    assert tokenizer.vocab_size <= PRESETS["mini-gqa"].config["vocab_size"]


def test_cost_model_crossover() -> None:
    cost = CostModel(
        prefill_tokens_per_s=1000.0,
        load_bytes_per_s=1e9,
        lookup_overhead_s=0.01,
        bytes_per_token=10_000,
    )
    crossover = cost.crossover_tokens()
    assert crossover is not None
    # Loading costs more than recomputing just below the crossover, less just above.
    assert cost.load_cost_s(crossover - 2) >= cost.recompute_cost_s(crossover - 2)
    assert cost.load_cost_s(crossover + 1) < cost.recompute_cost_s(crossover + 1)
    slow_disk = CostModel(1000.0, 1e6, 0.0, 10_000)
    assert slow_disk.crossover_tokens() is None
    assert slow_disk.load_cost_s(10_000) > slow_disk.recompute_cost_s(10_000)


def test_generation_slots_bound_the_queue_and_keep_session_order() -> None:
    async def run() -> tuple[list[str], bool]:
        s = GenerationSlots(max_concurrency=1, max_queue=2, metrics=ServerMetrics())
        order: list[str] = []
        gate = asyncio.Event()

        async def job(name: str, session: str | None) -> None:
            async with s.slot(session):
                if name == "a1":
                    await gate.wait()
                order.append(name)

        first = asyncio.create_task(job("a1", "a"))
        await asyncio.sleep(0)
        rest = [asyncio.create_task(job("a2", "a")), asyncio.create_task(job("b1", "b"))]
        await asyncio.sleep(0)
        refused = False
        try:
            async with s.slot("c"):
                pass
        except QueueFullError:
            refused = True
        gate.set()
        await asyncio.gather(first, *rest)
        return order, refused

    order, refused = asyncio.run(run())
    assert refused
    assert order.index("a1") < order.index("a2")


def test_settings_from_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSCACHE_SERVER_PORT", "9001")
    monkeypatch.setenv("DSCACHE_SERVER_MIN_CACHE_TOKENS", "1024")
    p = argparse.ArgumentParser()
    add_server_arguments(p)
    s = settings_from_args(p.parse_args(["--model", "mini-gqa", "--port", "9002"]))
    assert (s.model, s.port, s.min_cache_tokens, s.calibrate) == ("mini-gqa", 9002, 1024, True)
    assert settings_from_args(p.parse_args(["--no-calibrate"])).calibrate is False
    with pytest.raises(ValueError):
        ServerSettings(sidecar_data_dir="/x")


def test_session_tracker_forgets_the_least_recently_seen_session() -> None:
    sessions = SessionTracker(capacity=2)
    sessions.record("a", 3)
    sessions.record("b", 4)
    assert sessions.previous("a") == 3  # "a" is now the most recently seen
    sessions.record("c", 5)
    assert (sessions.previous("a"), sessions.previous("b"), sessions.previous("c")) == (3, None, 5)


def test_remembered_pieces_tokenize_the_same_and_stay_per_tenant(
    tokenizer: DeepSeekTokenizer,
) -> None:
    doc = " ".join(f"Revenue in {y} was {y * 7 % 1000} million." for y in range(1990, 2090))
    msgs = [ChatMessage("system", "You are an analyst."), ChatMessage("user", doc)]
    pieces = PieceCache()
    plain = tokenizer.apply_chat_template(msgs)
    calls: list[str] = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return tokenizer.encode(text)

    assert pieces.ids("alice", doc, counting) == tokenizer.encode(doc)
    assert pieces.ids("alice", doc, counting) == tokenizer.encode(doc)
    assert len(calls) == 1  # the second time from memory
    pieces.ids("bob", doc, counting)
    assert len(calls) == 2  # another tenant's pieces are its own
    with_cache = tokenizer.apply_chat_template(msgs, pieces=pieces, scope="alice")
    assert with_cache == plain
    again = tokenizer.apply_chat_template(msgs, pieces=pieces, scope="alice")
    assert again == plain


def test_answer_ids_keep_the_generated_ids_that_spell_the_text(
    tokenizer: DeepSeekTokenizer,
) -> None:
    words = tokenizer.encode(" Revenue rose by a third in the last quarter")
    placeholder = tokenizer.encode("<\uff5cplace\u2581holder\u2581no\u2581754\uff5c>")
    assert len(placeholder) == 1  # a special token: the answer's text drops it
    generated = [*words[:5], *placeholder, *words[5:]]
    text = tokenizer.decode(generated)
    ids = tokenizer.answer_ids(text, generated)
    assert ids is not None and ids[:5] == words[:5]  # kept up to the special token
    assert tokenizer.decode(ids, skip_special=False) == text
    assert tokenizer.answer_ids(text, words) == words  # all of them when they spell it
    assert tokenizer.answer_ids("something else", words) is None


def test_a_completion_text_sent_back_keeps_the_ids_it_was_served_with(
    tokenizer: DeepSeekTokenizer,
) -> None:
    """A /v1/completions client continuing the text it was given: the longest text
    this tenant's model completed that the new prompt starts with comes back with its
    ids (here ids a fresh encoding never gives), the rest encoded; another tenant, a
    prompt that changed it, or a text too short to index are encoded as usual."""
    memory = Continuations(opening_chars=32)
    doc = "Quarterly filing: revenue, margins and cash flow by segment. " * 4
    answer = " Revenue rose by a third."
    stand_in = [*tokenizer.encode(doc), 17, 18]  # remembered as given: not re-encoded
    memory.remember("alice", doc + answer, stand_in)
    longer = [*stand_in, 19, 20, 21]
    memory.remember("alice", doc + answer + " Margins", longer)
    more = " What about cash flow?"

    assert memory.ids("alice", doc + answer + more, tokenizer.encode) == [
        *stand_in,
        *tokenizer.encode(more),
    ]
    assert memory.ids("alice", doc + answer + " Margins fell.", tokenizer.encode) == [
        *longer,
        *tokenizer.encode(" fell."),
    ]
    for scope, text in [
        ("bob", doc + answer + more),  # another tenant's completions are not its own
        ("alice", doc + " Revenue fell." + more),  # the answer was edited
        ("alice", doc[:-1]),  # shorter than anything remembered
    ]:
        assert memory.ids(scope, text, tokenizer.encode) == tokenizer.encode(text)
    short = Continuations(opening_chars=1000)
    short.remember("alice", doc + answer, stand_in)  # under the opening: not kept
    assert short.ids("alice", doc + answer + more * 50, tokenizer.encode) == tokenizer.encode(
        doc + answer + more * 50
    )


def test_remembered_completion_texts_are_bounded_by_their_ids(
    tokenizer: DeepSeekTokenizer,
) -> None:
    memory = Continuations(max_tokens=100, opening_chars=8)
    texts = [f"document {n}: " + "figures " * 10 for n in range(5)]
    for n, text in enumerate(texts):
        memory.remember("alice", text, [n] * 40)  # 40 ids each: two fit
    recalled = [
        memory.ids("alice", t + "?", tokenizer.encode)[:40] == [n] * 40 for n, t in enumerate(texts)
    ]
    assert recalled == [False, False, False, True, True]
    memory.remember("alice", "too long " * 20, list(range(101)))  # more than the bound
    assert memory.ids("alice", "too long " * 21, tokenizer.encode) == tokenizer.encode(
        "too long " * 21
    )


def test_a_remembered_answer_stays_with_its_tenant_and_its_role(
    tokenizer: DeepSeekTokenizer,
) -> None:
    text = "Revenue rose."
    canonical = tokenizer.encode(text)
    generated = [canonical[0], *canonical]  # stand-in ids a fresh encoding never gives
    pieces = PieceCache()
    pieces.remember_answer("alice", text, generated)

    def rendered(scope: str, role: str) -> list[int]:
        msgs = [ChatMessage("user", "q"), ChatMessage(role, text), ChatMessage("user", "next")]
        return tokenizer.apply_chat_template(msgs, pieces=pieces, scope=scope)

    def plain(role: str) -> list[int]:
        msgs = [ChatMessage("user", "q"), ChatMessage(role, text), ChatMessage("user", "next")]
        return tokenizer.apply_chat_template(msgs)

    assert pieces.ids("alice", text, tokenizer.encode, answer=True) == generated
    with_answer = rendered("alice", "assistant")
    assert with_answer != plain("assistant")
    start = 3 + len(tokenizer.encode("q"))  # BOS, USER, "q", ASSISTANT
    assert with_answer[start : start + len(generated) + 1] == [*generated, tokenizer.eos_id]
    assert rendered("bob", "assistant") == plain("assistant")  # another tenant's answer
    assert rendered("alice", "user") == plain("user")  # the same text as a user message


@pytest.mark.slow  # it builds the model (about 10 s on a busy 2-core machine)
def test_the_store_thread_runs_niced(tokenizer: DeepSeekTokenizer) -> None:
    """Background stores take the CPU the requests leave (Linux: niceness per thread)."""
    engine = engine_for("mini-gqa")
    seen: list[int] = []

    class Recorder:
        def store(self, tenant: str, blocks: object, encoding: object = None) -> int:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return 0

    writer = BlockWriter(Recorder(), engine.adapter, ServerMetrics(), queue=2, nice=7)  # type: ignore[arg-type]
    try:
        seq = engine.new_sequence()
        ids = list(range(100, 100 + 2 * engine.adapter.block_tokens))
        engine.forward(seq, ids)
        chain = KeyChain(engine.fingerprint, tenant_salt("nice"))
        assert writer.submit(chain, ids, seq, 0, 2)
        assert writer.wait_idle(30)
    finally:
        writer.close()
    assert seen == [os.getpriority(os.PRIO_PROCESS, 0) + 7]
