"""What a local checkpoint directory says about its model, without importing vLLM.

Contract:
    * :func:`uses_mla` is True for a DeepSeek-V2/V3-style model (``kv_lora_rank`` in
      its ``config.json``), False for any other model and for a name that is not a
      readable checkpoint directory (a hub name: nothing to read here).
"""

from __future__ import annotations

import json
from pathlib import Path


def uses_mla(model: str) -> bool:
    """Whether the checkpoint directory ``model`` is a DeepSeek-V2/V3-style MLA model."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("kv_lora_rank") is not None
