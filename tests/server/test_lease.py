"""A prefill longer than the lease: the restored prefix is never another block's bytes.

A real sidecar (a small store, so freed space is written over at once) and the real
model server on a tiny model. A request restores a cached prefix and then prefills a
long suffix in small chunks, reading the restored prefix from the mapping at every
chunk, for many times the lease's TTL; meanwhile the prefix's blocks are deleted and
the store is filled anew. What a user would notice: the answer equals the answer of a
server without any cache. (Before, the lease ran out after its TTL, the blocks' space
was reused under the mapping after their checksums had passed, and the answer was
computed from other blocks' bytes.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from dscache_server.tokenizer import DeepSeekTokenizer
from dscache_sidecar.client import BlockData, SidecarClient
from dscache_tools.sidecarproc import SidecarProcess
from srv_helpers import LiveServer, make_runtime, random_text

from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint, tenant_salt

pytestmark = pytest.mark.slow

TTL_S = 1.1  # the server's shortest lease
PREFIX_TOKENS = 256  # 8 blocks of 32 tokens, 1 MiB of KV: a quarter of the store
CHUNK_FLOOR_S = 0.02  # the warm server's least time per prefill chunk


@pytest.fixture
def small_sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    daemon = SidecarProcess(tmp_path / "small", "--capacity", "4MiB", "--segment-size", "512KiB")
    daemon.start()
    yield daemon
    daemon.stop()


def _ask(srv: LiveServer, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=300)


def _churn(c: SidecarClient, until: threading.Event) -> int:
    """Writes fresh blocks of another tenant until ``until`` is set; how many."""
    layout = KVLayout(LayoutKind.GQA, 1, "float32", num_kv_heads=1, head_dim=8, v_head_dim=8)
    other = KeyChain(ModelFingerprint("churn", "r", layout, block_tokens=16), tenant_salt("x"))
    rng = np.random.default_rng(7)
    seed, stored = 0, 0
    while not until.is_set():
        keys = other.keys([int(t) for t in rng.integers(0, 1000, size=16 * 16)])
        blocks = [
            BlockData(k, keys[i - 1] if i else b"", rng.standard_normal(16384, dtype=np.float32))
            for i, k in enumerate(keys)
        ]
        stored += c.store(other.tenant, blocks)
        seed += 1
    return stored


def test_a_prefill_longer_than_the_lease_answers_as_a_cold_run(
    small_sidecar: SidecarProcess, tokenizer: DeepSeekTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = random_text(tokenizer, PREFIX_TOKENS + 8, seed=1)
    prefix = tokenizer.decode(tokenizer.encode(prefix)[:PREFIX_TOKENS])
    suffix = random_text(tokenizer, 1000, seed=2)
    cold = LiveServer(make_runtime(None, tokenizer))
    warm = LiveServer(
        make_runtime(
            small_sidecar,
            tokenizer,
            lease_ttl_s=TTL_S,
            prefill_chunk=4,  # the suffix takes hundreds of iterations
            min_cache_tokens=0,
        )
    )
    # Each chunk takes at least CHUNK_FLOOR_S, so the suffix's ~250 chunks outlast
    # 3 TTLs on any machine (a fast one prefilled them in under 3.3 s).
    batcher = warm.runtime.batcher
    prefill = batcher._prefill

    def slow_prefill(a: Any, budget: int) -> int:
        time.sleep(CHUNK_FLOOR_S)
        return prefill(a, budget)

    monkeypatch.setattr(batcher, "_prefill", slow_prefill)
    watcher = SidecarClient(small_sidecar.socket, data_dir=str(small_sidecar.data_dir))
    try:
        expected = _ask(cold, prefix + suffix)
        assert expected.status_code == 200, expected.text
        # Turn 1 stores the prefix's blocks.
        assert _ask(warm, prefix).status_code == 200
        assert warm.runtime.cache.wait_stored(60)
        chain = warm.runtime.chain_for("default")
        keys = chain.keys(tokenizer.encode(prefix)[:PREFIX_TOKENS])
        assert watcher.find(chain.tenant, keys).found == len(keys)

        answer: dict[str, httpx.Response] = {}
        turn = threading.Thread(target=lambda: answer.update(r=_ask(warm, prefix + suffix)))
        turn.start()
        deadline = time.monotonic() + 60
        while watcher.stats().active_leases == 0:  # turn 2 restored the prefix
            assert time.monotonic() < deadline and turn.is_alive(), "no lease was taken"
            time.sleep(0.005)
        time.sleep(3 * TTL_S)
        still_prefilling = turn.is_alive()
        # The prefix is deleted and the store written anew while turn 2 prefills on.
        watcher.delete(chain.tenant, keys)
        done = threading.Event()
        churned: list[int] = []
        churner = threading.Thread(target=lambda: churned.append(_churn(watcher, done)))
        churner.start()
        turn.join(300)
        done.set()
        churner.join(60)
    finally:
        watcher.close()
        warm.stop()
        cold.stop()
    assert still_prefilling, "the prefill ended before the lease's TTL: the test proves nothing"
    assert churned and churned[0] * 64 * 1024 > 4 * 1024 * 1024  # the store was rewritten
    got = answer["r"]
    assert got.status_code == 200, got.text
    usage = got.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix was restored
    assert got.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
