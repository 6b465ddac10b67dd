"""The cache-key contract every dscache component shares.

A prompt is cut into blocks of ``block_tokens`` token ids; only full blocks are
cached. Block ``i``'s key chains from block ``i - 1``::

    root     = SHA256("dscache/root/v1\\0" || fingerprint_digest
                      || u32le(len(salt)) || salt)
    key(0)   = SHA256("dscache/block/v1\\0" || root
                      || u32le(n) || u32le(tok_0) || ... || u32le(tok_n-1))
    key(i)   = SHA256("dscache/block/v1\\0" || key(i-1) || u32le(n) || u32le(tokens...))

A block whose KV depends on more than its tokens and its prefix (a LoRA adapter, an
image behind placeholder tokens) carries *extras*: a non-empty list of items, each a
list of strings and integers (``block_extra``). Such a block's key uses another
domain tag and appends the extras' canonical JSON ``x``::

    key(i)   = SHA256("dscache/block-extra/v1\\0" || key(i-1) || u32le(n) || u32le(tokens...)
                      || u32le(len(x)) || x)

A block without extras keys exactly as above (plain token blocks keep their keys), and
the two domain tags keep the forms apart.

``fingerprint_digest`` is SHA256("dscache/fingerprint/v1\\0" || canonical JSON of the
model fingerprint), where canonical JSON means ``json.dumps(obj, sort_keys=True,
separators=(",", ":"), ensure_ascii=True)``. The fingerprint covers everything that
changes the KV bytes: model id and revision, dtype, KV layout, tensor-parallel size
and rank, and the block size. It does not cover an exact codec (raw, zstd): a block
decodes to the same bytes whatever exact codec stored it. A lossy codec (int8) changes
the bytes a reader gets, so it is part of the fingerprint: ``extra["kv_codec"]``
(see ``with_kv_codec``); exact blocks carry no such entry.

Invariants:
    * Keys are 32 bytes and a pure function of (fingerprint, salt, token ids, each
      block's extras): they match across processes, restarts and nodes. No
      ``hash()``, no random seed.
    * Two blocks with the same tokens and prefix but different extras never share a
      key, and neither does any later block of their chains.
    * Two fingerprints that differ in any field never share a root, so two models
      never share a key.
    * Two tenants with different salts never share a key, so one tenant cannot see
      (or time) another tenant's cached prompts.
    * Token ids are encoded as fixed-width unsigned 32-bit little-endian integers.

The committed test vectors in ``tests/vectors/keys_v1.json`` pin this encoding; any
other implementation proves compatibility by reproducing them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

KEY_BYTES = 32
CONTRACT_VERSION = 1

_DOMAIN_FINGERPRINT = b"dscache/fingerprint/v1\x00"
_DOMAIN_ROOT = b"dscache/root/v1\x00"
_DOMAIN_BLOCK = b"dscache/block/v1\x00"
_DOMAIN_BLOCK_EXTRA = b"dscache/block-extra/v1\x00"
_DOMAIN_TENANT = b"dscache/tenant/v1\x00"
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class KVDtype:
    """One element type the contract knows.

    Attributes:
        name: the contract name (also torch's attribute name for it).
        storage: the numpy dtype its bytes travel in: bfloat16 and fp8 have no numpy
            dtype and travel as raw little-endian integers of their width.
        engine: the reference engine computes and caches KV in it.
    """

    name: str
    storage: np.dtype[np.generic]
    engine: bool = False

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return int(self.storage.itemsize)


#: Every element type the contract knows, by contract name: the one table the key
#: contract, the sidecar's codec and the model server's KV share.
KV_DTYPES: dict[str, KVDtype] = {
    d.name: d
    for d in (
        KVDtype("float32", np.dtype("<f4"), engine=True),
        KVDtype("float16", np.dtype("<f2"), engine=True),
        KVDtype("bfloat16", np.dtype("<u2"), engine=True),
        KVDtype("float8_e4m3fn", np.dtype("u1")),
        KVDtype("int8", np.dtype("i1")),
        KVDtype("uint8", np.dtype("u1")),
    )
}
#: dtype names the contract knows, with their size in bytes.
DTYPE_BYTES: dict[str, int] = {name: d.itemsize for name, d in KV_DTYPES.items()}


class LayoutKind(StrEnum):
    """How a model's attention stores its KV cache."""

    MHA = "mha"  # multi-head: K and V per head, num_kv_heads == num_attention_heads
    GQA = "gqa"  # grouped-query: K and V per KV head
    MLA = "mla"  # multi-head latent (DeepSeek-V2/V3): one compressed latent + rope key


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV cache across all layers.

    Attributes:
        kind: MHA, GQA or MLA.
        num_layers: number of attention layers whose KV is cached.
        dtype: element type of the cached tensors (a key of ``DTYPE_BYTES``).
        num_kv_heads: K/V heads per layer (MHA/GQA); 0 for MLA.
        head_dim: K head dimension (MHA/GQA); 0 for MLA.
        v_head_dim: V head dimension (MHA/GQA); 0 for MLA.
        kv_lora_rank: width of the compressed KV latent (MLA); 0 otherwise.
        qk_rope_head_dim: width of the decoupled rope key (MLA); 0 otherwise.
    """

    kind: LayoutKind
    num_layers: int
    dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
        if self.num_layers <= 0:
            raise ValueError("num_layers must be positive")
        if self.kind is LayoutKind.MLA:
            if self.kv_lora_rank <= 0 or self.qk_rope_head_dim < 0:
                raise ValueError("an MLA layout needs kv_lora_rank > 0 and qk_rope_head_dim >= 0")
            if self.num_kv_heads or self.head_dim or self.v_head_dim:
                raise ValueError("an MLA layout caches a latent, not per-head K/V")
        else:
            if self.num_kv_heads <= 0 or self.head_dim <= 0 or self.v_head_dim <= 0:
                raise ValueError("an MHA/GQA layout needs num_kv_heads, head_dim, v_head_dim > 0")
            if self.kv_lora_rank or self.qk_rope_head_dim:
                raise ValueError("kv_lora_rank/qk_rope_head_dim only apply to MLA")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    def elements_per_token_layer(self) -> int:
        """Elements one token occupies in one layer."""
        if self.kind is LayoutKind.MLA:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers."""
        return self.num_layers * self.elements_per_token_layer() * self.itemsize

    def block_bytes(self, block_tokens: int) -> int:
        """Raw (uncompressed) size of one block."""
        return self.bytes_per_token() * block_tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the kind as its string value."""
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that changes the bytes of a cached block.

    Attributes:
        model_id: model name or path the weights came from.
        revision: weights revision (commit, tag or content hash).
        layout: the KV layout, dtype included.
        block_tokens: tokens per block.
        tp_size: tensor-parallel world size.
        tp_rank: this shard's tensor-parallel rank.
        extra: further engine facts that change the bytes (e.g. rope scaling);
            string values only so the canonical encoding stays simple.
    """

    model_id: str
    revision: str
    layout: KVLayout
    block_tokens: int = 256
    tp_size: int = 1
    tp_rank: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError("tp_rank must be in [0, tp_size)")

    def canonical_json(self) -> bytes:
        """The canonical byte encoding hashed into the digest."""
        obj = {
            "contract": CONTRACT_VERSION,
            "model_id": self.model_id,
            "revision": self.revision,
            "layout": self.layout.to_dict(),
            "block_tokens": self.block_tokens,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "extra": dict(self.extra),
        }
        return _canonical(obj)

    def digest(self) -> bytes:
        """32-byte fingerprint digest."""
        return hashlib.sha256(_DOMAIN_FINGERPRINT + self.canonical_json()).digest()


#: ``ModelFingerprint.extra`` entry naming a lossy KV codec.
KV_CODEC_EXTRA = "kv_codec"


def with_kv_codec(fingerprint: ModelFingerprint, codec: str) -> ModelFingerprint:
    """``fingerprint`` for blocks stored with the lossy ``codec`` (int8): other keys.

    Exact codecs (``raw``, ``zstd``, ``auto``) leave the fingerprint as it is.
    """
    if codec in ("raw", "zstd", "auto"):
        return fingerprint
    return dataclasses.replace(fingerprint, extra={**fingerprint.extra, KV_CODEC_EXTRA: codec})


def tenant_salt(tenant: str, secret: bytes = b"") -> bytes:
    """Derives a tenant's salt from its id (a namespace or API-key id).

    With a ``secret`` the salt is HMAC-SHA256(secret, tenant), so nobody without the
    secret can compute another tenant's keys even from the stored index. Without one,
    it is SHA256 of the tenant id under a domain tag: still disjoint per tenant.
    """
    data = _DOMAIN_TENANT + tenant.encode("utf-8")
    if secret:
        return hmac.new(secret, data, hashlib.sha256).digest()
    return hashlib.sha256(data).digest()


def tenant_label(salt: bytes) -> str:
    """A short, non-reversible id of a salt that the sidecar stores per block.

    The sidecar needs it for ClearTenant and as a second isolation check; it never
    sees the tenant's name or secret.
    """
    return hashlib.sha256(b"dscache/tenant-label/v1\x00" + salt).hexdigest()[:32]


def root_key(fingerprint: ModelFingerprint, salt: bytes = b"") -> bytes:
    """The chain root for one model and one tenant."""
    fp = fingerprint.digest()
    return hashlib.sha256(_DOMAIN_ROOT + fp + struct.pack("<I", len(salt)) + salt).digest()


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Fixed-width u32 little-endian encoding of token ids; rejects out-of-range ids."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token ids must be one-dimensional")
    if arr.size and (
        arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID
    ):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


#: One item of a block's extras (e.g. ``("lora", name, digest)``).
ExtraItem = Sequence[str | int]


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def block_extra(items: Sequence[ExtraItem]) -> bytes:
    """The canonical encoding of one block's extras (``b""`` when it has none).

    Each item is a sequence of strings and integers whose first element names its
    kind; order matters and is the caller's (keep it deterministic).
    """
    out: list[list[str | int]] = []
    for item in items:
        fields = list(item)
        if not fields or not all(
            isinstance(f, str) or (isinstance(f, int) and not isinstance(f, bool)) for f in fields
        ):
            raise ValueError(f"a block extra is a non-empty list of strings and ints: {item!r}")
        out.append(fields)
    return _canonical(out) if out else b""


def chain_key(
    prev: bytes, block_token_ids: Sequence[int] | np.ndarray, extra: bytes = b""
) -> bytes:
    """The key of one block given its predecessor's key (or the root) and its extras
    (``block_extra``; ``b""`` for a plain token block)."""
    if len(prev) != KEY_BYTES:
        raise ValueError("previous key must be 32 bytes")
    return _block_hash(prev, encode_tokens(block_token_ids), extra)


def _block_hash(prev: bytes, enc: bytes, extra: bytes = b"") -> bytes:
    """A block's key from its predecessor's key, its encoded token ids and extras."""
    head = struct.pack("<I", len(enc) // 4)
    if not extra:
        return hashlib.sha256(_DOMAIN_BLOCK + prev + head + enc).digest()
    tail = struct.pack("<I", len(extra)) + extra
    return hashlib.sha256(_DOMAIN_BLOCK_EXTRA + prev + head + enc + tail).digest()


def block_keys(
    root: bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Keys of every full block of ``token_ids``; a trailing partial block has none.

    ``extras[i]`` is block ``i``'s ``block_extra`` (``b""``: none); blocks past the
    end of ``extras`` have none.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    if len(root) != KEY_BYTES:
        raise ValueError("previous key must be 32 bytes")
    n_full = len(token_ids) // block_tokens
    # One encoding (and one range check) for the whole prompt, then a hash per block:
    # chain_key's bytes, without its per-block conversions.
    enc = encode_tokens(np.asarray(token_ids)[: n_full * block_tokens])
    step = 4 * block_tokens
    extras = extras or ()
    keys: list[bytes] = []
    prev = root
    for i in range(n_full):
        prev = _block_hash(
            prev, enc[i * step : (i + 1) * step], extras[i] if i < len(extras) else b""
        )
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class KeyChain:
    """A model + tenant binding that turns token ids into block keys.

    Build one per (model, tenant) and reuse it: the root is computed once.
    """

    fingerprint: ModelFingerprint
    salt: bytes = b""

    @functools.cached_property
    def root(self) -> bytes:
        return root_key(self.fingerprint, self.salt)

    @functools.cached_property
    def tenant(self) -> str:
        return tenant_label(self.salt)

    @property
    def block_tokens(self) -> int:
        return self.fingerprint.block_tokens

    def keys(
        self, token_ids: Sequence[int] | np.ndarray, extras: Sequence[bytes] | None = None
    ) -> list[bytes]:
        """Keys of the full blocks of a prompt (``extras``: see ``block_keys``)."""
        return block_keys(self.root, token_ids, self.fingerprint.block_tokens, extras)


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
