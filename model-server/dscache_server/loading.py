"""Loading the reference engine: random-weight presets and local checkpoints.

Contract:
    * ``load_engine(name_or_dir)`` builds a ``TransformersEngine`` from a preset name
      (``presets.PRESETS``, weights from the seed) or a local checkpoint directory
      (``config.json`` + weights, never downloaded).
    * The fingerprint's revision changes whenever the weights change: presets hash
      every weight (``weights_digest``); checkpoints hash their config and each
      weight file's name, size and ends (``checkpoint_revision``), unless a
      revision is given.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from dscache.keys import checkpoint_revision
from dscache_server.engine import ModelSource, TransformersEngine
from dscache_server.kv import KV_DTYPES
from dscache_server.presets import PRESETS, build_random_model

log = logging.getLogger(__name__)


def weights_digest(model: Any) -> str:
    """SHA-256 over every parameter's bytes, in name order (random-weight presets)."""
    h = hashlib.sha256()
    for name, param in sorted(model.state_dict().items(), key=lambda item: item[0]):
        h.update(name.encode())
        h.update(param.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def load_engine(
    model: str,
    *,
    seed: int = 0,
    block_tokens: int = 256,
    max_context: int | None = None,
    revision: str | None = None,
    threads: int | None = None,
    dtype: str = "float32",
) -> TransformersEngine:
    """Builds the reference engine for a preset name or a local checkpoint directory.

    Args:
        model: a name in ``presets.PRESETS`` or a directory with ``config.json``.
        seed: weight seed for presets.
        block_tokens: tokens per cache block.
        max_context: cap on prompt + completion tokens (default: the model's).
        revision: override of the weights revision in the fingerprint.
        threads: torch intra-op threads (default: torch's choice).
        dtype: the weights', activations' and cached KV's dtype: ``float32``,
            ``bfloat16`` or ``float16``. A preset draws the same float32 weights
            whatever the dtype, then converts them (its revision names the draw).

    Raises:
        ValueError: unknown preset, missing directory, unsupported architecture or dtype.
    """
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)}, not {dtype!r}")
    torch_dtype = KV_DTYPES[dtype][0]
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    if model in PRESETS:
        hf = build_random_model(PRESETS[model], seed)
        digest = weights_digest(hf)
        hf = hf.to(torch_dtype)
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
            str(path), local_files_only=True, dtype=torch_dtype, attn_implementation="eager"
        )
        hf.eval()
        source = ModelSource(
            model_id=str(path), revision=revision or checkpoint_revision(path), preset=False
        )
    engine = TransformersEngine(hf, source, block_tokens=block_tokens, max_context=max_context)
    log.info(
        "loaded %s (revision %s, layout %s, %s) in %.1f s",
        source.model_id,
        source.revision[:24],
        engine.layout.kind.value,
        dtype,
        time.perf_counter() - started,
    )
    return engine
