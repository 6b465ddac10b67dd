"""Exactness of the cached path: restored prefix + suffix prefill == full recompute.

Both presets, through the real sidecar daemon (real gRPC, LMDB, segment files and
mmap), including a prefix stored by another server process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from dscache_server.admission import CostModel
from dscache_server.cache import PrefixCache
from dscache_server.engine import TransformersEngine
from dscache_server.kvstore import SidecarBlockStore
from dscache_server.metrics import ServerMetrics
from srv_helpers import BLOCK_TOKENS, REPO, SidecarDaemon, engine_for, free_port

from dscache.keys import KeyChain, tenant_salt

PRESETS = ["tiny-gqa", "tiny-deepseek-v3"]
ALWAYS_PAYS = CostModel(
    prefill_tokens_per_s=1.0, load_bytes_per_s=1e12, lookup_overhead_s=0.0, bytes_per_token=1
)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 120_000, size=n)]


def make_cache(engine: TransformersEngine, sidecar: SidecarDaemon) -> PrefixCache:
    store = SidecarBlockStore(sidecar.socket, data_dir=str(sidecar.data_dir))
    return PrefixCache(store, engine.adapter, ServerMetrics(), ALWAYS_PAYS, min_tokens=64)


def greedy(engine: TransformersEngine, seq: object, logits: torch.Tensor, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        token = int(torch.argmax(logits))
        out.append(token)
        logits = engine.forward(seq, [token])  # type: ignore[arg-type]
    return out


def assert_exact_after_restore(
    engine: TransformersEngine, cache: PrefixCache, chain: KeyChain, ids: list[int], blocks: int
) -> None:
    seq = engine.new_sequence()
    restored = cache.restore(chain, ids, seq)
    try:
        assert restored.fallback is None
        assert seq.restored_tokens == blocks * BLOCK_TOKENS
        cached_logits = engine.forward(seq, ids[seq.restored_tokens :])
        full_seq = engine.new_sequence()
        full_logits = engine.forward(full_seq, ids)
        diff = float((cached_logits - full_logits).abs().max())
        assert diff <= 1e-4, diff
        cached_tokens = greedy(engine, seq, cached_logits, 32)
        full_tokens = greedy(engine, full_seq, full_logits, 32)
        assert cached_tokens == full_tokens
        assert len(set(full_tokens)) > 4  # a real sequence, not one repeated token
    finally:
        restored.release()


@pytest.mark.parametrize("preset", PRESETS)
def test_restored_prefix_matches_full_recompute(preset: str, sidecar: SidecarDaemon) -> None:
    engine = engine_for(preset)
    cache = make_cache(engine, sidecar)
    chain = KeyChain(engine.fingerprint, tenant_salt("exactness"))
    ids = prompt_ids(4 * BLOCK_TOKENS + 19, seed=11)
    first_turn = ids[: 4 * BLOCK_TOKENS + 3]
    seq = engine.new_sequence()
    engine.forward(seq, first_turn)
    assert cache.store_async(chain, first_turn, seq, 0)
    assert cache.wait_stored(60)
    assert_exact_after_restore(engine, cache, chain, ids, blocks=4)
    cache.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_prefix_stored_by_another_server_process(preset: str, sidecar: SidecarDaemon) -> None:
    port = free_port()
    log_path = Path(sidecar.data_dir).parent / f"server-{preset}.log"
    cmd = [
        sys.executable, "-m", "dscache.cli", "server",
        "--model", preset,
        "--block-tokens", str(BLOCK_TOKENS),
        "--min-cache-tokens", "64",
        "--sidecar-socket", sidecar.socket,
        "--sidecar-data-dir", str(sidecar.data_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--threads", "1",
        "--no-calibrate",
        "--admission-refit", "0",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        # The tenant header counts only from a gateway holding the secret.
        env = {**os.environ, "DSCACHE_SERVER_GATEWAY_SECRET": "exactness-gateway"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.5)
        ids = prompt_ids(3 * BLOCK_TOKENS + 21, seed=23)
        engine = engine_for(preset)
        cache = make_cache(engine, sidecar)
        chain = KeyChain(engine.fingerprint, tenant_salt("tenant:xproc"))
        keys = chain.keys(ids[: 3 * BLOCK_TOKENS])
        assert cache.store is not None
        # The other process stores in the background. On a loaded machine one of its
        # sidecar calls can miss its deadline (the request then recomputes and the
        # cache is skipped for a cool-down), so a second request may be needed.
        for _attempt in range(3):
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": ids[: 3 * BLOCK_TOKENS + 5], "max_tokens": 1},
                headers={
                    "X-Dscache-Tenant": "xproc",
                    "X-Dscache-Gateway-Token": "exactness-gateway",
                },
                timeout=120,
            )
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 20
            while cache.store.lookup(chain.tenant, keys) < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
            if cache.store.lookup(chain.tenant, keys) == 3:
                break
            time.sleep(3)  # past the server's circuit-breaker cool-down
        assert cache.store.lookup(chain.tenant, keys) == 3, "the other process never stored it"
        assert_exact_after_restore(engine, cache, chain, ids, blocks=3)
        cache.close()
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow  # builds the models
@pytest.mark.parametrize("preset", PRESETS)
def test_scoring_every_position_in_one_forward_matches_a_token_at_a_time(preset: str) -> None:
    """``forward_all`` (the codec bench's teacher forcing) gives, row by row, the
    logits that feeding the same tokens one at a time gives."""
    engine = engine_for(preset)
    ids = prompt_ids(3 * BLOCK_TOKENS, seed=5)
    prefix, scored = ids[: 2 * BLOCK_TOKENS], ids[2 * BLOCK_TOKENS :]
    every_seq, step_seq = engine.new_sequence(), engine.new_sequence()
    engine.extend(every_seq, prefix)
    engine.extend(step_seq, prefix)
    every = engine.forward_all(every_seq, scored)
    assert every.shape == (len(scored), engine.hf_model.config.vocab_size)
    assert every_seq.length == step_seq.length + len(scored)
    steps = torch.stack([engine.forward(step_seq, [t]) for t in scored])
    assert float((every - steps).abs().max()) <= 1e-4
    assert every_seq.length == step_seq.length
    # The sequences now hold the same KV: the next token scores alike.
    nxt = engine.forward(every_seq, [7]), engine.forward(step_seq, [7])
    assert float((nxt[0] - nxt[1]).abs().max()) <= 1e-4
