"""Attention over a sequence's KV state, on transformers' attention modules' weights.

Both functions take a batch of rows ``(B, n, hidden)``, one sequence state per row
(prefill: one row; a decode step: one new token of each running sequence), run
the projections once for the batch and the attention per row over that row's own
state, append each row's new KV to its state and return the attention output
(the caller adds the residual). Earlier
chunks of ``state`` (restored blocks, read-only views on a mapped segment) are
attended in place, part by part, and the parts merged by log-sum-exp
(``kv.merge_parts``): exact, and the prefix is never concatenated (copied).

Contract: ``attend_gqa`` serves Llama-style MHA/GQA modules (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, optional ``q_norm``/``k_norm``);
``attend_mla`` serves DeepSeek-V3's MLA module and caches its compressed latent
(after ``kv_a_layernorm``) plus the roped key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812

from dscache_server.kv import GqaLayerKV, MlaLayerKV, flash_part, latent_part, merge_parts

#: transformers' ``apply_rotary_pos_emb`` (q, k, cos, sin) -> (q, k).
RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Rope(NamedTuple):
    """The rotary embedding of the positions being run: the function and its tables."""

    fn: RopeFn
    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, k)`` rotated."""
        return self.fn(q, k, self.cos, self.sin)


def attend_gqa(
    attn: Any, x: torch.Tensor, rope: Rope, states: Sequence[GqaLayerKV]
) -> torch.Tensor:
    """MHA/GQA attention of ``x`` ``(B, n, hidden)`` over ``states`` (one per row).

    Projections run once for the whole batch; attention runs per row over that
    row's own parts. Appends each row's new K/V to its state.
    """
    b, n = x.shape[0], x.shape[1]
    d = states[0].head_dim
    q = attn.q_proj(x).view(b, n, -1, d)
    k = attn.k_proj(x).view(b, n, -1, d)
    v = attn.v_proj(x).view(b, n, -1, d)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2))
    v = v.transpose(1, 2)
    hq = q.shape[1]
    scale = float(attn.scaling)
    outs = [
        _gqa_row(q[i : i + 1], k[i : i + 1], v[i : i + 1], state, scale)
        for i, state in enumerate(states)
    ]
    out = outs[0] if b == 1 else torch.cat(outs, dim=0)
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, hq * d))  # type: ignore[no-any-return]


def _gqa_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: GqaLayerKV, scale: float
) -> torch.Tensor:
    """One row's attention ``(1, hq, n, d)`` over its parts, then its new K/V appended."""
    q = q.contiguous()
    k = k.contiguous()
    v = v.contiguous()
    n, d = q.shape[2], q.shape[3]
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    prior = state.parts(0)
    state.append(k[0], v[0])
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Non-causal parts: fold the query heads of a group into the query axis so
    # K/V are read once per KV head and never repeated.
    folded = q.view(1, hkv, group * n, d)
    for pk, pv in prior:
        o, lse = flash_part(folded, pk.unsqueeze(0), pv.unsqueeze(0), causal=False, scale=scale)
        parts.append((o.reshape(1, hq, n, d), lse.reshape(1, hq, n)))
    if n == 1:
        o, lse = flash_part(folded, k, v, causal=False, scale=scale)
        parts.append((o.reshape(1, hq, 1, d), lse.reshape(1, hq, 1)))
    else:
        kr = k.repeat_interleave(group, dim=1) if group > 1 else k
        vr = v.repeat_interleave(group, dim=1) if group > 1 else v
        parts.append(flash_part(q, kr, vr, causal=True, scale=scale))
    out, _ = merge_parts(parts)
    return out


def attend_mla(
    attn: Any, x: torch.Tensor, rope: Rope, states: Sequence[MlaLayerKV]
) -> torch.Tensor:
    """DeepSeek-V3 MLA attention of ``x`` ``(B, n, hidden)`` over ``states`` (one per row).

    The query and latent projections run once for the whole batch; attention runs
    per row. Appends each row's new latent to its state.
    """
    b, n = x.shape[0], x.shape[1]
    heads = attn.num_heads
    nope, rope_dim = attn.qk_nope_head_dim, attn.qk_rope_head_dim
    rank = attn.kv_lora_rank
    if attn.q_lora_rank is None:
        qs = attn.q_proj(x)
    else:
        qs = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    qs = qs.view(b, n, heads, nope + rope_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(qs, [nope, rope_dim], dim=-1)
    compressed = attn.kv_a_proj_with_mqa(x)
    c, k_rot = torch.split(compressed, [rank, rope_dim], dim=-1)
    c = attn.kv_a_layernorm(c)
    k_rot = k_rot.view(b, 1, n, rope_dim)
    q_rot, k_rot = rope(q_rot, k_rot)
    outs = [
        _mla_row(
            attn, q_pass[i : i + 1], q_rot[i : i + 1], c[i : i + 1], k_rot[i : i + 1], state=st
        )
        for i, st in enumerate(states)
    ]
    out = outs[0] if b == 1 else torch.cat(outs, dim=0)
    vdim = attn.v_head_dim
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, heads * vdim))  # type: ignore[no-any-return]


def _mla_row(
    attn: Any,
    q_pass: torch.Tensor,
    q_rot: torch.Tensor,
    c: torch.Tensor,
    k_rot: torch.Tensor,
    *,
    state: MlaLayerKV,
) -> torch.Tensor:
    """One row's MLA attention ``(1, heads, n, v_head_dim)``; appends its latent."""
    n = c.shape[1]
    heads = attn.num_heads
    nope, rope_dim = attn.qk_nope_head_dim, attn.qk_rope_head_dim
    vdim, rank = attn.v_head_dim, attn.kv_lora_rank
    scale = float(attn.scaling)
    prior = state.parts(0)
    state.append(torch.cat([c[0], k_rot[0, 0]], dim=-1))
    w = attn.kv_b_proj.weight.view(heads, nope + vdim, rank)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    if prior:
        # Absorbed form over the cached latent: q_nope . (W_uk c) == (q_nope W_uk) . c,
        # so the prefix is never decompressed; values come back through W_uv.
        q_lat = torch.matmul(q_pass[0], w[:, :nope])
        q_abs = torch.cat([q_lat, q_rot[0]], dim=-1).reshape(heads * n, rank + rope_dim)
        o_lat, lse = merge_parts([latent_part(q_abs, p, rank, scale) for p in prior])
        o_old = torch.matmul(o_lat.view(heads, n, rank), w[:, nope:].transpose(1, 2))
        parts.append((o_old.unsqueeze(0), lse.view(1, heads, n)))
    kv = attn.kv_b_proj(c).view(1, n, heads, nope + vdim).transpose(1, 2)
    k_nope, v = torch.split(kv, [nope, vdim], dim=-1)
    key = torch.cat([k_nope, k_rot.expand(1, heads, n, rope_dim)], dim=-1)
    query = torch.cat([q_pass, q_rot], dim=-1)
    width = max(nope + rope_dim, vdim)
    if vdim < width:
        v = F.pad(v, (0, width - vdim))
    elif nope + rope_dim < width:
        key = F.pad(key, (0, width - nope - rope_dim))
        query = F.pad(query, (0, width - nope - rope_dim))
    o_new, lse_new = flash_part(
        query.contiguous(), key.contiguous(), v.contiguous(), causal=n > 1, scale=scale
    )
    parts.append((o_new[..., :vdim], lse_new))
    out, _ = merge_parts(parts)
    return out
