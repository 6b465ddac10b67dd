"""The KV state of one sequence, and exact attention over it without concatenation.

Contract:
    * A ``SequenceKV`` holds, per layer, an ordered list of read-only *chunks* (the
      prefix restored from cache blocks: usually views on the sidecar's mapped
      segment, never written and never copied) followed by private *pages* of
      ``page_tokens`` tokens holding everything this process computed (the prefill of
      the suffix and every decoded token).
    * Token positions are contiguous: chunk tokens first, in order, then page tokens.
    * Attention runs part by part (each chunk, each page, the new tokens) and the
      partial results are merged with log-sum-exp weights. This equals attention over
      the concatenated keys up to float rounding, and never copies the prefix.
    * Rows of a page below the sequence length are never rewritten, so an exporter on
      another thread may read them while decoding appends further tokens.
    * Two layer kinds exist: ``GqaLayerKV`` keeps K and V per KV head
      ``(num_kv_heads, tokens, head_dim)``; ``MlaLayerKV`` keeps DeepSeek's compressed
      latent plus the roped key ``(tokens, kv_lora_rank + qk_rope_head_dim)``.

Block arrays (the key contract's unit, one per ``block_tokens`` tokens, all layers):
    * GQA/MHA: ``(num_layers, 2, num_kv_heads, block_tokens, head_dim)``
    * MLA: ``(num_layers, block_tokens, kv_lora_rank + qk_rope_head_dim)``

KV dtypes: the layout's (``float32``, ``float16`` or ``bfloat16``), the model's own:
blocks hold exactly the bytes the model computed. numpy has no bfloat16, so its
blocks are ``uint16`` arrays of the same bits (the contract's storage type), viewed
as ``torch.bfloat16`` when restored. Softmax statistics and the merge of partial
outputs run in float32 whatever the KV dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dscache.keys import KV_DTYPES as CORE_DTYPES
from dscache.keys import KVLayout, LayoutKind

# Above this many elements the partial outputs are merged one by one instead of
# stacked, which bounds peak memory for long suffixes with many prefix chunks.
_STACK_MERGE_LIMIT = 8 * 1024 * 1024

#: KV dtypes of the reference engine: contract name -> torch dtype, numpy storage dtype
#: (derived from the core's one table, ``dscache.keys.KV_DTYPES``).
KV_DTYPES: dict[str, tuple[torch.dtype, np.dtype[np.generic]]] = {
    name: (getattr(torch, name), d.storage) for name, d in CORE_DTYPES.items() if d.engine
}


def dtype_name(dtype: torch.dtype) -> str:
    """The contract name of a torch KV dtype (ValueError for others)."""
    for name, (t, _) in KV_DTYPES.items():
        if t == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} is not one of {sorted(KV_DTYPES)}")


def flash_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one part of the keys, with its log-sum-exp.

    Args:
        q: ``(1, heads, n_q, d)``.
        k: ``(1, heads, n_k, d)``.
        v: ``(1, heads, n_k, d)``.
        causal: top-left aligned causal mask (only used with ``n_q == n_k``).
        scale: softmax scale.

    Returns:
        ``(out (1, heads, n_q, d), lse (1, heads, n_q))``.
    """
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )[:2]
    return out, lse


def latent_part(
    q: torch.Tensor, latent: torch.Tensor, value_width: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of absorbed MLA queries over one latent part.

    Args:
        q: ``(rows, width)`` queries already projected into latent space.
        latent: ``(n_k, width)`` cached latent rows; the first ``value_width``
            columns are also the values.
        value_width: ``kv_lora_rank``.
        scale: softmax scale.

    Returns:
        ``(out (rows, value_width), lse (rows,))``.
    """
    # The softmax runs in float32 (a no-op for float32 KV); the products in the
    # KV's dtype, so a half-precision prefix is read in place, never converted.
    s = torch.matmul(q, latent.t()).float()
    s.mul_(scale)
    m = s.amax(dim=-1, keepdim=True)
    s.sub_(m).exp_()
    denom = s.sum(dim=-1, keepdim=True)
    out = torch.matmul(s.to(latent.dtype), latent[:, :value_width]).float()
    out.div_(denom)
    lse = (m + denom.log()).squeeze(-1)
    return out.to(q.dtype), lse


def merge_parts(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges partial attention outputs by their log-sum-exp.

    Args:
        parts: ``(out (..., n, d), lse (..., n))`` pairs over disjoint key sets.

    Returns:
        ``(out, lse)`` of the attention over the union of the key sets; ``out`` in the
        first part's dtype, merged in float32 (``lse`` float32).
    """
    if len(parts) == 1:
        return parts[0]
    dtype = parts[0][0].dtype
    numel = parts[0][0].numel() * len(parts)
    if numel <= _STACK_MERGE_LIMIT:
        lse = torch.stack([p[1].float() for p in parts], dim=0)
        total = torch.logsumexp(lse, dim=0)
        weights = torch.exp(lse - total.unsqueeze(0)).unsqueeze(-1)
        outs = torch.stack([p[0].float() for p in parts], dim=0)
        return (outs * weights).sum(dim=0).to(dtype), total
    acc, acc_lse = parts[0][0].float().clone(), parts[0][1].float().clone()
    for out, part_lse in parts[1:]:
        lse = part_lse.float()
        new_lse = torch.logaddexp(acc_lse, lse)
        acc.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
        acc.add_(out.float() * torch.exp(lse - new_lse).unsqueeze(-1))
        acc_lse = new_lse
    return acc.to(dtype), acc_lse


def tensor_view(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing memory with ``array`` (read-only arrays included).

    The caller promises never to write through the view: the cache code only reads
    chunks. torch warns about non-writable arrays; the warning is suppressed here
    because the promise is kept by construction.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class GqaLayerKV:
    """K/V of one MHA/GQA layer: read-only chunks then private pages."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        page_tokens: int,
        dtype: torch.dtype = torch.float32,
    ):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.page_tokens = page_tokens
        self.dtype = dtype
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.chunk_tokens = 0
        self._pages: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.page_fill = 0  # tokens in the pages

    def add_chunk(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Adds a restored chunk ``(heads, n, d)``; only before any page exists."""
        if self._pages:
            raise RuntimeError("chunks must precede computed tokens")
        self.chunks.append((k, v))
        self.chunk_tokens += k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copies new tokens' K/V ``(heads, n, d)`` into the pages."""
        n = k.shape[1]
        done = 0
        while done < n:
            slot = self.page_fill % self.page_tokens
            if slot == 0:
                self._pages.append(
                    (
                        torch.empty(
                            self.num_kv_heads, self.page_tokens, self.head_dim, dtype=self.dtype
                        ),
                        torch.empty(
                            self.num_kv_heads, self.page_tokens, self.v_head_dim, dtype=self.dtype
                        ),
                    )
                )
            pk, pv = self._pages[-1]
            take = min(n - done, self.page_tokens - slot)
            pk[:, slot : slot + take].copy_(k[:, done : done + take])
            pv[:, slot : slot + take].copy_(v[:, done : done + take])
            done += take
            self.page_fill += take

    def parts(self, exclude_last: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every stored part, leaving out the newest ``exclude_last`` page tokens."""
        out = list(self.chunks)
        limit = self.page_fill - exclude_last
        for i, (pk, pv) in enumerate(self._pages):
            start = i * self.page_tokens
            if start >= limit:
                break
            end = min(limit - start, self.page_tokens)
            out.append((pk[:, :end], pv[:, :end]))
        return out

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of token positions ``[start, end)`` (a copy only where parts meet)."""
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        offset = 0
        for k, v in self.parts(0):
            n = k.shape[1]
            lo, hi = max(start - offset, 0), min(end - offset, n)
            if lo < hi:
                ks.append(k[:, lo:hi])
                vs.append(v[:, lo:hi])
            offset += n
            if offset >= end:
                break
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def materialize(self) -> None:
        """Replaces chunk views with private copies (before a lease runs out)."""
        self.chunks = [(k.clone(), v.clone()) for k, v in self.chunks]


class MlaLayerKV:
    """Compressed latent + roped key of one MLA layer: read-only chunks then pages."""

    def __init__(self, width: int, page_tokens: int, dtype: torch.dtype = torch.float32):
        self.width = width
        self.page_tokens = page_tokens
        self.dtype = dtype
        self.chunks: list[torch.Tensor] = []
        self.chunk_tokens = 0
        self._pages: list[torch.Tensor] = []
        self.page_fill = 0

    def add_chunk(self, latent: torch.Tensor) -> None:
        """Adds a restored chunk ``(n, width)``; only before any page exists."""
        if self._pages:
            raise RuntimeError("chunks must precede computed tokens")
        self.chunks.append(latent)
        self.chunk_tokens += latent.shape[0]

    def append(self, latent: torch.Tensor) -> None:
        """Copies new tokens' latents ``(n, width)`` into the pages."""
        n = latent.shape[0]
        done = 0
        while done < n:
            slot = self.page_fill % self.page_tokens
            if slot == 0:
                self._pages.append(torch.empty(self.page_tokens, self.width, dtype=self.dtype))
            take = min(n - done, self.page_tokens - slot)
            self._pages[-1][slot : slot + take].copy_(latent[done : done + take])
            done += take
            self.page_fill += take

    def parts(self, exclude_last: int) -> list[torch.Tensor]:
        """Every stored part, leaving out the newest ``exclude_last`` page tokens."""
        out = list(self.chunks)
        limit = self.page_fill - exclude_last
        for i, page in enumerate(self._pages):
            start = i * self.page_tokens
            if start >= limit:
                break
            out.append(page[: min(limit - start, self.page_tokens)])
        return out

    def read(self, start: int, end: int) -> torch.Tensor:
        """Latents of token positions ``[start, end)``."""
        pieces: list[torch.Tensor] = []
        offset = 0
        for part in self.parts(0):
            n = part.shape[0]
            lo, hi = max(start - offset, 0), min(end - offset, n)
            if lo < hi:
                pieces.append(part[lo:hi])
            offset += n
            if offset >= end:
                break
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def materialize(self) -> None:
        """Replaces chunk views with private copies (before a lease runs out)."""
        self.chunks = [c.clone() for c in self.chunks]


LayerKV = GqaLayerKV | MlaLayerKV


@dataclass
class SequenceKV:
    """The KV state of one sequence across all layers.

    Attributes:
        layout: the key contract's KV layout this state follows.
        layers: one layer state per attention layer.
        length: tokens whose KV is held (restored + computed).
        restored_tokens: how many leading tokens came from restored chunks.
    """

    layout: KVLayout
    layers: list[LayerKV]
    length: int = 0
    restored_tokens: int = 0

    def materialize(self) -> None:
        """Copies every restored chunk into private memory."""
        for layer in self.layers:
            layer.materialize()


class LayoutAdapter:
    """Turns a ``SequenceKV`` into block arrays of the key contract and back, exactly."""

    def __init__(self, layout: KVLayout, block_tokens: int):
        if layout.dtype not in KV_DTYPES:
            raise ValueError(
                f"the reference engine caches {', '.join(KV_DTYPES)} KV, not {layout.dtype}"
            )
        self.layout = layout
        self.block_tokens = block_tokens
        self.torch_dtype, self._np_dtype = KV_DTYPES[layout.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block array."""
        lay = self.layout
        if lay.kind is LayoutKind.MLA:
            return (lay.num_layers, self.block_tokens, lay.kv_lora_rank + lay.qk_rope_head_dim)
        if lay.head_dim != lay.v_head_dim:
            raise ValueError("GQA blocks need head_dim == v_head_dim")
        return (lay.num_layers, 2, lay.num_kv_heads, self.block_tokens, lay.head_dim)

    @property
    def dtype(self) -> np.dtype[np.generic]:
        """Element type of block arrays (numpy's storage type: uint16 for bfloat16)."""
        return self._np_dtype

    def new_sequence(self) -> SequenceKV:
        """An empty sequence state."""
        lay = self.layout
        layers: list[LayerKV]
        if lay.kind is LayoutKind.MLA:
            width = lay.kv_lora_rank + lay.qk_rope_head_dim
            layers = [
                MlaLayerKV(width, self.block_tokens, self.torch_dtype)
                for _ in range(lay.num_layers)
            ]
        else:
            layers = [
                GqaLayerKV(
                    lay.num_kv_heads,
                    lay.head_dim,
                    lay.v_head_dim,
                    self.block_tokens,
                    self.torch_dtype,
                )
                for _ in range(lay.num_layers)
            ]
        return SequenceKV(layout=lay, layers=layers)

    def check_block(self, array: np.ndarray) -> None:
        """Raises ``ValueError`` unless ``array`` is a well-formed block of this layout."""
        if array.shape != self.block_shape:
            raise ValueError(f"block shape {array.shape} != expected {self.block_shape}")
        if array.dtype != self.dtype:
            raise ValueError(f"block dtype {array.dtype} != expected {self.dtype}")
        if not array.flags.c_contiguous:
            raise ValueError("block array is not C-contiguous")

    def restore(self, seq: SequenceKV, arrays: Sequence[np.ndarray]) -> None:
        """Appends blocks to an empty-tail sequence as zero-copy chunks.

        Raises:
            ValueError: a block does not match the layout (treated as corrupt).
        """
        for array in arrays:
            self.check_block(array)
        for array in arrays:
            t = tensor_view(array).view(self.torch_dtype)  # bfloat16: the uint16 bits
            for i, layer in enumerate(seq.layers):
                if isinstance(layer, MlaLayerKV):
                    layer.add_chunk(t[i])
                else:
                    layer.add_chunk(t[i, 0], t[i, 1])
        added = len(arrays) * self.block_tokens
        seq.length += added
        seq.restored_tokens += added

    def export(self, seq: SequenceKV, block_index: int) -> np.ndarray:
        """A fresh C-contiguous block array with the KV of one full block."""
        start = block_index * self.block_tokens
        end = start + self.block_tokens
        if end > seq.length:
            raise ValueError("block is not full yet")
        out = np.empty(self.block_shape, dtype=self.dtype)
        dst = torch.from_numpy(out).view(self.torch_dtype)
        for i, layer in enumerate(seq.layers):
            if isinstance(layer, MlaLayerKV):
                dst[i].copy_(layer.read(start, end))
            else:
                k, v = layer.read(start, end)
                dst[i, 0].copy_(k)
                dst[i, 1].copy_(v)
        return out
