"""What besides the tokens decides a block's KV: LoRA adapters and images in the keys."""

from __future__ import annotations

import os
from pathlib import Path

from dscache_vllm.extras import (
    LORA_UNREADABLE,
    MM_UNHASHED,
    PROMPT_EMBEDS,
    UNKNOWN_INPUT,
    adapter_digest,
    clear_digests,
    request_inputs,
)
from dscache_vllm.plan import Planner, Scheduled
from test_plan import Store, chain, hold, tokens

from dscache.keys import block_extra


def adapter(tmp_path: Path, name: str, weights: bytes) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


def test_adapter_digest_follows_the_weights_not_the_name(tmp_path: Path) -> None:
    clear_digests()
    a = adapter(tmp_path, "a", b"\x01" * 4096)
    same = adapter(tmp_path, "same", b"\x01" * 4096)
    other = adapter(tmp_path, "other", b"\x02" * 4096)
    da = adapter_digest(str(a))
    assert da is not None and da.startswith("sha256:")
    assert adapter_digest(str(same)) == da
    assert adapter_digest(str(other)) != da
    # Rewritten in place (same path, same size): a new digest, not the cached one.
    (a / "adapter_model.safetensors").write_bytes(b"\x03" * 4096)
    st = (a / "adapter_model.safetensors").stat()
    os.utime(a / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert adapter_digest(str(a)) not in (None, da)
    assert adapter_digest(str(tmp_path / "missing")) is None


def test_inputs_that_cannot_be_keyed_are_named(tmp_path: Path) -> None:
    assert request_inputs(lora=None, mm=[], prompt_embeds=True).uncacheable == PROMPT_EMBEDS
    assert request_inputs(lora=None, mm=[(None, 3, 16)]).uncacheable == MM_UNHASHED
    assert request_inputs(lora=("x", str(tmp_path / "gone")), mm=[]).uncacheable == LORA_UNREADABLE
    unknown = request_inputs(lora=None, mm=[], extra_kinds=["cache_salt", "audio_codes"])
    assert unknown.uncacheable == UNKNOWN_INPUT
    known = request_inputs(lora=None, mm=[("h", 3, 16)], extra_kinds=["mm", "cache_salt"])
    assert known.uncacheable is None and not known.plain


def test_an_image_keys_the_blocks_it_overlaps_with_its_offset() -> None:
    inputs = request_inputs(lora=None, mm=[("img", 250, 20)])
    e = inputs.extras(0, 3, 256)
    assert e[0] == block_extra([["mm", "img", 250]])
    assert e[1] == block_extra([["mm", "img", -6]])  # the placeholder started before
    assert e[2] == b""  # after it: the chain carries it
    lora = request_inputs(lora=("fin", str(Path(__file__))), mm=[])
    assert all(x.startswith(b'[["lora","fin","sha256:') for x in lora.extras(0, 2, 256))


def planner_keys(p: Planner, req: str, toks: list[int], inputs: object) -> list[bytes]:
    p.matched(req, toks, None, 0, inputs)  # type: ignore[arg-type]
    plan = p.step([Scheduled(req, toks, 0, len(toks), list(range(len(toks) // 128)), True)])
    assert len(plan.saves) == 1
    return list(plan.saves[0].keys)


def test_two_images_behind_the_same_tokens_share_only_the_blocks_before_them() -> None:
    store = Store()
    p = Planner(chain, store.find, 256, 128)
    toks = tokens(1024)
    a = planner_keys(p, "a", toks, request_inputs(lora=None, mm=[("img-a", 300, 16)]))
    b = planner_keys(p, "b", toks, request_inputs(lora=None, mm=[("img-b", 300, 16)]))
    plain = chain("default").keys(toks)
    assert a[0] == b[0] == plain[0]  # block 0 is before the image in both
    assert not set(a[1:]) & set(b[1:]) and not set(a[1:]) & set(plain[1:])
    again = planner_keys(p, "a2", toks, request_inputs(lora=None, mm=[("img-a", 300, 16)]))
    assert again == a


def test_an_uncacheable_request_is_neither_looked_up_nor_saved() -> None:
    store = Store()
    toks = tokens(1024)
    hold(store, "default", toks, 3)
    p = Planner(chain, store.find, 256, 128)
    embeds = request_inputs(lora=None, mm=[], prompt_embeds=True)
    assert p.matched("e", toks, None, 0, embeds) == 0
    assert store.lookups == 0
    plan = p.step([Scheduled("e", toks, 0, len(toks), list(range(8)), True)])
    assert plan.saves == () and plan.loads == ()
