"""Generated tokens are cached: the next turn finds the previous answer's KV.

Real engines (GQA and DeepSeek MLA), the real sidecar daemon, the real HTTP server.
What a user notices: a conversation that sends back the answer it was given is served
from the cache up to the end of that answer, and its next answer is the one a full
recompute gives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import openai
import pytest
from dscache_server.admission import CostModel
from dscache_server.auth import tenant_from_api_key
from dscache_server.batcher import Batcher
from dscache_server.cache import PrefixCache
from dscache_server.generate import GenerationRequest, GenerationResult, SamplingParams
from dscache_server.kvstore import SidecarBlockStore
from dscache_server.metrics import ServerMetrics
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_tools.bench.respell import spelled_apart
from srv_helpers import BLOCK_TOKENS, LiveServer, SidecarDaemon, engine_for, random_text

from dscache.keys import KeyChain, tenant_salt

pytestmark = pytest.mark.slow  # each test builds a model and starts a sidecar

ALWAYS_PAYS = CostModel(1.0, 1e12, 0.0, 1)


def random_ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 120_000, size=n)]


@pytest.fixture
def batchers(
    sidecar: SidecarDaemon, tokenizer: DeepSeekTokenizer
) -> Iterator[Callable[[str, bool], Batcher]]:
    made: list[Batcher] = []

    def make(preset: str, cached: bool) -> Batcher:
        engine = engine_for(preset)
        store = (
            SidecarBlockStore(sidecar.socket, data_dir=str(sidecar.data_dir)) if cached else None
        )
        cache = PrefixCache(store, engine.adapter, ServerMetrics(), ALWAYS_PAYS, min_tokens=64)
        b = Batcher(engine, tokenizer, cache, cache.metrics)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()
        b.cache.close()


def run(b: Batcher, chain: KeyChain, ids: list[int], max_tokens: int) -> GenerationResult:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return b.run(GenerationRequest(list(ids), params, chain))


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-deepseek-v3"])
def test_the_next_turn_restores_the_answer_and_answers_as_a_recompute(
    preset: str, batchers: Callable[[str, bool], Batcher]
) -> None:
    cached = batchers(preset, True)
    engine = cached.engine
    chain = KeyChain(engine.fingerprint, tenant_salt(f"generated-{preset}"))
    prompt = random_ids(100, seed=1)
    first = run(cached, chain, prompt, max_tokens=40)
    assert first.finish_reason == "length" and first.completion_tokens == 40
    assert cached.cache.wait_stored(30)

    # The client sends the answer back with a new question.
    follow_up = [*prompt, *first.token_ids, *random_ids(30, seed=2)]
    second = run(cached, chain, follow_up, max_tokens=12)
    # Decoding fed back every generated token but the last: those blocks are cached.
    fed = len(prompt) + len(first.token_ids) - 1
    assert second.cached_tokens == (fed // BLOCK_TOKENS) * BLOCK_TOKENS
    assert second.cached_tokens > (len(prompt) // BLOCK_TOKENS) * BLOCK_TOKENS
    assert second.fallback is None

    recompute = run(batchers(preset, False), chain, follow_up, max_tokens=12)
    assert recompute.cached_tokens == 0
    assert second.token_ids == recompute.token_ids


def test_a_chat_that_sends_back_its_answer_is_cached_through_the_answer(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    history = [{"role": "user", "content": random_text(tokenizer, 120, seed=3)}]
    first = c.chat.completions.create(
        model="mini-gqa", messages=history, max_tokens=48, temperature=0.0
    )
    assert first.usage is not None and first.usage.completion_tokens == 48
    answer = first.choices[0].message.content or ""
    assert srv.runtime.cache.wait_stored(30)
    history += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": random_text(tokenizer, 20, seed=4)},
    ]
    second = c.chat.completions.create(
        model="mini-gqa", messages=history, max_tokens=4, temperature=0.0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    fed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    # Cached into the answer's blocks, not only the first prompt's: the prompt is
    # rendered with the generated ids that spell the answer (this random model's
    # answer holds a special token the text drops, so not all of them), whatever a
    # fresh encoding of the text would have split differently.
    assert (first.usage.prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS < cached
    assert cached <= (fed // BLOCK_TOKENS) * BLOCK_TOKENS


def test_a_completion_continued_by_its_client_is_cached_through_the_answer(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    """/v1/completions: a client that sends back the text it was given with more is
    served from the cache into the answer's blocks (the prompt keeps the ids the model
    saw and generated), and another tenant sending the same text is not."""
    srv = live_server()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    prompt = random_text(tokenizer, 120, seed=5)
    first = c.completions.create(model="mini-gqa", prompt=prompt, max_tokens=48, temperature=0.0)
    assert first.usage is not None and first.usage.completion_tokens == 48
    answer = first.choices[0].text
    assert srv.runtime.cache.wait_stored(30)
    text = prompt + answer + random_text(tokenizer, 20, seed=6)
    second = c.completions.create(model="mini-gqa", prompt=text, max_tokens=4, temperature=0.0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    fed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert (first.usage.prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS < cached
    assert cached <= (fed // BLOCK_TOKENS) * BLOCK_TOKENS


def test_a_restarted_server_follows_the_tokenization_another_process_cached(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    """A text whose KV another server process stored under other token ids (a model's
    generated ids, which encoding the text again would split differently) is served
    from the cache on a server that never saw those ids: after a restart, or on
    another pod that shares the node's store. Its next turn finds the new blocks too."""
    text = random_text(tokenizer, 200, seed=11)
    canonical = tokenizer.encode(text)
    generated = spelled_apart(tokenizer, canonical, 70, 110)
    assert generated != canonical and tokenizer.decode(generated) == text
    first = live_server()
    c = openai.OpenAI(base_url=first.url + "/v1", api_key="k", max_retries=0)
    c.completions.create(model="mini-gqa", prompt=generated, max_tokens=1, temperature=0.0)
    assert first.runtime.cache.wait_stored(30)
    first.stop()
    stored = (len(generated) // BLOCK_TOKENS) * BLOCK_TOKENS

    restarted = live_server()
    chain, store = (
        restarted.runtime.chain_for(tenant_from_api_key("k")),
        restarted.runtime.cache.store,
    )
    assert store is not None
    # Encoding the text again finds only the blocks before the first one spelled apart.
    assert store.lookup(chain.tenant, chain.keys(canonical)) == 70 // BLOCK_TOKENS
    c = openai.OpenAI(base_url=restarted.url + "/v1", api_key="k", max_retries=0)
    more = text + random_text(tokenizer, 40, seed=12)
    second = c.completions.create(model="mini-gqa", prompt=more, max_tokens=1, temperature=0.0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == stored
    followed = stored - (70 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert restarted.metric("dscache_server_respelled_tokens_total") == followed
    assert restarted.runtime.cache.wait_stored(30)
    # The next turn: through the blocks this server stored after the followed ones.
    turn = more + random_text(tokenizer, 40, seed=13)
    third = c.completions.create(model="mini-gqa", prompt=turn, max_tokens=1, temperature=0.0)
    assert third.usage is not None and third.usage.prompt_tokens_details is not None
    assert third.usage.prompt_tokens_details.cached_tokens == (
        (second.usage.prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS
    )
    # Another tenant sending the same text follows nothing of this one's.
    other = openai.OpenAI(base_url=restarted.url + "/v1", api_key="other", max_retries=0)
    theirs = other.completions.create(model="mini-gqa", prompt=more, max_tokens=1)
    assert theirs.usage is not None and theirs.usage.prompt_tokens_details is not None
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0


def test_a_chat_continued_on_a_fresh_server_follows_its_stored_answer(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    """The chat form: an assistant message whose KV was stored under the ids a model
    generated (here: spelled apart) is found again by a server that never gave it,
    up to the end of the stored blocks, turn markers and all."""
    messages = [
        {"role": "user", "content": random_text(tokenizer, 80, seed=14)},
        {"role": "assistant", "content": random_text(tokenizer, 80, seed=15)},
        {"role": "user", "content": random_text(tokenizer, 30, seed=16)},
    ]
    chat = [ChatMessage(m["role"], m["content"]) for m in messages]
    canonical = tokenizer.apply_chat_template(chat)
    answer_at = len(tokenizer.apply_chat_template(chat[:1])) + 1  # after its marker
    generated = spelled_apart(tokenizer, canonical, answer_at + 20, answer_at + 60)
    first = live_server()
    c = openai.OpenAI(base_url=first.url + "/v1", api_key="k", max_retries=0)
    c.completions.create(model="mini-gqa", prompt=generated, max_tokens=1, temperature=0.0)
    assert first.runtime.cache.wait_stored(30)
    first.stop()

    fresh = live_server()
    c = openai.OpenAI(base_url=fresh.url + "/v1", api_key="k", max_retries=0)
    turn = c.chat.completions.create(
        model="mini-gqa", messages=messages, max_tokens=1, temperature=0.0
    )
    assert turn.usage is not None and turn.usage.prompt_tokens_details is not None
    cached = turn.usage.prompt_tokens_details.cached_tokens or 0
    assert cached == ((len(generated) - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
    assert cached > ((answer_at + 20) // BLOCK_TOKENS) * BLOCK_TOKENS  # past the split

    # A conversation this server carries on itself does not ask the store what lies
    # below its prefix: its stored chain ends where the new message starts.
    store = fresh.runtime.cache.store
    asked: list[bytes] = []
    descendants = store.descendants  # type: ignore[union-attr]

    def counted(tenant: str, key: bytes, *a: Any, **kw: Any) -> Any:
        asked.append(key)
        return descendants(tenant, key, *a, **kw)

    store.descendants = counted  # type: ignore[union-attr]
    own = [{"role": "user", "content": random_text(tokenizer, 90, seed=17)}]
    for seed in (18, 19):
        answer = c.chat.completions.create(
            model="mini-gqa", messages=own, max_tokens=40, temperature=0.0
        )
        assert fresh.runtime.cache.wait_stored(30)
        own += [
            {"role": "assistant", "content": answer.choices[0].message.content or ""},
            {"role": "user", "content": random_text(tokenizer, 30, seed=seed)},
        ]
    last = c.chat.completions.create(model="mini-gqa", messages=own, max_tokens=1)
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert (last.usage.prompt_tokens_details.cached_tokens or 0) > 0
    assert asked == []
