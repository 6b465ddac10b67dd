"""``dscache bench codec``: the whole bench once (--quick) on the trained models.

What a user relies on: the JSON carries the command contract (``codecs`` with
fp32, bf16, int8 and zstd, each with ``bytes_ratio``, ``perplexity_delta`` and
``greedy_agreement``); the byte figures are what the codecs promise (bf16 half,
int8 about a quarter, zstd never more than raw); lossless codecs change nothing a
model computes; int8's loss is small; a smaller KV keeps more of the working set.
The quality thresholds here are loose on purpose (a short training budget on a
shared machine): the README reports the full run's figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import run_quick_bench


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_quick_codec_bench_reports_every_codec(tmp_path: Path) -> None:
    out, png = tmp_path / "codec.json", tmp_path / "codec.png"
    doc, printed = run_quick_bench("codec", out, 1700, "--png", str(png))
    codecs = {c["name"]: c for c in doc["codecs"]}
    assert {"fp32", "bf16", "int8", "zstd"} <= codecs.keys()
    for c in codecs.values():
        assert {"name", "bytes_ratio", "perplexity_delta", "greedy_agreement"} <= c.keys()
    assert codecs["fp32"]["bytes_ratio"] == 1.0
    assert codecs["bf16"]["bytes_ratio"] == 0.5
    assert 0.25 < codecs["int8"]["bytes_ratio"] <= 0.27
    assert codecs["zstd"]["bytes_ratio"] <= 1.0
    # Lossless: the restored prefix gives the reference's very logits.
    for name in ("fp32", "zstd", "zstd-bf16"):
        assert codecs[name]["perplexity_delta"] == 0.0, name
        assert codecs[name]["greedy_agreement"] == 1.0, name
    assert abs(codecs["int8"]["perplexity_delta"]) < 0.05
    assert codecs["int8"]["greedy_agreement"] > 0.9
    for m in doc["models"]:
        # The models learned something (quality figures on random weights mean nothing).
        assert m["trained"]["heldout_perplexity"] < m["trained"]["initial_heldout_perplexity"] / 4
        assert m["bf16_kv_equals_bf16_recompute"] is True
    ws = doc["working_set"]["variants"]
    assert ws["int8"]["blocks_fit"] > 3.5 * ws["fp32"]["blocks_fit"]
    assert ws["int8"]["token_hit_ratio"] >= ws["fp32"]["token_hit_ratio"]
    assert png.stat().st_size > 10_000
    assert "int8" in printed and "working set" in printed
