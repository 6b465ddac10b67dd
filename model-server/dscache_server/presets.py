"""Model presets: small models built from a config with seeded random weights.

Nothing can be downloaded here, so tests, the demo and the benchmark build models
from these configs. The architecture code is transformers' own; only the weights
are random.

Invariants:
    * A preset plus a seed determines every weight bit-for-bit on one torch
      version: weights are drawn parameter by parameter, in name order, from a
      ``torch.Generator`` seeded with the seed, independent of transformers' own
      initialisation order.
    * Every preset's vocabulary covers the DeepSeek tokenizer's ids (129 280).
    * The init is shaped for tests, not for quality: linear weights ~ 1/sqrt(fan_in)
      (residual-branch outputs scaled by 0.3), embeddings with std 0.25 and a random
      final-norm gain. With the plain init every position predicts the same "hub"
      token, which would make greedy-equality tests pass trivially; this one gives
      varied greedy sequences with top-1 margins far above float rounding.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

#: Vocabulary size of the DeepSeek-V3 tokenizer (ids 0..129279).
DEEPSEEK_VOCAB_SIZE = 129_280


@dataclass(frozen=True)
class Preset:
    """A named model configuration.

    Attributes:
        name: the preset name used on the command line.
        model_type: transformers' ``model_type`` (``llama`` or ``deepseek_v3``).
        description: one line for ``--help`` and the docs.
        config: keyword arguments of the transformers config class.
    """

    name: str
    model_type: str
    description: str
    config: dict[str, Any] = field(default_factory=dict)


#: Config keys every preset shares: the DeepSeek vocabulary, 32k positions, default
#: RoPE, tied embeddings, BOS 0 and EOS 1.
_COMMON: dict[str, Any] = {
    "vocab_size": DEEPSEEK_VOCAB_SIZE,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _llama_gqa(hidden: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """A Llama-style GQA config: head dim 64, MLP three times as wide as the model."""
    return {
        **_COMMON,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 64,
    }


_DEEPSEEK_V3_MLA_MOE: dict[str, Any] = {
    **_COMMON,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 128,
    "q_lora_rank": 256,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "rope_interleave": True,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="tiny-gqa",
            model_type="llama",
            description="Llama/Qwen2-style GQA, 12 layers, 8 query / 4 KV heads, ~104M params",
            config=_llama_gqa(hidden=512, layers=12, heads=8, kv_heads=4),
        ),
        Preset(
            name="mini-gqa",
            model_type="llama",
            description="the demo model: tiny-gqa's architecture at 4 layers and width 256",
            config=_llama_gqa(hidden=256, layers=4, heads=4, kv_heads=2),
        ),
        Preset(
            name="tiny-deepseek-v3",
            model_type="deepseek_v3",
            description="DeepSeek-V3 architecture (MLA + MoE), 6 layers, 8 heads, latent 128+32",
            config=_DEEPSEEK_V3_MLA_MOE,
        ),
    )
}


def build_random_model(preset: Preset, seed: int) -> Any:
    """Builds a transformers causal LM for ``preset`` with seeded random weights.

    Args:
        preset: which configuration.
        seed: weight seed; the same seed gives the same weights in every process.

    Returns:
        A ``PreTrainedModel`` in eval mode, float32, on CPU.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # A deep copy: transformers may adjust nested dicts (rope_parameters) in place.
    config = AutoConfig.for_model(preset.model_type, **copy.deepcopy(preset.config))
    # Default attention path: our engine runs its own attention over these weights,
    # but the reference forward (used by tests) must be the plain eager one.
    config._attn_implementation = "eager"
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is drawn below; skip transformers' init
        auto: Any = AutoModelForCausalLM  # transformers is untyped here
        model = auto.from_config(config, dtype=torch.float32)
    model.tie_weights()  # tying lives in the init path that no_init_weights skips
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            _init_param(name, param, generator)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    model.eval()
    return model


def _init_param(name: str, param: Any, generator: Any) -> None:
    if param.ndim == 1:
        if name.endswith("bias"):
            param.zero_()
        elif name == "model.norm.weight":
            param.normal_(0.0, 1.0, generator=generator)
        else:  # RMSNorm gains
            param.fill_(1.0)
        return
    if "embed_tokens" in name or "lm_head" in name:
        param.normal_(0.0, 0.25, generator=generator)
        return
    std = 1.0 / math.sqrt(param.shape[-1])
    if "down_proj" in name or "o_proj" in name:
        std *= 0.3
    param.normal_(0.0, std, generator=generator)
