"""vLLM's paged KV copied page by page into dscache blocks and back, in any layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dscache_vllm.paged import LayoutError, PagedKV
from vllm_helpers import DEVICES

LAYERS, HEADS, HEAD = 3, 2, 8


def cpu_cache(
    pages: int, page_tokens: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """The CPU backend's allocation: [pages, heads, page_tokens, 2 * head], distinct values."""
    out = []
    for layer in range(LAYERS):
        t = torch.arange(pages * HEADS * page_tokens * 2 * HEAD, dtype=torch.float32)
        out.append((t + layer * 1e6).to(dtype).view(pages, HEADS, page_tokens, 2 * HEAD))
    return out


def flash_cache(pages: int, page_tokens: int) -> list[torch.Tensor]:
    """A FlashAttention-style allocation: [2, pages, page_tokens, heads, head]."""
    return [
        torch.arange(2 * pages * page_tokens * HEADS * HEAD, dtype=torch.float32).add(li * 1e6)
        .view(2, pages, page_tokens, HEADS, HEAD)
        for li in range(LAYERS)
    ]  # fmt: skip


@pytest.mark.parametrize("page_tokens", [16, 32, 128])
def test_blocks_round_trip_into_other_pages(page_tokens: int) -> None:
    src = cpu_cache(40, page_tokens)
    r = 256 // page_tokens
    blocks = PagedKV(src, 256, page_tokens, 40).gather(list(range(3, 3 + 2 * r)))
    assert len(blocks) == 2 and blocks[0].shape == (LAYERS, r, HEADS * page_tokens * 2 * HEAD)
    dst = [torch.zeros_like(t) for t in src]
    targets = list(range(39, 39 - 2 * r, -1))  # other pages, in another order
    assert PagedKV(dst, 256, page_tokens, 40).scatter(blocks, 0, 0, targets) == 2 * r
    for s, d in zip(src, dst, strict=True):
        for k, page in enumerate(targets):
            assert torch.equal(d[page], s[3 + k])


def test_any_page_dimension_works_flash_layout_included() -> None:
    src = flash_cache(10, 128)
    paged = PagedKV(src, 256, 128, 10)
    assert paged.geometry.page_dim == 1
    assert paged.geometry.elements_per_token == 2 * HEADS * HEAD
    blocks = paged.gather([4, 7])
    dst = [torch.zeros_like(t) for t in src]
    PagedKV(dst, 256, 128, 10).scatter(blocks, 0, 0, [0, 1])
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, 0], s[:, 4]) and torch.equal(d[:, 1], s[:, 7])
        assert float(d[:, 2:].abs().sum()) == 0


def test_scatter_fills_only_given_pages_and_stops_at_a_missing_block() -> None:
    src = cpu_cache(8, 128)
    blocks = PagedKV(src, 256, 128, 8).gather(list(range(4)))
    dst = [torch.zeros_like(t) for t in src]
    paged = PagedKV(dst, 256, 128, 8)
    # Pages 1.. of the request (page 0 came from vLLM's own cache); block 1 is gone.
    assert paged.scatter(blocks[:1], 0, 1, [6, 4, 5]) == 1
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[6], s[1])
        assert float(d[[p for p in range(8) if p != 6]].abs().sum()) == 0


def test_a_block_of_another_shape_is_refused_not_copied() -> None:
    src = cpu_cache(8, 128)
    paged = PagedKV(src, 256, 128, 8)
    with pytest.raises(LayoutError, match="shape"):
        paged.scatter([np.zeros((LAYERS, 2, 7), dtype=np.float32)], 0, 0, [0])


def test_bfloat16_round_trips_bit_exactly() -> None:
    src = cpu_cache(4, 128, torch.bfloat16)
    paged = PagedKV(src, 256, 128, 4)
    assert paged.contract_dtype == "bfloat16"
    blocks = paged.gather([0, 1])
    assert blocks[0].dtype == np.uint16
    dst = [torch.zeros_like(t) for t in src]
    PagedKV(dst, 256, 128, 4).scatter(blocks, 0, 0, [2, 3])
    assert all(torch.equal(d[2:4], s[0:2]) for d, s in zip(dst, src, strict=True))


def test_unusable_layouts_are_refused() -> None:
    with pytest.raises(LayoutError, match="counts its 9 pages"):
        PagedKV(cpu_cache(4, 128), 256, 128, 9)
    with pytest.raises(LayoutError, match="multiple"):
        PagedKV(cpu_cache(4, 96), 256, 96, 4)
    with pytest.raises(LayoutError, match="dtype"):
        PagedKV([torch.zeros(4, 2, 128, 16, dtype=torch.int32)], 256, 128, 4)
    with pytest.raises(LayoutError, match="one shape"):
        PagedKV([*cpu_cache(4, 128), torch.zeros(4, 2, 128, 8)], 256, 128, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_on_any_device_round_trip_through_host_blocks(
    device: str, dtype: torch.dtype
) -> None:
    """A FlashAttention-style allocation on ``device``: whole blocks gathered into
    host arrays (consecutive pages and scattered ones), scattered back into other
    pages in another order, equal bit for bit; pages not given stay untouched."""
    src = [t.to(dtype=dtype, device=device) for t in flash_cache(24, 32)]
    r = 256 // 32
    picked = [*range(r), 23, 3, 19, 9, 21, 12, 17, 14]  # a run, then scattered pages
    blocks = PagedKV(src, 256, 32, 24).gather(picked)
    assert len(blocks) == 2 and all(isinstance(b, np.ndarray) for b in blocks)
    dst = [torch.full_like(t, -1.0) for t in src]
    targets = [*range(16, 16 + r), *range(2 * r - 1, -1, -2)]  # a run, then every other
    assert PagedKV(dst, 256, 32, 24).scatter(blocks, 0, 0, targets) == 2 * r
    for s, d in zip(src, dst, strict=True):
        assert d.device == s.device
        for k, page in enumerate(targets):
            assert torch.equal(d[:, page], s[:, picked[k]])
        for page in sorted(set(range(24)) - set(targets)):
            assert bool((d[:, page] == -1).all())


def test_host_pages_are_copied_by_numpy_and_equal_torchs_copy() -> None:
    """Host pages take the numpy path (any thread, the GIL released) and land the same
    bytes as torch's copies (the path of device pages)."""
    src = cpu_cache(12, 32, torch.float16)
    paged = PagedKV(src, 256, 32, 12)
    assert paged.on_host
    blocks = paged.gather(list(range(8)))
    targets = [11, 2, 9, 3, 4, 5, 0, 10]  # scattered, with a run inside
    via_numpy = [torch.zeros_like(t) for t in src]
    PagedKV(via_numpy, 256, 32, 12).scatter(blocks, 0, 0, targets)
    via_torch = [torch.zeros_like(t) for t in src]
    torch_paged = PagedKV(via_torch, 256, 32, 12, numpy_copies=False)
    assert not torch_paged.on_host
    torch_paged.scatter(blocks, 0, 0, targets)
    # And back out by torch: the blocks as they were stored.
    again = torch_paged.gather(targets)
    assert all(np.array_equal(a, b) for a, b in zip(blocks, again, strict=True))
    for a, b, s in zip(via_numpy, via_torch, src, strict=True):
        assert torch.equal(a, b)
        assert all(torch.equal(a[p], s[k]) for k, p in enumerate(targets))
