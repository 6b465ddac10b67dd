"""The engine thread: requests interleaved iteration by iteration, decoded in batches.

Real engine (mini-gqa), real tokenizer; the prefix cache without a store unless a
test needs the sidecar (then the real daemon). What a user notices: a request that
arrives while another one generates gets its answer without waiting for the other
to finish; batched and chunked runs give the tokens a lone run gives; a cancelled
or failing request stops alone; a corrupt cached block never reaches a token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from dscache_server.admission import CostModel
from dscache_server.batcher import Batcher
from dscache_server.cache import PrefixCache
from dscache_server.generate import GenerationRequest, GenerationResult, SamplingParams
from dscache_server.kvstore import SidecarBlockStore
from dscache_server.metrics import ServerMetrics
from dscache_server.tokenizer import DeepSeekTokenizer
from srv_helpers import SidecarDaemon, engine_for, random_text

from dscache.keys import KeyChain, tenant_salt

ALWAYS_PAYS = CostModel(1.0, 1e12, 0.0, 1)


def _batcher(
    tokenizer: DeepSeekTokenizer,
    *,
    prefill_chunk: int = 512,
    store: SidecarBlockStore | None = None,
) -> Batcher:
    engine = engine_for("mini-gqa")
    cache = PrefixCache(store, engine.adapter, ServerMetrics(), ALWAYS_PAYS, min_tokens=64)
    return Batcher(engine, tokenizer, cache, cache.metrics, prefill_chunk=prefill_chunk)


def _request(
    tokenizer: DeepSeekTokenizer, seed: int, tokens: int, max_tokens: int
) -> GenerationRequest:
    engine = engine_for("mini-gqa")
    ids = tokenizer.encode(random_text(tokenizer, tokens, seed=seed))[:tokens]
    chain = KeyChain(engine.fingerprint, tenant_salt("batcher"))
    return GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), chain)


def _run_alone(b: Batcher, req: GenerationRequest) -> GenerationResult:
    return b.submit(req).result(timeout=120)


@pytest.fixture
def batcher(tokenizer: DeepSeekTokenizer) -> Iterator[Callable[..., Batcher]]:
    made: list[Batcher] = []

    def make(prefill_chunk: int = 512) -> Batcher:
        b = _batcher(tokenizer, prefill_chunk=prefill_chunk)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.mark.slow
def test_batched_and_chunked_runs_give_the_tokens_of_a_lone_run(
    batcher: Callable[..., Batcher], tokenizer: DeepSeekTokenizer
) -> None:
    reqs = [_request(tokenizer, seed, 90 + 30 * seed, 12) for seed in range(4)]
    alone = batcher()
    expected = [_run_alone(alone, r).token_ids for r in reqs]
    together = batcher(prefill_chunk=40)  # prompts of 90-180 tokens: several chunks each
    futures = [together.submit(_request(tokenizer, s, 90 + 30 * s, 12)) for s in range(4)]
    got = [f.result(timeout=120).token_ids for f in futures]
    assert got == expected
    assert all(len(t) == 12 for t in got)
    reg = together.metrics.registry
    steps = reg.get_sample_value("dscache_server_decode_batch_size_count") or 0
    rows = reg.get_sample_value("dscache_server_decode_batch_size_sum") or 0
    batched = steps > 0 and rows > steps
    assert batched, "no decode step ran more than one request"


@pytest.mark.slow
def test_a_short_request_does_not_wait_for_a_long_one_to_finish(
    batcher: Callable[..., Batcher], tokenizer: DeepSeekTokenizer
) -> None:
    b = batcher()
    decoding = threading.Event()
    long = b.submit(_request(tokenizer, 1, 100, 200), lambda _delta: decoding.set())
    assert decoding.wait(60)  # the long one has sent text: it is decoding now
    short: Future[GenerationResult] = b.submit(_request(tokenizer, 2, 100, 2))
    result = short.result(timeout=120)
    assert not long.done(), "the short request waited for the long one to finish"
    assert result.completion_tokens == 2
    # Its time to first token is its own work plus at most a few iterations of waiting.
    assert result.timings["queue"] < result.ttft_s
    assert long.result(timeout=120).completion_tokens == 200


@pytest.mark.slow
def test_cancelled_request_stops_and_the_others_go_on(
    batcher: Callable[..., Batcher], tokenizer: DeepSeekTokenizer
) -> None:
    b = batcher()
    doomed_req = _request(tokenizer, 3, 80, 400)
    doomed = b.submit(doomed_req)
    other = b.submit(_request(tokenizer, 4, 80, 30))
    time.sleep(0.2)
    doomed_req.cancelled.set()
    got = doomed.result(timeout=120)
    assert got.finish_reason == "cancelled" and got.completion_tokens < 400
    assert other.result(timeout=120).completion_tokens == 30


@pytest.mark.slow
def test_a_failing_request_fails_alone(
    batcher: Callable[..., Batcher], tokenizer: DeepSeekTokenizer
) -> None:
    b = batcher()
    bad = _request(tokenizer, 5, 80, 4)
    bad.token_ids = [*bad.token_ids[:-1], 10**9]  # an id outside the vocabulary
    good = b.submit(_request(tokenizer, 6, 80, 4))
    failed = b.submit(bad)
    with pytest.raises(IndexError):
        failed.result(timeout=120)
    assert good.result(timeout=120).completion_tokens == 4
    assert b.submit(_request(tokenizer, 7, 80, 3)).result(timeout=120).completion_tokens == 3


@pytest.mark.slow
def test_timings_cover_the_path_to_the_first_token(
    batcher: Callable[..., Batcher], tokenizer: DeepSeekTokenizer
) -> None:
    r = _run_alone(batcher(), _request(tokenizer, 8, 120, 3))
    t = r.timings
    for phase in ("queue", "lookup", "lease", "map_verify", "prefill", "first_decode", "ttft"):
        assert phase in t and t[phase] >= 0
    path = t["queue"] + t["lookup"] + t["lease"] + t["map_verify"] + t["prefill"]
    assert path <= t["ttft"] + 1e-3
    assert t["prefill"] > 0


@pytest.mark.slow
def test_close_lets_running_requests_finish_and_refuses_new_ones(
    tokenizer: DeepSeekTokenizer,
) -> None:
    b = _batcher(tokenizer)
    running = b.submit(_request(tokenizer, 9, 80, 20))
    b.close()
    assert running.result(timeout=1).completion_tokens == 20
    late = b.submit(_request(tokenizer, 10, 80, 2))
    with pytest.raises(RuntimeError, match="shutting down"):
        late.result(timeout=10)


def test_a_block_corrupted_on_disk_is_recomputed_before_the_first_token(
    sidecar: SidecarDaemon, tokenizer: DeepSeekTokenizer
) -> None:
    """The checksums are checked while the prefill runs; a mismatch sends the request
    back to a full recompute before it samples, so its answer is the cache-off one."""
    engine = engine_for("mini-gqa")
    store = SidecarBlockStore(sidecar.socket, data_dir=str(sidecar.data_dir))
    b = _batcher(tokenizer, store=store)
    try:
        req = _request(tokenizer, 11, 200, 6)
        first = b.submit(req).result(timeout=120)
        assert first.cached_tokens == 0
        assert b.cache.wait_stored(30)
        again = b.submit(_request(tokenizer, 11, 200, 6)).result(timeout=120)
        assert again.cached_tokens > 0 and again.token_ids == first.token_ids
        # Flip one byte in the middle of the second stored block.
        chain = KeyChain(engine.fingerprint, tenant_salt("batcher"))
        keys = chain.keys(req.token_ids)
        client = store._get_client()
        grant = client.lease(chain.tenant, keys[:2])
        assert grant is not None and len(grant.blocks) == 2
        loc = grant.blocks[1]
        client.map_lease(grant, verify=False).release()
        path = Path(sidecar.data_dir) / loc.segment
        with open(path, "r+b") as f:
            f.seek(loc.offset + 1000)
            byte = f.read(1)
            f.seek(loc.offset + 1000)
            f.write(bytes([byte[0] ^ 0x40]))
        corrupt = b.cache.metrics.fallbacks.labels(reason="corrupt")
        before = corrupt._value.get()
        third = b.submit(_request(tokenizer, 11, 200, 6)).result(timeout=120)
        assert third.token_ids == first.token_ids
        assert third.cached_tokens == 0 and third.fallback == "corrupt"
        assert corrupt._value.get() == before + 1
        # The daemon re-checked the report, dropped the block and counted it.
        assert client.stats().checksum_failures >= 1
        assert b.cache.wait_stored(30)  # the recomputed blocks are stored again ...
        fourth = b.submit(_request(tokenizer, 11, 200, 6)).result(timeout=120)
        assert fourth.cached_tokens > 0 and fourth.token_ids == first.token_ids  # ... and hit
    finally:
        b.close()
        b.cache.close()
