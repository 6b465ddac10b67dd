"""The connector's configuration: what `dscache vllm config` writes is what the
connector accepts, typos are refused, and the fingerprint keeps engines apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dscache_vllm.cli import kv_transfer_config
from dscache_vllm.settings import ConnectorSettings, fingerprint
from pydantic import ValidationError

from dscache.keys import root_key


def test_dscache_vllm_config_is_what_the_connector_reads() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dscache.cli", "vllm", "config", "--data-dir", "/cache",
         "--socket", "/run/s.sock", "--block-tokens", "512", "--revision", "r7"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    cfg = json.loads(out)
    assert cfg["kv_connector"] == "DscacheConnector"
    assert cfg["kv_connector_module_path"] == "dscache_vllm.connector"
    assert cfg["kv_load_failure_policy"] == "recompute"  # a failed load never fails a request
    settings = ConnectorSettings.from_extra(cfg["kv_connector_extra_config"])
    assert (settings.socket, settings.data_dir, settings.block_tokens, settings.revision) == (
        "/run/s.sock", "/cache", 512, "r7",
    )  # fmt: skip
    assert cfg == kv_transfer_config(
        socket="/run/s.sock", data_dir="/cache", block_tokens=512, revision="r7"
    )


def test_unknown_or_bad_keys_are_refused() -> None:
    with pytest.raises(ValidationError, match="data_dri"):
        ConnectorSettings.from_extra({"data_dri": "/cache"})
    with pytest.raises(ValidationError):
        ConnectorSettings.from_extra({"verify": "maybe"})
    with pytest.raises(ValidationError, match="copy_threads"):
        ConnectorSettings.from_extra({"copy_threads": 0})


def test_the_tenant_secret_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSCACHE_VLLM_TENANT_SECRET", "from-env")
    assert ConnectorSettings().tenant_secret() == b"from-env"
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    assert ConnectorSettings(tenant_secret_file=str(secret)).tenant_secret() == b"from-file"


def _fp(**over: object) -> bytes:
    base: dict[str, object] = {
        "model": "/models/m", "revision": "r", "num_layers": 2, "kv_heads": 2,
        "head_size": 64, "dtype": "float32", "block_tokens": 256,
        "page_layout": {"vllm": "0.32.0", "page_tokens": "128", "device": "cpu", "attn": "vec"},
    }  # fmt: skip
    return root_key(fingerprint(**{**base, **over}))  # type: ignore[arg-type]


def test_page_layouts_dtypes_and_models_never_share_keys() -> None:
    other_page = {"vllm": "0.32.0", "page_tokens": "32", "device": "cpu", "attn": "vec"}
    other_vllm = {"vllm": "0.33.0", "page_tokens": "128", "device": "cpu", "attn": "vec"}
    roots = {
        _fp(),
        _fp(page_layout=other_page),
        _fp(page_layout=other_vllm),
        _fp(dtype="bfloat16"),
        _fp(revision="r2"),
        _fp(block_tokens=512),
    }
    assert len(roots) == 6
    assert _fp() == _fp()  # a pure function: the same engine finds its blocks again
