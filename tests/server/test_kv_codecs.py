"""Store codecs a deployment chooses (``--store-compress``): int8 KV and adaptive zstd.

What a user relies on: an int8 deployment keeps about a quarter of the float32 bytes
per cached token and still reuses its prefixes; its blocks never serve an exact
deployment of the same model (nor the other way round); ``auto`` compresses only
long prompts whose text repeats, at a level the free CPU allows, and says why in
its metrics.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import pytest
from dscache_server.storecodec import AdaptiveZstd, StorePolicy, repetition
from dscache_sidecar.client import RAW, Codec, Encoding
from prometheus_client import CollectorRegistry, Counter
from srv_helpers import BLOCK_TOKENS, LiveServer, SidecarDaemon

from dscache.keys import KeyChain, tenant_salt, with_kv_codec


def ids_for(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 120_000, size=n)]


def _complete(c: httpx.Client, prompt: list[int]) -> dict[str, object]:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body: dict[str, object] = r.json()
    return body


@pytest.mark.parametrize("model", ["mini-gqa", "tiny-deepseek-v3"])
def test_an_int8_server_reuses_prefixes_at_a_quarter_of_the_bytes(
    model: str, live_server: Callable[..., LiveServer], sidecar: SidecarDaemon
) -> None:
    srv = live_server(model=model, store_compress="int8")
    exact_fp = srv.runtime.engine.fingerprint
    assert srv.runtime.fingerprint.extra["kv_codec"] == "int8"
    assert srv.runtime.fingerprint.digest() != exact_fp.digest()
    prompt = ids_for(3 * BLOCK_TOKENS + 9, seed=61)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        _complete(c, prompt)
        assert srv.runtime.cache.wait_stored(30)
        again = _complete(c, [*prompt, 7, 8])
    usage = again["usage"]
    assert isinstance(usage, dict)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK_TOKENS
    assert srv.metric("dscache_server_cache_fallbacks_total") == 0
    assert srv.metric("dscache_server_store_codec_total", codec="int8", reason="fixed") >= 1
    # On the sidecar: int8 values + a float16 scale per row, not the float32 bytes.
    store = srv.runtime.cache.store
    assert store is not None
    chain = srv.runtime.chain_for("default")
    keys = chain.keys(prompt[: 3 * BLOCK_TOKENS])
    assert store.lookup(chain.tenant, keys) == 3
    loaded = store.load(chain.tenant, keys, ttl_s=10)
    try:
        adapter = srv.runtime.engine.adapter
        assert all(a.dtype == adapter.dtype for a in loaded.arrays)  # dequantized on load
    finally:
        loaded.release()
    # The exact keys of the same prompt find nothing: int8 blocks never serve an
    # exact deployment.
    exact = KeyChain(exact_fp, tenant_salt("default", b""))
    assert store.lookup(exact.tenant, exact.keys(prompt[: 3 * BLOCK_TOKENS])) == 0


def test_int8_and_exact_servers_on_one_sidecar_never_share_blocks(
    live_server: Callable[..., LiveServer],
) -> None:
    lossy = live_server(store_compress="int8")
    exact = live_server(store_compress="raw")
    prompt = ids_for(2 * BLOCK_TOKENS + 3, seed=71)
    with httpx.Client(base_url=lossy.url, timeout=120) as c:
        _complete(c, prompt)
        assert lossy.runtime.cache.wait_stored(30)
    with httpx.Client(base_url=exact.url, timeout=120) as c:
        body = _complete(c, [*prompt, 5])
    usage = body["usage"]
    assert isinstance(usage, dict)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert with_kv_codec(exact.runtime.fingerprint, "zstd") == exact.runtime.fingerprint


def test_repetition_counts_ngrams_seen_earlier_in_the_window() -> None:
    assert repetition(list(range(1000))) == 0.0
    assert repetition([1, 2, 3, 4] * 250) > 0.99
    half = list(range(500)) + list(range(500))
    assert repetition(half) == pytest.approx(0.5, abs=0.01)
    assert repetition(half, window=500) == 0.0  # the repeat lies outside the window
    assert repetition([1, 2]) == 0.0


def test_adaptive_zstd_compresses_long_repetitive_prompts_at_the_level_the_cpu_allows() -> None:
    counter = Counter("d", "d", ("codec", "reason"), registry=CollectorRegistry())
    headroom = [1.0]
    policy = StorePolicy(
        "auto",
        adaptive=AdaptiveZstd(min_tokens=1000),
        headroom=lambda: headroom[0],
        decisions=counter,
    )
    repetitive = list(range(100)) * 20  # 2000 tokens, 95% repeated 4-grams
    assert policy.choose(repetitive[:500]) == RAW  # short
    assert policy.choose(list(range(2000))) == RAW  # never repeats
    assert policy.choose(repetitive) == Encoding(None, 3)
    headroom[0] = 0.4
    assert policy.choose(repetitive) == Encoding(None, 1)
    headroom[0] = 0.2
    assert policy.choose(repetitive) == Encoding(None, -1)
    headroom[0] = 0.05
    assert policy.choose(repetitive) == RAW  # no CPU to spare

    def count(codec: str, reason: str) -> float:
        return counter.labels(codec=codec, reason=reason)._value.get()

    assert count("raw", "short") == 1 and count("raw", "low_repetition") == 1
    assert count("sample", "chosen") == 3 and count("raw", "no_headroom") == 1
    fixed = StorePolicy("int8")
    assert fixed.choose(repetitive) == Encoding(Codec.INT8_ROWS)


def test_an_auto_server_says_why_it_left_a_prompt_raw(
    live_server: Callable[..., LiveServer],
) -> None:
    srv = live_server(store_compress="auto", zstd_min_tokens=2 * BLOCK_TOKENS)
    short = ids_for(BLOCK_TOKENS + 3, seed=81)
    varied = ids_for(3 * BLOCK_TOKENS, seed=82)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        _complete(c, short * 2)  # 2 blocks + a bit, every n-gram of the second half repeats
        _complete(c, varied)
        assert srv.runtime.cache.wait_stored(30)
        again = _complete(c, [*varied, 9])
    usage = again["usage"]
    assert isinstance(usage, dict)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK_TOKENS
    assert srv.metric("dscache_server_store_codec_total", reason="low_repetition") >= 1
    chosen = srv.metric("dscache_server_store_codec_total", reason="chosen")
    no_cpu = srv.metric("dscache_server_store_codec_total", reason="no_headroom")
    assert chosen + no_cpu == 1  # the repetitive prompt: compressed unless the CPU is busy
