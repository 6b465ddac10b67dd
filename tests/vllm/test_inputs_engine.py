"""LoRA adapters, images and prompt embeddings on a real vLLM engine with dscache.

The same token ids under another adapter, or behind another image's placeholder,
hold other KV: each must get its own blocks, and an answer loaded from the store
must equal the one computed. vLLM's own prefix cache is off in the probes: every
reused token came from dscache.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dscache_sidecar.client import SidecarClient
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmProbe
from test_engine import assert_same
from vllm_helpers import LOGPROBS, NEW_TOKENS, STORE_FLAGS, need_vllm, probe_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_rng = random.Random(11)
#: 700 tokens: two whole 256-token blocks reusable.
PROMPT = [_rng.randrange(100, 128_000) for _ in range(700)]
_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
#: The image's placeholder sits in the first block, so no block is free of it.
VLM_TEXT = "Look at <\uff5cimage\uff5c> and read: " + " ".join(
    f"{_rng.choice(_WORDS)}{_rng.randrange(100)}" for _ in range(400)
)


def stored_blocks(sidecar: SidecarProcess) -> int:
    with SidecarClient(sidecar.socket) as client:
        return int(client.stats().blocks)


def generate(probe: VllmProbe, **prompt: Any) -> dict[str, Any]:
    out: dict[str, Any] = probe.generate([prompt], max_tokens=NEW_TOKENS, logprobs=LOGPROBS)[
        "outputs"
    ][0]
    assert probe.flush(60)
    return out


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    need_vllm()
    proc = SidecarProcess(tmp_path / "store", *STORE_FLAGS)
    proc.start()
    yield proc
    proc.stop()


def test_two_lora_adapters_share_no_block_and_each_loads_its_own(
    vllm_model: Path, sidecar: SidecarProcess, tmp_path: Path
) -> None:
    from dscache_vllm.models import build_lora

    adapters = {
        name: {"name": name, "id": i, "path": str(build_lora(tmp_path / name, seed=i))}
        for i, name in enumerate(("finance", "legal"), start=1)
    }
    cfg = probe_config(vllm_model, sidecar, max_lora_rank=8, prompt_embeds=True)
    with VllmProbe(cfg, tmp_path / "lora.log") as probe:
        computed = {
            n: generate(probe, prompt_token_ids=PROMPT, lora=a) for n, a in adapters.items()
        }
        base = generate(probe, prompt_token_ids=PROMPT)
        loaded = {n: generate(probe, prompt_token_ids=PROMPT, lora=a) for n, a in adapters.items()}
        embeds = generate(probe, embeds={"seed": 5, "tokens": 600})
        metrics = probe.metrics()
    # Each adapter computed its own blocks: the other's and the base model's were
    # never offered, and all three sets were stored apart.
    assert [computed[n]["cached_tokens"] for n in adapters] == [0, 0]
    assert base["cached_tokens"] == 0
    assert stored_blocks(sidecar) == 3 * 2
    assert computed["finance"]["token_ids"] != computed["legal"]["token_ids"]
    # Each comes back for its own adapter and answers as it did when computed.
    for name in adapters:
        assert loaded[name]["cached_tokens"] == 512
        assert_same([loaded[name]], [computed[name]])
    # Prompt embeddings have no token ids to key: not cached, counted.
    assert embeds["cached_tokens"] == 0
    assert metrics["dscache_vllm_uncached_requests_total{reason=prompt_embeds}"] == 1
    assert stored_blocks(sidecar) == 3 * 2


def test_two_images_share_no_block_and_the_same_image_is_a_hit(
    sidecar: SidecarProcess, tmp_path: Path
) -> None:
    from dscache_vllm.models import cached_vlm_checkpoint

    cfg = probe_config(cached_vlm_checkpoint(), sidecar, limit_images=1, max_model_len=4096)
    with VllmProbe(cfg, tmp_path / "vlm.log") as probe:
        first = generate(probe, prompt=VLM_TEXT, images=[{"seed": 1}])
        blocks = stored_blocks(sidecar)
        other = generate(probe, prompt=VLM_TEXT, images=[{"seed": 2}])
        again = generate(probe, prompt=VLM_TEXT, images=[{"seed": 1}])
        other_again = generate(probe, prompt=VLM_TEXT, images=[{"seed": 2}])
    assert blocks >= 2
    # Same text, same placeholder tokens, another image: nothing of the first reused.
    assert other["cached_tokens"] == 0
    assert stored_blocks(sidecar) == 2 * blocks
    # The same image again: every stored block is a hit, and the answer is exact.
    assert again["cached_tokens"] == other_again["cached_tokens"] == blocks * 256
    assert_same([again, other_again], [first, other])
    assert first["logprobs"] != other["logprobs"]  # the image does change the answer
