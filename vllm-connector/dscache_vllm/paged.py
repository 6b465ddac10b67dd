"""vLLM's paged KV cache, read and written in dscache's block layout.

A stored dscache block is one array ``[layers, 2, kv_heads, block_tokens, head_size]``
in vLLM's KV dtype: for each layer, the K halves then the V halves of the block's
pages, per head, in page order. Inside a half, the element order is the attention
kernel's (the CPU kernels may tile K), so blocks are vLLM's page bytes, moved
without interpretation; the fingerprint names the page size and kernel layout,
and engines that lay pages out differently never share a block.

vLLM's CPU attention backend keeps one tensor per layer of shape
``[num_pages, kv_heads, page_tokens, 2 * head_size]`` that it reads as
``[num_pages, kv_heads, 2 * page_tokens, head_size]``: per head, the page's K rows
then its V rows. :class:`PagedKV` accepts exactly that layout (any other is refused
at start-up with a clear error, never misread).

Contract:
    * :meth:`PagedKV.gather` copies whole blocks out of pages (one copy, into a
      fresh array the caller owns); :meth:`PagedKV.scatter` copies the chosen pages
      of stored blocks into vLLM's pages (the only copy on the hit path: the
      stored arrays are read-only views on the mapped segment files).
    * Neither ever writes a page it was not given.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: torch KV dtypes the store can keep, with their contract names and the numpy
#: dtype that carries their bytes (numpy has no bfloat16: uint16 carries it).
DTYPES: dict[torch.dtype, tuple[str, np.dtype[np.generic]]] = {
    torch.float32: ("float32", np.dtype(np.float32)),
    torch.float16: ("float16", np.dtype(np.float16)),
    torch.bfloat16: ("bfloat16", np.dtype(np.uint16)),
}
_CARRIER: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}


class LayoutError(ValueError):
    """vLLM's KV cache is not in a layout this connector understands."""


@dataclass(frozen=True)
class Geometry:
    """The shape facts both sides agree on."""

    num_layers: int
    kv_heads: int
    head_size: int
    page_tokens: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_tokens

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.kv_heads, self.block_tokens, self.head_size)


def _as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``array``'s memory in ``dtype`` (read-only arrays included:
    the caller only reads through it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    return t.view(dtype) if t.dtype != dtype else t


class PagedKV:
    """The per-layer KV tensors of one vLLM worker, in layer order."""

    def __init__(self, layers: Sequence[torch.Tensor], block_tokens: int, page_tokens: int) -> None:
        if not layers:
            raise LayoutError("vLLM registered no KV cache tensors")
        first = layers[0]
        per_head = int(first.shape[2] * first.shape[3]) if first.dim() == 4 else 0
        if first.dim() != 4 or per_head % (2 * page_tokens):
            raise LayoutError(
                "dscache's vLLM connector reads the CPU attention backend's KV layout "
                "[pages, kv_heads, page_tokens, 2 * head_size] (per head: the page's K rows, "
                f"then its V rows); got shape {tuple(first.shape)}"
            )
        if first.dtype not in DTYPES:
            raise LayoutError(f"KV dtype {first.dtype} is not storable (float32/16, bfloat16)")
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                raise LayoutError("every layer's KV tensor must have one shape, dtype, layout")
        if block_tokens % page_tokens:
            raise LayoutError(
                f"the dscache block ({block_tokens} tokens) must be a multiple of vLLM's "
                f"block size ({page_tokens})"
            )
        self.layers = list(layers)
        self.geometry = Geometry(
            num_layers=len(layers),
            kv_heads=int(first.shape[1]),
            head_size=per_head // (2 * page_tokens),
            page_tokens=page_tokens,
            block_tokens=block_tokens,
            dtype=first.dtype,
        )

    @property
    def contract_dtype(self) -> str:
        return DTYPES[self.geometry.dtype][0]

    def _page(self, layer: torch.Tensor, page_id: int) -> torch.Tensor:
        """One page as ``[2, kv_heads, page_tokens, head_size]`` (a view)."""
        g = self.geometry
        return layer[page_id].view(g.kv_heads, 2, g.page_tokens, g.head_size).transpose(0, 1)

    def gather(self, page_ids: Sequence[int]) -> list[np.ndarray]:
        """Whole blocks copied out of their pages (``pages_per_block`` ids per block)."""
        g = self.geometry
        r = g.pages_per_block
        if len(page_ids) % r:
            raise ValueError("page ids must cover whole blocks")
        n = len(page_ids) // r
        out = np.empty((n, *g.block_shape), dtype=DTYPES[g.dtype][1])
        dst = _as_tensor(out, g.dtype).view(n, g.num_layers, 2, g.kv_heads, r, g.page_tokens, -1)
        for b in range(n):
            for j in range(r):
                page = page_ids[b * r + j]
                for li, layer in enumerate(self.layers):
                    dst[b, li, :, :, j].copy_(self._page(layer, page))
        return list(out)

    def scatter(
        self,
        blocks: Sequence[np.ndarray],
        first_block: int,
        first_page: int,
        page_ids: Sequence[int],
    ) -> int:
        """Copies pages ``first_page ..`` of stored blocks ``first_block ..`` into ``page_ids``.

        ``blocks`` may be fewer than the pages need (a block was evicted or failed
        its check): only pages whose block is present are written.

        Returns:
            How many of ``page_ids`` were filled (a prefix of them).
        """
        g = self.geometry
        r = g.pages_per_block
        filled = 0
        for i, page_id in enumerate(page_ids):
            page = first_page + i
            b = page // r - first_block
            if b >= len(blocks):
                break
            src = _as_tensor(blocks[b], g.dtype).view(
                g.num_layers, 2, g.kv_heads, r, g.page_tokens, g.head_size
            )
            j = page % r
            for li, layer in enumerate(self.layers):
                self._page(layer, page_id).copy_(src[li, :, :, j])
            filled += 1
        return filled
