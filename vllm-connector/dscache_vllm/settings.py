"""The connector's settings (``kv_connector_extra_config``) and the model fingerprint.

vLLM hands the connector the ``kv_connector_extra_config`` dict of its
``--kv-transfer-config``; :class:`ConnectorSettings` validates it (unknown keys
are an error, so a typo never silently disables the cache).

Contract:
    * The fingerprint covers what changes the stored bytes: model path and
      revision, the KV layout and dtype, tensor-parallel size and rank, the dscache
      block size, ``engine=vllm`` plus the stored layout's name, and what lays out
      the bytes inside vLLM's pages (vLLM's version, page size, device, attention
      kernel): blocks of the reference engine and of vLLM, or of two vLLM page
      layouts, never share a key.
    * A local checkpoint's revision is :func:`dscache.keys.checkpoint_revision` of
      its directory unless ``revision`` is set; a hub name uses vLLM's revision.
    * GQA/MHA: each tensor-parallel rank holds other KV heads, so rank and world size
      are in the fingerprint and a shard only ever finds its own blocks. MLA: the
      latent is computed by a replicated projection from the same hidden states on
      every rank, so its fingerprint is rank-independent (rank 0 of the world size)
      and one copy serves every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dscache.keys import KVLayout, LayoutKind, ModelFingerprint, checkpoint_revision

#: The environment variable with the tenant secret (the operator sets it).
SECRET_ENV = "DSCACHE_VLLM_TENANT_SECRET"  # noqa: S105 - a variable name, not a secret
#: Name of the stored block layout (see ``dscache_vllm.paged``); in the fingerprint.
STORED_LAYOUT = "pages-v2"


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` of ``--kv-transfer-config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: str = Field("/var/run/dscache/sidecar.sock", description="the sidecar's unix socket")
    data_dir: str | None = Field(
        None,
        description="the cache volume as mounted in vLLM's pod: lookups read its index "
        "in-process and loads map its segment files (without it: gRPC streaming)",
    )
    block_tokens: int = Field(256, gt=0, description="tokens per dscache block")
    revision: str | None = Field(None, description="weights revision in the fingerprint")
    tenant_secret_file: str | None = Field(
        None,
        description="file holding the secret that salts tenant keys (HMAC); without it, "
        "the environment variable DSCACHE_VLLM_TENANT_SECRET",
    )
    verify: Literal["background", "sync", "off"] = Field(
        "background",
        description="check each loaded block's checksum: while the forward runs (a block "
        "that fails is reported in the same step and recomputed), before the copies, or not",
    )
    verified_ttl_s: float = Field(
        60.0,
        ge=0,
        description="seconds a block whose checksum matched is trusted without hashing it "
        "again while its segment file is unchanged (0: hash on every load)",
    )
    layerwise_loads: Literal["auto", "on", "off"] = Field(
        "auto",
        description="copy loads layer by layer beside the forward (on) or all of them in "
        "start_load_kv (off); auto: layer by layer for pages on a GPU, all at once for "
        "host pages, whose copies and forward share the same cores",
    )
    copy_threads: int = Field(
        2,
        ge=1,
        description="threads that copy a load into vLLM's pages when they are host memory "
        "(the CPU backend); pages on a GPU are copied by one",
    )
    store_queue_blocks: int = Field(
        256, ge=0, description="blocks waiting to be written; beyond it saves are dropped"
    )
    timeout_s: float = Field(0.5, gt=0, description="deadline of one sidecar call, seconds")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Validates vLLM's ``kv_connector_extra_config``."""
        return cls.model_validate(dict(extra or {}))

    def tenant_secret(self) -> bytes:
        if not self.tenant_secret_file:
            return os.environ.get(SECRET_ENV, "").encode()
        return Path(self.tenant_secret_file).read_bytes().strip()


def fingerprint(
    *,
    model: str,
    revision: str | None,
    num_layers: int,
    kv_heads: int,
    head_size: int,
    dtype: str,
    block_tokens: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    page_layout: dict[str, str] | None = None,
    mla: tuple[int, int] | None = None,
) -> ModelFingerprint:
    """The fingerprint of a vLLM engine's stored blocks.

    ``page_layout`` names what decides the bytes inside one of vLLM's pages (the vLLM
    version, its page size, the attention kernel's layout): stored blocks are vLLM's
    page bytes, so engines that lay pages out differently never share a block.
    ``mla`` is an MLA model's ``(kv_lora_rank, qk_rope_head_dim)`` (``kv_heads`` and
    ``head_size`` are then ignored, and so is ``tp_rank``: see the module's contract).
    """
    path = Path(model)
    if revision is None:
        revision = checkpoint_revision(path) if path.is_dir() else "unknown"
    if mla is not None:
        layout = KVLayout(
            kind=LayoutKind.MLA,
            num_layers=num_layers,
            dtype=dtype,
            kv_lora_rank=mla[0],
            qk_rope_head_dim=mla[1],
        )
        tp_rank = 0
    else:
        layout = KVLayout(
            kind=LayoutKind.GQA,
            num_layers=num_layers,
            dtype=dtype,
            num_kv_heads=kv_heads,
            head_dim=head_size,
            v_head_dim=head_size,
        )
    return ModelFingerprint(
        model_id=model,
        revision=revision,
        layout=layout,
        block_tokens=block_tokens,
        tp_size=tp_size,
        tp_rank=tp_rank,
        extra={"engine": "vllm", "stored_layout": STORED_LAYOUT, **(page_layout or {})},
    )
