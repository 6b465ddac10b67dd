"""The cache-key contract: committed vectors, and the properties every component relies on."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from dscache.keys import (
    KeyChain,
    KVLayout,
    LayoutKind,
    ModelFingerprint,
    block_extra,
    block_keys,
    chain_key,
    root_key,
    tenant_label,
    tenant_salt,
)

VECTORS = Path(__file__).parent / "vectors" / "keys_v1.json"


def _fingerprint(d: dict) -> ModelFingerprint:
    lay = dict(d["layout"])
    lay["kind"] = LayoutKind(lay["kind"])
    return ModelFingerprint(layout=KVLayout(**lay), **{k: v for k, v in d.items() if k != "layout"})


def _spec_keys(
    canonical: bytes, salt: bytes, tokens: list[int], bt: int, extras: list | None = None
) -> list[bytes]:
    """The contract written out from its docstring with hashlib only."""
    extras = extras or []
    fp = hashlib.sha256(b"dscache/fingerprint/v1\x00" + canonical).digest()
    prev = hashlib.sha256(
        b"dscache/root/v1\x00" + fp + struct.pack("<I", len(salt)) + salt
    ).digest()
    out = []
    for i in range(len(tokens) // bt):
        blk = tokens[i * bt : (i + 1) * bt]
        enc = b"".join(struct.pack("<I", t) for t in blk)
        items = extras[i] if i < len(extras) else []
        if items:
            x = json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            tail = struct.pack("<I", len(x)) + x.encode()
            prev = hashlib.sha256(
                b"dscache/block-extra/v1\x00" + prev + struct.pack("<I", len(blk)) + enc + tail
            ).digest()
        else:
            prev = hashlib.sha256(
                b"dscache/block/v1\x00" + prev + struct.pack("<I", len(blk)) + enc
            ).digest()
        out.append(prev)
    return out


def test_committed_vectors_match_the_implementation_and_the_spec() -> None:
    # The vectors were written by another process on another machine: matching them is
    # what "keys are stable across processes, hash seeds and hosts" means for a user.
    data = json.loads(VECTORS.read_text())
    assert data["contract"] == 1
    assert len(data["cases"]) >= 6
    assert sum(1 for c in data["cases"] if c.get("extras")) >= 3
    for case in data["cases"]:
        fp = _fingerprint(case["fingerprint"])
        exp = case["expected"]
        salt = b""
        if case["tenant"]:
            secret = case["tenant"]["secret"].encode()
            salt = tenant_salt(case["tenant"]["id"], secret)
            if secret:  # HMAC form, recomputed by hand
                assert (
                    salt
                    == hmac.new(
                        secret,
                        b"dscache/tenant/v1\x00" + case["tenant"]["id"].encode(),
                        hashlib.sha256,
                    ).digest()
                )
        assert fp.canonical_json().decode() == exp["canonical_json"], case["name"]
        assert fp.digest().hex() == exp["fingerprint_digest"]
        assert salt.hex() == exp["salt"]
        assert tenant_label(salt) == exp["tenant_label"]
        assert root_key(fp, salt).hex() == exp["root"]
        extras = case.get("extras")
        encoded = [block_extra(items) for items in extras] if extras else None
        keys = KeyChain(fp, salt).keys(case["tokens"], encoded)
        assert [k.hex() for k in keys] == exp["block_keys"], case["name"]
        spec = _spec_keys(
            exp["canonical_json"].encode(), salt, case["tokens"], fp.block_tokens, extras
        )
        assert [k.hex() for k in spec] == exp["block_keys"]
    assert base64.b64decode("c2VjcmV0") == b"secret"


LAYOUT = KVLayout(LayoutKind.GQA, 12, "float32", num_kv_heads=4, head_dim=64, v_head_dim=64)


def test_only_full_blocks_get_keys_and_chains_share_prefixes() -> None:
    chain = KeyChain(ModelFingerprint("m", "r", LAYOUT, block_tokens=4))
    a = chain.keys(list(range(11)))
    b = chain.keys(list(range(8)) + [99, 98, 97, 96])
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]  # same leading tokens, same keys
    assert chain.keys([1, 2, 3]) == []


def test_a_changed_token_changes_that_key_and_every_later_one() -> None:
    chain = KeyChain(ModelFingerprint("m", "r", LAYOUT, block_tokens=4))
    toks = list(range(16))
    changed = toks.copy()
    changed[5] = 1000
    a, b = chain.keys(toks), chain.keys(changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"revision": "r2"},
        {"block_tokens": 8},
        {"tp_size": 2, "tp_rank": 1},
        {
            "layout": KVLayout(
                LayoutKind.GQA, 12, "bfloat16", num_kv_heads=4, head_dim=64, v_head_dim=64
            )
        },
        {"layout": KVLayout(LayoutKind.MLA, 12, "float32", kv_lora_rank=512, qk_rope_head_dim=64)},
        {"extra": {"rope_scaling": "yarn"}},
    ],
)
def test_every_fingerprint_field_separates_models(change: dict) -> None:
    base = {"model_id": "m", "revision": "r", "layout": LAYOUT, "block_tokens": 4}
    toks = list(range(8))
    a = KeyChain(ModelFingerprint(**base)).keys(toks)
    b = KeyChain(ModelFingerprint(**{**base, **change})).keys(toks[:8])
    assert not set(a) & set(b)


def test_tenants_never_share_keys_and_labels_hide_the_name() -> None:
    fp = ModelFingerprint("m", "r", LAYOUT, block_tokens=4)
    toks = list(range(64))
    a = KeyChain(fp, tenant_salt("bank-a")).keys(toks)
    b = KeyChain(fp, tenant_salt("bank-b")).keys(toks)
    c = KeyChain(fp, tenant_salt("bank-a", b"server-secret")).keys(toks)
    assert not set(a) & set(b) and not set(a) & set(c)
    label = tenant_label(tenant_salt("bank-a"))
    assert len(label) == 32 and "bank" not in label


def test_extras_separate_blocks_and_everything_after_them() -> None:
    chain = KeyChain(ModelFingerprint("m", "r", LAYOUT, block_tokens=4))
    toks = list(range(16))
    plain = chain.keys(toks)
    # No extras, or empty ones, is the plain chain: existing stores stay valid.
    assert chain.keys(toks, [b"", b""]) == plain
    image_a = block_extra([["mm", "hash-a", 2]])
    image_b = block_extra([["mm", "hash-b", 2]])
    a = chain.keys(toks, [b"", image_a])
    b = chain.keys(toks, [b"", image_b])
    # The block before the image is shared; the image's block and every later one differ.
    assert a[0] == b[0] == plain[0]
    assert not set(a[1:]) & set(b[1:]) and not set(a[1:]) & set(plain[1:])
    # The same item at another place in the block is another key.
    assert chain.keys(toks, [b"", block_extra([["mm", "hash-a", 3]])])[1] != a[1]
    assert chain_key(plain[0], toks[4:8], image_a) == a[1]
    lora = [block_extra([["lora", "x", "sha256:1"]])] * 4
    other = [block_extra([["lora", "x", "sha256:2"]])] * 4
    assert not set(chain.keys(toks, lora)) & set(chain.keys(toks, other))
    with pytest.raises(ValueError, match="strings and ints"):
        block_extra([["mm", 1.5]])
    with pytest.raises(ValueError, match="strings and ints"):
        block_extra([[]])


def test_numpy_and_list_inputs_agree_and_bad_ids_are_rejected() -> None:
    root = root_key(ModelFingerprint("m", "r", LAYOUT, block_tokens=4))
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    assert block_keys(root, toks, 4) == block_keys(root, np.array(toks, dtype=np.int64), 4)
    with pytest.raises(ValueError, match="token ids"):
        block_keys(root, [1, 2, -3, 4], 4)
    with pytest.raises(ValueError, match="token ids"):
        block_keys(root, [1, 2, 2**32, 4], 4)


def test_invalid_layouts_are_rejected_with_a_reason() -> None:
    with pytest.raises(ValueError, match="MLA"):
        KVLayout(LayoutKind.MLA, 2, "float32", kv_lora_rank=0)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(LayoutKind.GQA, 2, "float64", num_kv_heads=1, head_dim=2, v_head_dim=2)
    lay = KVLayout(LayoutKind.GQA, 12, "float32", num_kv_heads=4, head_dim=64, v_head_dim=64)
    assert lay.bytes_per_token() == 24576  # the bench geometry of issue 2
