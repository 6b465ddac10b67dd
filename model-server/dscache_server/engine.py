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
    * The model runs in its weights' dtype (float32, float16 or bfloat16), and the
      KV is cached in that dtype (the layout's, so part of every key): a restored
      block holds the very bytes a recompute of that prefix gives.
    * Restored chunks are only read, never written: they may be read-only views on
      a mapped segment.
    * ``Engine.decode(seqs, ids)`` appends one token to each sequence in one batched
      forward (projections, MLPs and the output layer once for the batch, attention
      per sequence); row ``i`` of its logits equals ``forward(seqs[i], [ids[i]])``
      to float rounding.
    * Forwards of different sequences may run on different threads at once (the
      modules are only read); one sequence is driven by one thread at a time.
      Exporting blocks of a finished prefill from another thread is safe (``kv``
      invariants).
    * Supported architectures: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (MHA/GQA;
      no sliding window) and ``deepseek_v3`` (MLA). Anything else is a clear error.

Loading weights (presets, checkpoints) is ``loading``; the attention itself is
``attention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dscache.keys import KVLayout, LayoutKind, ModelFingerprint
from dscache_server.attention import Rope, RopeFn, attend_gqa, attend_mla
from dscache_server.kv import LayoutAdapter, MlaLayerKV, SequenceKV, dtype_name

GQA_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
MLA_TYPES = frozenset({"deepseek_v3"})
ENGINE_TAG = "dscache-reference/1"


class Engine(Protocol):
    """What the request path needs from a model engine.

    Attributes:
        model_id: name the API reports for the model.
        fingerprint: the key contract's fingerprint of this model and block size.
        adapter: block <-> KV state conversion for this model's layout.
        max_context: longest sequence (prompt + completion) the model accepts.
        eos_token_ids: token ids that end a completion.
    """

    model_id: str
    fingerprint: ModelFingerprint
    adapter: LayoutAdapter
    max_context: int
    eos_token_ids: frozenset[int]

    def new_sequence(self) -> SequenceKV:
        """An empty KV state."""
        ...

    def forward(self, seq: SequenceKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Appends ``token_ids`` to ``seq``; returns the next-token logits ``(vocab,)``."""
        ...

    def decode(self, seqs: Sequence[SequenceKV], token_ids: Sequence[int]) -> torch.Tensor:
        """Appends one token to each sequence in one forward; logits ``(len(seqs), vocab)``."""
        ...

    def extend(self, seq: SequenceKV, token_ids: Sequence[int]) -> None:
        """Appends ``token_ids`` to ``seq`` without computing logits."""
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
    """The reference engine: transformers modules, our attention and KV state.

    Attributes:
        model_id: preset name or checkpoint path (the name the API reports).
        fingerprint: the key contract's fingerprint of this model and block size.
        adapter: block <-> KV state conversion for this model's layout.
        max_context: longest prompt + completion.
        eos_token_ids: ids that end a completion.
        vocab_size: rows of the output layer.
        hf_model: the underlying transformers model (tests compare against its forward).
    """

    def __init__(
        self,
        model: Any,
        source: ModelSource,
        *,
        block_tokens: int = 256,
        max_context: int | None = None,
    ) -> None:
        config = model.config
        _check_supported(config)
        base = model.model
        self.hf_model = model
        self.model_id = source.model_id
        self.vocab_size = int(config.vocab_size)
        self._modules = (base.embed_tokens, base.norm, base.rotary_emb, model.lm_head)
        self._layers = list(base.layers[: config.num_hidden_layers])
        self._rope_fn = _rope_function(config)
        # The KV is kept in the model's own dtype (part of the layout, so of every key).
        layout = _layout_of(config, dtype_name(next(model.parameters()).dtype))
        self.adapter = LayoutAdapter(layout, block_tokens)
        self.fingerprint = ModelFingerprint(
            model_id=source.model_id,
            revision=source.revision,
            layout=layout,
            block_tokens=block_tokens,
            extra={"engine": ENGINE_TAG, "arch": config.model_type, **source.extra},
        )
        limit = int(getattr(config, "max_position_embeddings", 0) or 0) or 32768
        self.max_context = min(max_context, limit) if max_context else limit
        eos = config.eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_token_ids = frozenset(int(i) for i in ids)

    @property
    def layout(self) -> KVLayout:
        """The KV layout."""
        return self.adapter.layout

    def new_sequence(self) -> SequenceKV:
        """An empty KV state."""
        return self.adapter.new_sequence()

    @torch.no_grad()
    def forward(self, seq: SequenceKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Runs ``token_ids`` after ``seq``; returns next-token logits ``(vocab,)``."""
        logits = self._append(seq, token_ids, head=True)
        assert logits is not None
        return logits[0]

    @torch.no_grad()
    def forward_all(self, seq: SequenceKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Runs ``token_ids`` after ``seq`` in one forward; returns the next-token
        logits after each of them ``(len(token_ids), vocab)`` (teacher forcing: row
        ``i`` scores the token that follows ``token_ids[i]``)."""
        logits = self._append(seq, token_ids, head=True, every=True)
        assert logits is not None
        return logits[0]

    @torch.no_grad()
    def extend(self, seq: SequenceKV, token_ids: Sequence[int]) -> None:
        """Appends ``token_ids`` to ``seq`` without computing logits (a prefill chunk
        that is not the prompt's last: the output layer is a decode step's cost)."""
        self._append(seq, token_ids, head=False)

    def _append(
        self, seq: SequenceKV, token_ids: Sequence[int], *, head: bool, every: bool = False
    ) -> torch.Tensor | None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("a forward needs at least one token")
        if seq.length + n > self.max_context:
            raise ValueError("sequence longer than the model's context")
        ids = torch.tensor(list(token_ids), dtype=torch.long).unsqueeze(0)
        positions = torch.arange(seq.length, seq.length + n).unsqueeze(0)
        return self._run([seq], ids, positions, head=head, every=every)

    @torch.no_grad()
    def decode(self, seqs: Sequence[SequenceKV], token_ids: Sequence[int]) -> torch.Tensor:
        """One new token for each of ``seqs`` in one batched forward.

        Returns:
            Next-token logits ``(len(seqs), vocab)``; row ``i`` equals
            ``forward(seqs[i], [token_ids[i]])`` to float rounding.
        """
        if len(seqs) != len(token_ids) or not seqs:
            raise ValueError("decode needs one token per sequence")
        if any(s.length + 1 > self.max_context for s in seqs):
            raise ValueError("sequence longer than the model's context")
        ids = torch.tensor(list(token_ids), dtype=torch.long).unsqueeze(1)
        positions = torch.tensor([s.length for s in seqs], dtype=torch.long).unsqueeze(1)
        logits = self._run(seqs, ids, positions, head=True)
        assert logits is not None
        return logits

    def _run(
        self,
        seqs: Sequence[SequenceKV],
        ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        head: bool,
        every: bool = False,
    ) -> torch.Tensor | None:
        """Rows ``ids`` ``(B, n)`` at ``positions`` after each sequence; the last
        token's logits ``(B, vocab)`` when ``head``, every token's ``(B, n, vocab)``
        when ``every`` too."""
        embed, norm, rotary, lm_head = self._modules
        hidden = embed(ids)
        cos, sin = rotary(hidden, positions)
        rope = Rope(self._rope_fn, cos, sin)
        for i, layer in enumerate(self._layers):
            normed = layer.input_layernorm(hidden)
            states = [seq.layers[i] for seq in seqs]
            if isinstance(states[0], MlaLayerKV):
                attn = attend_mla(layer.self_attn, normed, rope, states)  # type: ignore[arg-type]
            else:
                attn = attend_gqa(layer.self_attn, normed, rope, states)  # type: ignore[arg-type]
            hidden = hidden + attn
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for seq in seqs:
            seq.length += ids.shape[1]
        if not head:
            return None
        logits: torch.Tensor = lm_head(norm(hidden if every else hidden[:, -1, :]))
        return logits

    def reference_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits from transformers' own forward (for tests)."""
        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            out = self.hf_model(input_ids=ids, use_cache=False, logits_to_keep=1)
            logits: torch.Tensor = out.logits[0, -1]
            return logits


def _check_supported(config: Any) -> None:
    if config.model_type not in GQA_TYPES | MLA_TYPES:
        supported = ", ".join(sorted(GQA_TYPES | MLA_TYPES))
        raise ValueError(f"unsupported architecture {config.model_type!r}; supported: {supported}")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError("sliding-window attention is not supported by the reference engine")


def _layout_of(config: Any, dtype: str) -> KVLayout:
    layers = int(config.num_hidden_layers)
    if config.model_type in MLA_TYPES:
        return KVLayout(
            kind=LayoutKind.MLA,
            num_layers=layers,
            dtype=dtype,
            kv_lora_rank=int(config.kv_lora_rank),
            qk_rope_head_dim=int(config.qk_rope_head_dim),
        )
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return KVLayout(
        kind=LayoutKind.MHA if kv_heads == heads else LayoutKind.GQA,
        num_layers=layers,
        dtype=dtype,
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
