"""Helpers of the vLLM connector tests: the prompts, probe configs, a flipped block."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dscache_sidecar.client import SidecarClient
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmProbe, vllm_python
from needs import missing

#: Where vLLM's pages are tested: the CPU always, a CUDA GPU where this machine has
#: one (no GPU: those cases are not collected, so never counted).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

#: A store small enough to copy per test (segment files are allocated up front).
STORE_FLAGS = ("--capacity", "256MiB", "--segment-size", "32MiB")

#: Two prompts: 1,000 tokens (three 256-token blocks reusable) and 700 (two).
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(100, 128_000) for _ in range(n)] for n in (1000, 700)]
NEW_TOKENS = 12
LOGPROBS = 5


@dataclass
class Warm:
    """A stopped sidecar's store holding the prompts' blocks, and what vLLM answered
    when it computed them (the reference)."""

    model: Path
    store: Path
    reference: list[dict[str, Any]]
    #: The sidecar tenant and the block keys of PROMPTS[0].
    tenant: str
    keys: list[bytes]


def need_vllm() -> None:
    try:
        vllm_python()
    except FileNotFoundError as exc:
        missing(str(exc))


#: ``probe_config`` arguments that configure the engine; the rest go to the connector.
ENGINE_OPTIONS = frozenset(
    {
        "dtype",
        "max_model_len",
        "max_lora_rank",
        "prompt_embeds",
        "limit_images",
        "tensor_parallel_size",
        "kv_space_gib",
    }
)


def probe_config(model: Path, sidecar: SidecarProcess | None, **extra: Any) -> dict[str, Any]:
    block_size = extra.pop("block_size", 128)
    cfg: dict[str, Any] = {"model": str(model), "block_size": block_size, "connector": None}
    cfg.update({k: extra.pop(k) for k in ENGINE_OPTIONS & set(extra)})
    if sidecar is not None:
        cfg["connector"] = "dscache"
        cfg["extra"] = {"socket": sidecar.socket, "data_dir": str(sidecar.data_dir), **extra}
    return cfg


def run(probe: VllmProbe, salt: str | None = None) -> list[dict[str, Any]]:
    prompts = [{"prompt_token_ids": p, "cache_salt": salt} for p in PROMPTS]
    outputs: list[dict[str, Any]] = probe.generate(
        prompts, max_tokens=NEW_TOKENS, logprobs=LOGPROBS
    )["outputs"]
    return outputs


def flip_block(
    client: SidecarClient, data_dir: Path, tenant: str, key: bytes, at: int = 4096
) -> None:
    """Flips one payload byte of a stored block in its segment file."""
    _rewrite(client, data_dir, tenant, key, at, lambda old: bytes([old[0] ^ 0x40]), 1)


def smear_block(
    client: SidecarClient, data_dir: Path, tenant: str, key: bytes, length: int = 1 << 16
) -> None:
    """Overwrites the first ``length`` payload bytes of a stored block with 0x42
    (float32 48.6): a change a model's answer shows."""
    _rewrite(client, data_dir, tenant, key, 0, lambda old: b"\x42" * len(old), length)


def _rewrite(
    client: SidecarClient,
    data_dir: Path,
    tenant: str,
    key: bytes,
    at: int,
    change: Callable[[bytes], bytes],
    length: int,
) -> None:
    grant = client.lease(tenant, [key])
    assert grant is not None and len(grant.blocks) == 1, "the block is not stored"
    loc = grant.blocks[0]
    with open(data_dir / loc.segment, "r+b") as f:
        f.seek(loc.offset + at)
        old = f.read(length)
        f.seek(loc.offset + at)
        f.write(change(old))
    client.release(grant.lease_id)
