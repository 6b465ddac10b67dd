"""The engine interface and the reference engine on Hugging Face transformers.

The reference engine keeps transformers' modules (embeddings, norms, projections,
MLPs and MoE, rotary embeddings) and runs its own attention over them, because the
cache needs two things transformers' caches do not give: attention over restored
blocks without concatenating them (``kv.SequenceKV``), and for MLA a cache of the
compressed latent rather than of decompressed per-head K/V.

Contract:
    * ``Engine.forward(seq, ids)`` appends ``ids`` to ``seq`` and returns the
      next-token logits after the last id. Running a prefix, exporting its blocks,
      restoring them into a fresh sequence and running the suffix gives the same
      logits as running everything at once, to float rounding (<= 1e-4 in fp32).
    * Restored chunks are only read, never written: they may be read-only views on
      a mapped segment.
    * Forwards of different sequences may run on different threads at once (the
      modules are only read); one sequence is driven by one thread at a time.
      Exporting blocks of a finished prefill from another thread is safe (``kv``
      invariants).
    * Supported architectures: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (MHA/GQA;
      no sliding window) and ``deepseek_v3`` (MLA). Anything else is a clear error.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from dscache.keys import KVLayout, LayoutKind, ModelFingerprint
from dscache_server.kv import (
    GqaLayerKV,
    LayoutAdapter,
    MlaLayerKV,
    SequenceKV,
    flash_part,
    latent_part,
    merge_parts,
)
from dscache_server.presets import PRESETS, build_random_model

log = logging.getLogger(__name__)

GQA_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
MLA_TYPES = frozenset({"deepseek_v3"})
ENGINE_TAG = "dscache-reference/1"

RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Engine(Protocol):
    """What the request path needs from a model engine."""

    @property
    def model_id(self) -> str:
        """Name the API reports for the model."""
        ...

    @property
    def fingerprint(self) -> ModelFingerprint:
        """The key contract's fingerprint of this model and block size."""
        ...

    @property
    def adapter(self) -> LayoutAdapter:
        """Block <-> KV state conversion for this model's layout."""
        ...

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + completion) the model accepts."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a completion."""
        ...

    def new_sequence(self) -> SequenceKV:
        """An empty KV state."""
        ...

    def forward(self, seq: SequenceKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Appends ``token_ids`` to ``seq``; returns the next-token logits ``(vocab,)``."""
        ...


@dataclass(frozen=True)
class ModelSource:
    """Where the weights came from.

    Attributes:
        model_id: preset name or checkpoint path.
        revision: a string that changes whenever the weights change.
        preset: True for a random-weight preset.
    """

    model_id: str
    revision: str
    preset: bool
    extra: dict[str, str] = field(default_factory=dict)


class TransformersEngine:
    """The reference engine: transformers modules, our attention and KV state."""

    def __init__(
        self,
        model: Any,
        source: ModelSource,
        *,
        block_tokens: int = 256,
        max_context: int | None = None,
    ) -> None:
        config = model.config
        self._model = model
        self._config = config
        self._source = source
        self._type: str = config.model_type
        if self._type not in GQA_TYPES | MLA_TYPES:
            supported = ", ".join(sorted(GQA_TYPES | MLA_TYPES))
            raise ValueError(f"unsupported architecture {self._type!r}; supported: {supported}")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ValueError("sliding-window attention is not supported by the reference engine")
        base = model.model
        self._embed = base.embed_tokens
        self._layers = list(base.layers[: config.num_hidden_layers])
        self._norm = base.norm
        self._rotary = base.rotary_emb
        self._lm_head = model.lm_head
        self._rope_fn = _rope_function(config)
        layout = _layout_of(config)
        self._adapter = LayoutAdapter(layout, block_tokens)
        self._fingerprint = ModelFingerprint(
            model_id=source.model_id,
            revision=source.revision,
            layout=layout,
            block_tokens=block_tokens,
            extra={"engine": ENGINE_TAG, "arch": self._type, **source.extra},
        )
        limit = int(getattr(config, "max_position_embeddings", 0) or 0) or 32768
        self._max_context = min(max_context, limit) if max_context else limit
        eos = config.eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self._eos = frozenset(int(i) for i in ids)

    @property
    def model_id(self) -> str:
        """Preset name or checkpoint path."""
        return self._source.model_id

    @property
    def fingerprint(self) -> ModelFingerprint:
        """The key contract's fingerprint."""
        return self._fingerprint

    @property
    def adapter(self) -> LayoutAdapter:
        """Block conversion for this layout."""
        return self._adapter

    @property
    def layout(self) -> KVLayout:
        """The KV layout."""
        return self._adapter.layout

    @property
    def max_context(self) -> int:
        """Longest prompt + completion."""
        return self._max_context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a completion."""
        return self._eos

    @property
    def hf_model(self) -> Any:
        """The underlying transformers model (tests compare against its forward)."""
        return self._model

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer."""
        return int(self._config.vocab_size)

    def new_sequence(self) -> SequenceKV:
        """An empty KV state."""
        return self._adapter.new_sequence()

    @torch.no_grad()
    def forward(self, seq: SequenceKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Runs ``token_ids`` after ``seq``; returns next-token logits ``(vocab,)``."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if seq.length + n > self._max_context:
            raise ValueError("sequence longer than the model's context")
        ids = torch.tensor(list(token_ids), dtype=torch.long).unsqueeze(0)
        positions = torch.arange(seq.length, seq.length + n).unsqueeze(0)
        hidden = self._embed(ids)
        cos, sin = self._rotary(hidden, positions)
        for i, layer in enumerate(self._layers):
            normed = layer.input_layernorm(hidden)
            state = seq.layers[i]
            if isinstance(state, MlaLayerKV):
                attn = self._attend_mla(layer.self_attn, normed, cos, sin, state)
            else:
                attn = self._attend_gqa(layer.self_attn, normed, cos, sin, state)
            hidden = hidden + attn
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        seq.length += n
        last = self._norm(hidden[:, -1:, :])
        logits: torch.Tensor = self._lm_head(last)[0, -1]
        return logits

    def _attend_gqa(
        self,
        attn: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: GqaLayerKV,
    ) -> torch.Tensor:
        n = x.shape[1]
        d = state.head_dim
        q = attn.q_proj(x).view(1, n, -1, d)
        k = attn.k_proj(x).view(1, n, -1, d)
        v = attn.v_proj(x).view(1, n, -1, d)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q, k = self._rope_fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        q = q.contiguous()
        k = k.contiguous()
        v = v.transpose(1, 2).contiguous()
        hq, hkv = q.shape[1], k.shape[1]
        group = hq // hkv
        scale = float(attn.scaling)
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
        return attn.o_proj(out.transpose(1, 2).reshape(1, n, hq * d))  # type: ignore[no-any-return]

    def _attend_mla(
        self,
        attn: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: MlaLayerKV,
    ) -> torch.Tensor:
        n = x.shape[1]
        heads = attn.num_heads
        nope, rope = attn.qk_nope_head_dim, attn.qk_rope_head_dim
        vdim, rank = attn.v_head_dim, attn.kv_lora_rank
        scale = float(attn.scaling)
        if attn.q_lora_rank is None:
            qs = attn.q_proj(x)
        else:
            qs = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        qs = qs.view(1, n, heads, nope + rope).transpose(1, 2)
        q_pass, q_rot = torch.split(qs, [nope, rope], dim=-1)
        compressed = attn.kv_a_proj_with_mqa(x)
        c, k_rot = torch.split(compressed, [rank, rope], dim=-1)
        c = attn.kv_a_layernorm(c)
        k_rot = k_rot.view(1, 1, n, rope)
        q_rot, k_rot = self._rope_fn(q_rot, k_rot, cos, sin)
        prior = state.parts(0)
        state.append(torch.cat([c[0], k_rot[0, 0]], dim=-1))
        w = attn.kv_b_proj.weight.view(heads, nope + vdim, rank)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if prior:
            # Absorbed form over the cached latent: q_nope . (W_uk c) == (q_nope W_uk) . c,
            # so the prefix is never decompressed; values come back through W_uv.
            q_lat = torch.matmul(q_pass[0], w[:, :nope])
            q_abs = torch.cat([q_lat, q_rot[0]], dim=-1).reshape(heads * n, rank + rope)
            o_lat, lse = merge_parts([latent_part(q_abs, p, rank, scale) for p in prior])
            o_old = torch.matmul(o_lat.view(heads, n, rank), w[:, nope:].transpose(1, 2))
            parts.append((o_old.unsqueeze(0), lse.view(1, heads, n)))
        kv = attn.kv_b_proj(c).view(1, n, heads, nope + vdim).transpose(1, 2)
        k_nope, v = torch.split(kv, [nope, vdim], dim=-1)
        key = torch.cat([k_nope, k_rot.expand(1, heads, n, rope)], dim=-1)
        query = torch.cat([q_pass, q_rot], dim=-1)
        width = max(nope + rope, vdim)
        if vdim < width:
            v = F.pad(v, (0, width - vdim))
        elif nope + rope < width:
            key = F.pad(key, (0, width - nope - rope))
            query = F.pad(query, (0, width - nope - rope))
        o_new, lse_new = flash_part(
            query.contiguous(), key.contiguous(), v.contiguous(), causal=n > 1, scale=scale
        )
        parts.append((o_new[..., :vdim], lse_new))
        out, _ = merge_parts(parts)
        return attn.o_proj(out.transpose(1, 2).reshape(1, n, heads * vdim))  # type: ignore[no-any-return]

    def reference_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits from transformers' own forward (for tests)."""
        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            out = self._model(input_ids=ids, use_cache=False, logits_to_keep=1)
            logits: torch.Tensor = out.logits[0, -1]
            return logits


def _layout_of(config: Any) -> KVLayout:
    layers = int(config.num_hidden_layers)
    if config.model_type in MLA_TYPES:
        return KVLayout(
            kind=LayoutKind.MLA,
            num_layers=layers,
            dtype="float32",
            kv_lora_rank=int(config.kv_lora_rank),
            qk_rope_head_dim=int(config.qk_rope_head_dim),
        )
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return KVLayout(
        kind=LayoutKind.MHA if kv_heads == heads else LayoutKind.GQA,
        num_layers=layers,
        dtype="float32",
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
    )


def _rope_function(config: Any) -> RopeFn:
    if config.model_type in MLA_TYPES:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        if getattr(config, "rope_interleave", False):
            fn: RopeFn = ds.apply_rotary_pos_emb_interleave
        else:
            fn = ds.apply_rotary_pos_emb
        return fn
    from transformers.models.llama import modeling_llama

    llama_fn: RopeFn = modeling_llama.apply_rotary_pos_emb
    return llama_fn


def weights_digest(model: Any) -> str:
    """SHA-256 over every parameter's bytes, in name order (random-weight presets)."""
    h = hashlib.sha256()
    for name, param in sorted(model.state_dict().items(), key=lambda item: item[0]):
        h.update(name.encode())
        h.update(param.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def checkpoint_revision(path: Path) -> str:
    """A cheap revision of a local checkpoint: config plus each weight file's size and ends.

    Hashing hundreds of GB of weights at start-up is not an option, so the digest
    covers ``config.json``, every weight file's name and size, and its first and last
    MiB. Pass an explicit revision (``--revision``) when that is not enough.
    """
    h = hashlib.sha256()
    config = path / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for f in sorted(path.iterdir()):
        if f.suffix not in {".safetensors", ".bin", ".pt"}:
            continue
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()


def load_engine(
    model: str,
    *,
    seed: int = 0,
    block_tokens: int = 256,
    max_context: int | None = None,
    revision: str | None = None,
    threads: int | None = None,
) -> TransformersEngine:
    """Builds the reference engine for a preset name or a local checkpoint directory.

    Args:
        model: a name in ``presets.PRESETS`` or a directory with ``config.json``.
        seed: weight seed for presets.
        block_tokens: tokens per cache block.
        max_context: cap on prompt + completion tokens (default: the model's).
        revision: override of the weights revision in the fingerprint.
        threads: torch intra-op threads (default: torch's choice).

    Raises:
        ValueError: unknown preset, missing directory or unsupported architecture.
    """
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    if model in PRESETS:
        hf = build_random_model(PRESETS[model], seed)
        digest = weights_digest(hf)
        source = ModelSource(
            model_id=model, revision=revision or f"seed-{seed}-{digest[:16]}", preset=True
        )
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            known = ", ".join(sorted(PRESETS))
            raise ValueError(f"{model!r} is neither a preset ({known}) nor a checkpoint dir")
        from transformers import AutoModelForCausalLM

        auto: Any = AutoModelForCausalLM  # transformers is untyped here
        hf = auto.from_pretrained(
            str(path), local_files_only=True, dtype=torch.float32, attn_implementation="eager"
        )
        hf.eval()
        source = ModelSource(
            model_id=str(path), revision=revision or checkpoint_revision(path), preset=False
        )
    engine = TransformersEngine(hf, source, block_tokens=block_tokens, max_context=max_context)
    log.info(
        "loaded %s (revision %s, layout %s) in %.1f s",
        source.model_id,
        source.revision[:24],
        engine.layout.kind.value,
        time.perf_counter() - started,
    )
    return engine


def to_numpy(logits: torch.Tensor) -> np.ndarray:
    """Logits as a float32 numpy array."""
    return logits.detach().to(torch.float32).numpy()
