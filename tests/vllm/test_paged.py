"""vLLM's CPU paged KV read and written in dscache's block layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dscache_vllm.paged import LayoutError, PagedKV

LAYERS, HEADS, HEAD = 3, 2, 8


def cache(pages: int, page_tokens: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per-layer tensors in the CPU backend's allocation shape, filled with distinct values."""
    out = []
    for layer in range(LAYERS):
        t = torch.arange(pages * HEADS * page_tokens * 2 * HEAD, dtype=torch.float32)
        out.append((t + layer * 1e6).to(dtype).view(pages, HEADS, page_tokens, 2 * HEAD))
    return out


def token_kv(layers: list[torch.Tensor], page_tokens: int, pages: list[int]) -> torch.Tensor:
    """[layers, 2, heads, tokens, head] of the given pages, read the way the backend does."""
    rows = []
    for t in layers:
        v = t.view(t.shape[0], HEADS, 2 * page_tokens, HEAD)
        k_rows = torch.cat([v[p, :, :page_tokens] for p in pages], dim=1)
        v_rows = torch.cat([v[p, :, page_tokens:] for p in pages], dim=1)
        rows.append(torch.stack([k_rows, v_rows]))
    return torch.stack(rows)


@pytest.mark.parametrize("page_tokens", [16, 32, 128])
def test_gather_is_the_token_kv_in_block_layout(page_tokens: int) -> None:
    layers = cache(40, page_tokens)
    paged = PagedKV(layers, 256, page_tokens)
    r = 256 // page_tokens
    ids = list(range(3, 3 + 2 * r))
    blocks = paged.gather(ids)
    assert len(blocks) == 2 and blocks[0].shape == (LAYERS, 2, HEADS, 256, HEAD)
    expect = token_kv(layers, page_tokens, ids)
    got = torch.cat([torch.from_numpy(b) for b in blocks], dim=3)
    assert torch.equal(got, expect)


def test_blocks_saved_from_one_page_size_load_into_another() -> None:
    src = cache(40, 16)
    blocks = PagedKV(src, 256, 16).gather(list(range(32)))
    dst = [torch.zeros_like(t).view(10, HEADS, 128, 2 * HEAD) for t in cache(10, 128)]
    paged = PagedKV(dst, 256, 128)
    assert paged.scatter(blocks, 0, 0, [7, 2, 5, 9]) == 4
    assert torch.equal(token_kv(dst, 128, [7, 2, 5, 9]), token_kv(src, 16, list(range(32))))


def test_scatter_fills_only_given_pages_and_stops_at_a_missing_block() -> None:
    src = cache(8, 128)
    blocks = PagedKV(src, 256, 128).gather(list(range(4)))
    dst = [torch.zeros_like(t) for t in src]
    paged = PagedKV(dst, 256, 128)
    # Pages 1.. of the request (page 0 came from vLLM's own cache); block 1 is gone.
    filled = paged.scatter(blocks[:1], 0, 1, [6, 4, 5])
    assert filled == 1
    assert torch.equal(token_kv(dst, 128, [6]), token_kv(src, 128, [1]))
    untouched = [p for p in range(8) if p != 6]
    assert all(float(t[untouched].abs().sum()) == 0 for t in dst)


def test_bfloat16_round_trips_bit_exactly() -> None:
    src = cache(4, 128, torch.bfloat16)
    paged = PagedKV(src, 256, 128)
    assert paged.contract_dtype == "bfloat16"
    blocks = paged.gather([0, 1])
    assert blocks[0].dtype == np.uint16
    dst = [torch.zeros_like(t) for t in src]
    PagedKV(dst, 256, 128).scatter(blocks, 0, 0, [2, 3])
    assert all(torch.equal(d[2:4], s[0:2]) for d, s in zip(dst, src, strict=True))


def test_unknown_layouts_are_refused() -> None:
    with pytest.raises(LayoutError, match="layout"):
        PagedKV([torch.zeros(4, 2, 100)], 256, 128)
    with pytest.raises(LayoutError, match="multiple"):
        PagedKV(cache(4, 96), 256, 96)
    with pytest.raises(LayoutError, match="dtype"):
        PagedKV([torch.zeros(4, 2, 128, 16, dtype=torch.int32)], 256, 128)
