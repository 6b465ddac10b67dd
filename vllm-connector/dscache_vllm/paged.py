"""vLLM's paged KV cache, copied page by page into and out of dscache blocks.

vLLM registers one KV tensor per attention layer; one of its dimensions counts the
pages (vLLM's KV blocks): ``[pages, kv_heads, page_tokens, 2 * head_size]`` on the CPU
attention backend, ``[2, pages, page_tokens, kv_heads, head_size]`` on FlashAttention.
:class:`PagedKV` finds that dimension and moves a page as what it is: every element
of ``layer.select(page_dim, page)``, in that view's order. A stored dscache block is
one array ``[layers, pages_per_block, page_elements]`` in vLLM's KV dtype.

The bytes are not interpreted (inside a page, the order of K, V, heads and tokens is
the attention backend's, and kernels may tile it), so the fingerprint names what
lays a page out (vLLM's version, page size, device, attention kernel): engines whose
pages differ never share a block, and none is misread.

Contract:
    * :meth:`PagedKV.copy_in` and :meth:`PagedKV.copy_out` move one layer's run of
      pages between a stored block and vLLM's pages in one array operation (a slice
      copy when the page ids are consecutive, an indexed copy otherwise): loads and
      saves go layer by layer. :meth:`PagedKV.gather` copies whole blocks out of
      pages into fresh host arrays the caller owns; :meth:`PagedKV.scatter` copies
      the chosen pages of stored blocks into vLLM's pages (the only copy on the hit
      path: the stored arrays are read-only views on the mapped segment files).
    * Pages in host memory are copied by numpy over the same memory (a plain
      ``memcpy`` per contiguous run that releases the GIL), so several threads can
      copy one load at memory speed; torch's copy, called from a thread that is not
      the main one, pays for its own intra-op thread team on every call (about 1.7x
      the time here). Pages on a GPU are copied by torch (the index and source go
      where the pages are), so the same code serves the CPU and CUDA backends.
    * None ever writes a page it was not given.
    * A layout without a page dimension, with layers of differing shapes, or with
      pages that are not whole tokens is refused at start-up (``LayoutError``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: torch KV dtypes the store can keep, with their contract names and the numpy
#: dtype that carries their bytes (numpy has no bfloat16: uint16 carries it).
DTYPES: dict[torch.dtype, tuple[str, np.dtype[np.generic]]] = {
    torch.float32: ("float32", np.dtype(np.float32)),
    torch.float16: ("float16", np.dtype(np.float16)),
    torch.bfloat16: ("bfloat16", np.dtype(np.uint16)),
}


class LayoutError(ValueError):
    """vLLM's KV cache is not in a layout this connector understands."""


@dataclass(frozen=True)
class Geometry:
    """The shape facts of one worker's paged KV."""

    num_layers: int
    page_dim: int
    page_shape: tuple[int, ...]
    page_tokens: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_tokens

    @property
    def page_elements(self) -> int:
        return math.prod(self.page_shape)

    @property
    def elements_per_token(self) -> int:
        """Elements of one token in one layer (K and V, every head)."""
        return self.page_elements // self.page_tokens

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.pages_per_block, self.page_elements)


def _as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``array``'s memory in ``dtype`` (read-only arrays included:
    the caller only reads through it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    return t.view(dtype) if t.dtype != dtype else t


#: torch dtypes numpy can view, for each storable KV dtype (same element size).
_NUMPY_VIEW = {
    torch.float32: torch.float32,
    torch.float16: torch.float16,
    torch.bfloat16: torch.int16,
}


def _host_arrays(layers: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    """numpy arrays over host-memory KV tensors (same memory, same strides), in the
    numpy dtype that carries their bytes; None for pages on a device."""
    if any(t.device.type != "cpu" for t in layers):
        return None
    try:
        return [t.view(_NUMPY_VIEW[t.dtype]).numpy().view(DTYPES[t.dtype][1]) for t in layers]
    except (RuntimeError, TypeError, ValueError):  # a tensor numpy cannot view
        return None


#: A stored block as :meth:`PagedKV.block_view` gives it: a numpy array for host
#: pages, a tensor for device pages; ``[layers, pages_per_block, *page_shape]``.
Block = np.ndarray | torch.Tensor


def _as_slice(page_ids: Sequence[int]) -> slice | None:
    """Consecutive page ids as a slice; None for any other run."""
    first = page_ids[0]
    if all(p == first + i for i, p in enumerate(page_ids)):
        return slice(first, first + len(page_ids))
    return None


class PagedKV:
    """The per-layer KV tensors of one vLLM worker, in layer order.

    Args:
        layers: vLLM's KV tensors, one per attention layer.
        block_tokens: tokens per dscache block.
        page_tokens: tokens per vLLM page (``--block-size``).
        num_pages: pages per layer (``kv_cache_config.num_blocks``): the dimension of
            this size is the page dimension.
        numpy_copies: copy host pages with numpy (False: with torch, as device pages).
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        block_tokens: int,
        page_tokens: int,
        num_pages: int,
        *,
        numpy_copies: bool = True,
    ) -> None:
        if not layers:
            raise LayoutError("vLLM registered no KV cache tensors")
        first = layers[0]
        dims = [d for d, n in enumerate(first.shape) if n == num_pages]
        if not dims:
            raise LayoutError(
                f"no dimension of vLLM's KV tensor {tuple(first.shape)} counts its "
                f"{num_pages} pages"
            )
        page_dim = dims[0]
        page_shape = tuple(int(n) for n in first.select(page_dim, 0).shape)
        if first.dtype not in DTYPES:
            raise LayoutError(f"KV dtype {first.dtype} is not storable (float32/16, bfloat16)")
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype:
                raise LayoutError("every layer's KV tensor must have one shape and dtype")
        if block_tokens % page_tokens:
            raise LayoutError(
                f"the dscache block ({block_tokens} tokens) must be a multiple of vLLM's "
                f"block size ({page_tokens})"
            )
        if math.prod(page_shape) % page_tokens:
            raise LayoutError(f"a page of shape {page_shape} does not hold {page_tokens} tokens")
        self.layers = list(layers)
        self.geometry = Geometry(
            num_layers=len(layers),
            page_dim=page_dim,
            page_shape=page_shape,
            page_tokens=page_tokens,
            block_tokens=block_tokens,
            dtype=first.dtype,
        )
        self._host = _host_arrays(self.layers) if numpy_copies else None

    @property
    def contract_dtype(self) -> str:
        return DTYPES[self.geometry.dtype][0]

    @property
    def on_host(self) -> bool:
        """Whether vLLM's pages are host memory (copied by numpy, any thread)."""
        return self._host is not None

    def block_view(self, block: np.ndarray) -> Block:
        """A stored block as ``[layers, pages_per_block, *page_shape]`` over the same
        memory (no copy): a numpy array for host pages, a tensor for device pages.

        Raises:
            LayoutError: the block does not have this engine's block shape.
        """
        g = self.geometry
        if block.shape != g.block_shape:
            raise LayoutError(f"stored block of shape {block.shape}, not {g.block_shape}")
        if self._host is not None:
            return block.reshape(g.num_layers, g.pages_per_block, *g.page_shape)
        return _as_tensor(block, g.dtype).view(g.num_layers, g.pages_per_block, *g.page_shape)

    def _run(self, page_ids: Sequence[int], device: torch.device) -> slice | torch.Tensor:
        """Consecutive page ids as a slice, others as an index on the pages' device."""
        run = _as_slice(page_ids)
        if run is not None:
            return run
        return torch.tensor(list(page_ids), dtype=torch.long, device=device)

    def _host_pages(self, layer: int, page_ids: Sequence[int]) -> tuple[np.ndarray, Any]:
        """Host pages of ``layer`` with the page dimension first (a view), and the
        index of ``page_ids`` in it: a slice when they are consecutive."""
        assert self._host is not None
        pages = np.moveaxis(self._host[layer], self.geometry.page_dim, 0)
        run = _as_slice(page_ids)
        return pages, run if run is not None else np.asarray(page_ids)

    def copy_in(self, layer: int, block: Block, first: int, page_ids: Sequence[int]) -> None:
        """Copies pages ``first .. first + len(page_ids) - 1`` of ``block``'s ``layer``
        (a ``block_view``) into vLLM's pages ``page_ids`` of that layer."""
        if not page_ids:
            return
        d = self.geometry.page_dim
        if isinstance(block, np.ndarray):
            pages, at = self._host_pages(layer, page_ids)
            pages[at] = block[layer, first : first + len(page_ids)]  # memcpy per stretch
            return
        src = block[layer, first : first + len(page_ids)].movedim(0, d)
        dst = self.layers[layer]
        run = self._run(page_ids, dst.device)
        if isinstance(run, slice):
            dst.narrow(d, run.start, run.stop - run.start).copy_(src)  # host to GPU too
        else:  # index_copy_ wants its index and source where the pages are
            dst.index_copy_(d, run, src.to(dst.device))

    def copy_out(self, layer: int, block: Block, first: int, page_ids: Sequence[int]) -> None:
        """Copies vLLM's pages ``page_ids`` of ``layer`` into pages ``first ..`` of
        ``block``'s ``layer`` (a writable ``block_view``)."""
        if not page_ids:
            return
        d = self.geometry.page_dim
        if isinstance(block, np.ndarray):
            pages, at = self._host_pages(layer, page_ids)
            block[layer, first : first + len(page_ids)] = pages[at]
            return
        src = self.layers[layer]
        run = self._run(page_ids, src.device)
        pages_t = (
            src.narrow(d, run.start, run.stop - run.start)
            if isinstance(run, slice)
            else src.index_select(d, run)
        )
        block[layer, first : first + len(page_ids)].copy_(pages_t.movedim(d, 0))

    def gather(self, page_ids: Sequence[int]) -> list[np.ndarray]:
        """Whole blocks copied out of their pages (``pages_per_block`` ids per block)."""
        g = self.geometry
        r = g.pages_per_block
        if len(page_ids) % r:
            raise ValueError("page ids must cover whole blocks")
        n = len(page_ids) // r
        out = np.empty((n, *g.block_shape), dtype=DTYPES[g.dtype][1])
        for b in range(n):
            dst = self.block_view(out[b])
            for li in range(g.num_layers):
                self.copy_out(li, dst, 0, page_ids[b * r : (b + 1) * r])
        return list(out)

    def runs(
        self, blocks: int, first_block: int, first_page: int, page_ids: Sequence[int]
    ) -> list[tuple[int, int, list[int]]]:
        """Where each page of a load comes from: ``(block, first page in it, page ids)``
        per stored block, in order, for the first ``blocks`` stored blocks."""
        r = self.geometry.pages_per_block
        out: list[tuple[int, int, list[int]]] = []
        for i, page_id in enumerate(page_ids):
            page = first_page + i
            b = page // r - first_block
            if b >= blocks:
                break
            if out and out[-1][0] == b:
                out[-1][2].append(page_id)
            else:
                out.append((b, page % r, [page_id]))
        return out

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

        Raises:
            LayoutError: a stored block does not have this engine's block shape.
        """
        runs = self.runs(len(blocks), first_block, first_page, page_ids)
        views = {b: self.block_view(blocks[b]) for b, _, _ in runs}
        for li in range(self.geometry.num_layers):
            for b, j, ids in runs:
                self.copy_in(li, views[b], j, ids)
        return sum(len(ids) for _, _, ids in runs)
