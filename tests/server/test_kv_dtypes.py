"""Half-precision KV end to end: the engine in bfloat16 or float16 caches its KV in
that dtype, through the real sidecar, for GQA and MLA.

What a user relies on: a cached token costs half the bytes of float32, a restored
block holds exactly the bytes a recompute of the prompt that stored it gives, the key tells the
dtypes apart (a float32 block never serves a bfloat16 engine), and the cached path
answers as a recompute does, to the dtype's rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import httpx
import numpy as np
import pytest
import torch
from dscache_server.admission import CostModel
from dscache_server.cache import PrefixCache
from dscache_server.kv import LayoutAdapter
from dscache_server.kvstore import SidecarBlockStore
from dscache_server.loading import load_engine
from dscache_server.metrics import ServerMetrics
from srv_helpers import BLOCK_TOKENS, LiveServer, SidecarDaemon, engine_for

from dscache.keys import KeyChain, tenant_salt

ALWAYS_PAYS = CostModel(1.0, 1e12, 0.0, 1)
CASES = [(p, d) for p in ("tiny-gqa", "tiny-deepseek-v3") for d in ("bfloat16", "float16")]


def ids_for(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 120_000, size=n)]


@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_half_precision_blocks_are_half_the_bytes_and_recompute_exactly(
    preset: str, dtype: str, sidecar: SidecarDaemon
) -> None:
    engine = engine_for(preset, dtype=dtype)
    exact = engine_for(preset)
    assert engine.layout.dtype == dtype
    assert engine.fingerprint.digest() != exact.fingerprint.digest()  # never mixed
    full_bytes = int(np.prod(exact.adapter.block_shape)) * exact.adapter.dtype.itemsize
    assert int(np.prod(engine.adapter.block_shape)) * engine.adapter.dtype.itemsize * 2 == (
        full_bytes
    )

    store = SidecarBlockStore(sidecar.socket, data_dir=str(sidecar.data_dir))
    cache = PrefixCache(store, engine.adapter, ServerMetrics(), ALWAYS_PAYS, min_tokens=64)
    chain = KeyChain(engine.fingerprint, tenant_salt(f"dtype-{dtype}"))
    ids = ids_for(3 * BLOCK_TOKENS + 17, seed=31)
    first = engine.new_sequence()
    engine.forward(first, ids[: 3 * BLOCK_TOKENS + 2])
    assert cache.store_async(chain, ids[: 3 * BLOCK_TOKENS + 2], first, 0)
    assert cache.wait_stored(60)

    seq = engine.new_sequence()
    restored = cache.restore(chain, ids, seq)
    try:
        assert restored.fallback is None and seq.restored_tokens == 3 * BLOCK_TOKENS
        # The blocks read back are the very bytes a recompute of the stored prompt gives.
        # The same prompt, not a shorter one: oneDNN's bfloat16 kernels on an AMX
        # Xeon round by the matrix shape, so a 96-token forward's KV differs from a
        # 98-token one's by a rounding step in 13-15% of the values of its later
        # blocks (measured; equal where the CPU has no AMX, and with oneDNN off).
        again = engine.new_sequence()
        engine.forward(again, ids[: 3 * BLOCK_TOKENS + 2])
        loaded = restored._loaded
        assert loaded is not None
        for i, arr in enumerate(loaded.arrays[:3]):
            assert arr.dtype == engine.adapter.dtype
            np.testing.assert_array_equal(np.asarray(arr), engine.adapter.export(again, i))
        cached = engine.forward(seq, ids[seq.restored_tokens :]).float()
        assert cache.confirm(restored)
        full = engine.forward(engine.new_sequence(), ids).float()
        # Same answer as the recompute, to the dtype's rounding.
        assert int(torch.argmax(cached)) == int(torch.argmax(full))
        scale = float(full.abs().max())
        assert float((cached - full).abs().max()) <= 0.05 * scale
    finally:
        restored.release()
        cache.close()


def test_a_float32_block_never_serves_a_bfloat16_engine(sidecar: SidecarDaemon) -> None:
    exact, half = engine_for("tiny-gqa"), engine_for("tiny-gqa", dtype="bfloat16")
    ids = ids_for(2 * BLOCK_TOKENS + 5, seed=41)
    store = SidecarBlockStore(sidecar.socket, data_dir=str(sidecar.data_dir))
    writer = PrefixCache(store, exact.adapter, ServerMetrics(), ALWAYS_PAYS, min_tokens=64)
    tenant = tenant_salt("mixed")
    seq = exact.new_sequence()
    exact.forward(seq, ids)
    assert writer.store_async(KeyChain(exact.fingerprint, tenant), ids, seq, 0)
    assert writer.wait_stored(60)
    half_keys = KeyChain(half.fingerprint, tenant).keys(ids[: 2 * BLOCK_TOKENS])
    assert store.lookup(KeyChain(half.fingerprint, tenant).tenant, half_keys) == 0
    writer.close()


@pytest.mark.slow
def test_the_engine_refuses_a_kv_dtype_it_cannot_keep() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_engine("tiny-gqa", dtype="int8")
    layout = engine_for("tiny-gqa").layout
    bad = dataclasses.replace(layout, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="caches float32, float16, bfloat16 KV"):
        LayoutAdapter(bad, BLOCK_TOKENS)


def test_a_bfloat16_server_reuses_the_first_turn_over_http(
    live_server: Callable[..., LiveServer],
) -> None:
    srv = live_server(dtype="bfloat16")
    assert srv.runtime.engine.layout.dtype == "bfloat16"
    prompt = ids_for(3 * BLOCK_TOKENS + 9, seed=51)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        first = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert first.status_code == 200, first.text
        assert srv.runtime.cache.wait_stored(30)
        again = c.post("/v1/completions", json={"prompt": [*prompt, 7, 8], "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK_TOKENS
    assert srv.metric("dscache_server_cache_fallbacks_total") == 0
