"""Writes tests/vectors/keys_v1.json: fixed inputs and the keys the contract gives.

Run once when the contract version changes; the committed file is what other
implementations (and tests/test_keys.py) check themselves against.
"""

from __future__ import annotations

import json
from pathlib import Path

from dscache.keys import (
    KeyChain,
    KVLayout,
    LayoutKind,
    ModelFingerprint,
    root_key,
    tenant_label,
    tenant_salt,
)


def _tiny_gqa(block_tokens: int) -> dict[str, object]:
    """The fingerprint of the small GQA test model, with ``block_tokens`` tokens per block."""
    return {
        "model_id": "dscache/tiny-gqa",
        "revision": "seed-0",
        "layout": {
            "kind": "gqa",
            "num_layers": 12,
            "dtype": "float32",
            "num_kv_heads": 4,
            "head_dim": 64,
            "v_head_dim": 64,
        },
        "block_tokens": block_tokens,
    }


CASES = [
    {
        "name": "gqa-fp32-no-tenant",
        "fingerprint": _tiny_gqa(block_tokens=4),
        "tenant": None,
        "tokens": list(range(10)),
    },
    {
        "name": "mla-bf16-tenant",
        "fingerprint": {
            "model_id": "deepseek-ai/DeepSeek-V3",
            "revision": "main",
            "layout": {
                "kind": "mla",
                "num_layers": 61,
                "dtype": "bfloat16",
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
            },
            "block_tokens": 3,
            "tp_size": 8,
            "tp_rank": 3,
        },
        "tenant": {"id": "acme-bank", "secret": ""},
        "tokens": [0, 1, 128000, 4294967295, 7, 42, 99, 100000],
    },
    {
        "name": "gqa-hmac-tenant",
        "fingerprint": _tiny_gqa(block_tokens=2),
        "tenant": {"id": "tenant-b", "secret": "c2VjcmV0"},
        "tokens": [5, 4, 3, 2, 1],
    },
]


def fingerprint(d: dict) -> ModelFingerprint:  # type: ignore[type-arg]
    lay = dict(d["layout"])
    lay["kind"] = LayoutKind(lay["kind"])
    rest = {k: v for k, v in d.items() if k != "layout"}
    return ModelFingerprint(layout=KVLayout(**lay), **rest)


def main() -> None:
    out = []
    for case in CASES:
        fp = fingerprint(case["fingerprint"])  # type: ignore[arg-type]
        tenant = case["tenant"]
        salt = b""
        if tenant:
            salt = tenant_salt(tenant["id"], tenant["secret"].encode())  # type: ignore[index]
        chain = KeyChain(fp, salt)
        out.append(
            {
                **case,
                "expected": {
                    "canonical_json": fp.canonical_json().decode(),
                    "fingerprint_digest": fp.digest().hex(),
                    "salt": salt.hex(),
                    "tenant_label": tenant_label(salt),
                    "root": root_key(fp, salt).hex(),
                    "block_keys": [k.hex() for k in chain.keys(case["tokens"])],  # type: ignore[arg-type]
                },
            }
        )
    path = Path(__file__).resolve().parents[1] / "tests" / "vectors" / "keys_v1.json"
    path.write_text(json.dumps({"contract": 1, "cases": out}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
