"""``dscache bench vllm``: a real vLLM engine restarted warm from dscache.

Every figure comes from fresh vLLM processes (``dscache_tools.vllmprobe``) on one
local checkpoint, in one run, so each is a ratio to a baseline measured beside it:

* **Layouts**: each figure below is measured for a GQA model (a Llama) and an MLA
  model (a DeepSeek-V3; vLLM's CPU MLA kernel uses 16-token pages); every entry of
  ``results`` names its ``layout``.
* **Restart-warm TTFT** per context: a prompt computed and stored by one engine,
  then answered (one token) by a *new* engine that loads its KV from dscache
  (``dscache_s``), from vLLM's own ``ExampleConnector`` on the same disk
  (``example_connector_s``), or recomputes it (``recompute_s``). Each new engine
  first answers an unrelated prompt (start-up costs are not TTFT) and keeps
  vLLM's own prefix cache off, so repeats load again; figures are medians. The
  prompt is the context plus two tokens, so both connectors load exactly the
  context and compute the same tail; ``*_load_s`` is the time inside each
  connector's load path: for ExampleConnector the time in its ``start_load_kv``
  (file reads and copies into vLLM's pages), for dscache from ``start_load_kv``
  (lease, mapping) to its last page copied and checked (host pages: all within
  ``start_load_kv``; GPU pages: by the copier thread beside the forward's first
  layers); ``dscache_load_wait_s`` is what the forward waited for it.
  ``memcpy_s`` is one plain copy of the same bytes in the same engine process:
  ``load_over_memcpy`` = ``dscache_load_s / memcpy_s`` and
  ``example_connector_load_ratio`` = ``example_connector_load_s / dscache_load_s``;
  the top-level ones are the worst layout's at the largest context. The same
  fresh engines then answer the next turn (the prompt plus 256 new tokens): a
  prefix of a stored prompt (``*_next_turn_s``).
* **Lookup cost** on the scheduler's loop: ``lookup_p99_ms`` is the lookup of 32
  stored block keys in the sidecar's index, read in this process as the
  connector does; ``scheduler_p99_ms`` is the connector's whole call for a new
  32-block request (the block keys from the token ids, then that lookup).
* **Multi-turn** (``multi_turn``): the finance workload's sessions through
  ``dscache vllm serve`` (or plain vLLM) and ``dscache load``: their first two turns
  on one server, the rest on a restarted one, vLLM's prefix cache on in both arms:
  token hit ratio (prompt tokens vLLM reported cached) and TTFT of the turns after
  the restart.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dscache_tools.bench import report
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmProbe, VllmServer

#: vLLM pages of the GQA engines (vLLM's CPU MLA kernel needs 16); dscache blocks
#: are 256 tokens.
PAGE_TOKENS = 128
MLA_PAGE_TOKENS = 16
BLOCK_TOKENS = 256
#: Targets of the issue, as ratios.
TARGET_VS_RECOMPUTE = 10.0
TARGET_VS_EXAMPLE = 1.5
TARGET_OVER_MEMCPY = 1.3
TARGET_LOOKUP_P99_MS = 0.1
#: New tokens of the next turn after a stored prompt.
NEXT_TURN_TOKENS = 256


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 128_000) for _ in range(n)]


def _config(model: Path, connector: str | None, extra: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "connector": connector,
        "extra": extra,
        "block_size": PAGE_TOKENS,
        "max_model_len": kw["max_model_len"],
        # One prefill chunk per prompt: vLLM's ExampleConnector cannot load a
        # prompt whose prefill is chunked.
        "max_num_batched_tokens": kw.pop("max_model_len"),
        "prefix_caching": kw.pop("prefix_caching", False),
        "kv_space_gib": kw.pop("kv_space_gib", 2),
    }


@dataclass(frozen=True)
class _Run:
    """Medians of one prompt in one engine."""

    ttft_s: float
    load_s: float
    cached_tokens: int
    wait_s: float = 0.0


def _measure(probe: VllmProbe, prompts: dict[Any, list[int]], repeat: int) -> dict[Any, _Run]:
    """Median TTFT (and time in the connector's load path) of each prompt, in an
    engine that first answered an unrelated one."""
    probe.generate([{"prompt_token_ids": _prompt(300, 999)}], max_tokens=1)
    out: dict[Any, _Run] = {}
    for ctx, prompt in prompts.items():
        runs = [probe.generate([{"prompt_token_ids": prompt}], max_tokens=1) for _ in range(repeat)]
        out[ctx] = _Run(
            ttft_s=statistics.median(float(r["seconds"]) for r in runs),
            load_s=statistics.median(float(r["load_s"]) for r in runs),
            cached_tokens=min(int(r["outputs"][0]["cached_tokens"]) for r in runs),
            wait_s=statistics.median(float(r.get("load_wait_s", r["load_s"])) for r in runs),
        )
    return out


def _median_run(runs: list[_Run]) -> _Run:
    return _Run(
        ttft_s=statistics.median(r.ttft_s for r in runs),
        load_s=statistics.median(r.load_s for r in runs),
        cached_tokens=min(r.cached_tokens for r in runs),
        wait_s=statistics.median(r.wait_s for r in runs),
    )


def _lookup_cost(sidecar: SidecarProcess, fingerprint: Any, repeat: int) -> dict[str, float]:
    """The scheduler side's lookup for new 32-block requests, against stored blocks."""
    from dscache_sidecar.client import RAW, SidecarClient
    from dscache_vllm.plan import Planner

    from dscache.keys import KeyChain, tenant_salt

    chain = KeyChain(fingerprint, tenant_salt("default"))
    prompt = _prompt(32 * BLOCK_TOKENS + 1, 4242)
    with SidecarClient(sidecar.socket, data_dir=str(sidecar.data_dir)) as client:
        keys = chain.keys(prompt)
        client.store(chain.tenant, _blocks(chain, prompt, fingerprint), RAW)
        assert client.find(chain.tenant, keys).direct, "the index was not read in-process"
        planner = Planner(
            lambda _t: chain,
            lambda t, k: client.find(t, k).found,
            BLOCK_TOKENS,
            PAGE_TOKENS,
        )
        whole: list[float] = []
        index: list[float] = []
        for i in range(repeat):
            start = time.perf_counter()
            hit = planner.matched(f"r{i}", prompt, None, 0)
            whole.append(time.perf_counter() - start)
            planner.finished(f"r{i}")
            start = time.perf_counter()
            client.find(chain.tenant, keys)
            index.append(time.perf_counter() - start)
            assert hit == 32 * BLOCK_TOKENS
    q = statistics.quantiles
    return {
        "lookup_p50_ms": statistics.median(index) * 1e3,
        "lookup_p99_ms": q(index, n=100)[98] * 1e3,
        "scheduler_p50_ms": statistics.median(whole) * 1e3,
        "scheduler_p99_ms": q(whole, n=100)[98] * 1e3,
    }


def _blocks(chain: Any, prompt: list[int], fingerprint: Any) -> list[Any]:
    """Zero-filled blocks of the prompt's keys (the lookup reads only the index)."""
    import numpy as np
    from dscache_sidecar.client import BlockData

    layout = fingerprint.layout
    shape = (layout.num_layers, 2, layout.num_kv_heads, BLOCK_TOKENS, layout.head_dim)
    keys = chain.keys(prompt)
    return [
        BlockData(k, keys[i - 1] if i else b"", np.zeros(shape, dtype=np.float32))
        for i, k in enumerate(keys)
    ]


def _multi_turn(
    model: Path, sidecar: SidecarProcess, base: Path, sessions: int, max_len: int
) -> dict[str, Any]:
    """Finance sessions split by a restart, through ``vllm serve`` and ``dscache load``.

    Both arms keep vLLM's own prefix cache on; the first turns of every session run
    on one server, the rest on a restarted one, whose figures are reported.
    """
    from dscache_tools.workload import WorkloadConfig, generate
    from dscache_tools.workload.model import write_jsonl

    requests = generate(WorkloadConfig(sessions=sessions, max_turns=4, seed=3))
    files = {
        "first": [r for r in requests if r.turn < 2],
        "restarted": [r for r in requests if r.turn >= 2],
    }
    for phase, batch in files.items():
        write_jsonl(batch, base / f"multi-{phase}.jsonl")
    flags = ("--dtype", "float32", "--max-model-len", str(max_len), "--block-size", "128")
    out: dict[str, Any] = {}
    for arm, connector in (("with_dscache", True), ("vllm_only", False)):
        report: dict[str, Any] = {}
        for phase in files:
            with VllmServer(
                model,
                base / f"serve-{arm}.log",
                socket=sidecar.socket if connector else None,
                data_dir=str(sidecar.data_dir) if connector else None,
                vllm_args=flags,
            ) as server:
                report = _load(server, base / f"multi-{phase}.jsonl", base / f"{arm}-{phase}.json")
                if connector:
                    _wait_stored(sidecar)
        out[arm] = {
            "requests": report["requests"],
            "errors": report["errors"],
            "token_hit_ratio": report["client_token_hit_ratio"],
            "ttft_p50_s": report["ttft_p50_s"],
            "ttft_p99_s": report["ttft_p99_s"],
        }
    return out


def _load(server: VllmServer, workload: Path, json_out: Path) -> dict[str, Any]:
    """``dscache load`` of a workload file against a vLLM server (two sessions at once)."""
    cmd = [
        sys.executable, "-m", "dscache.cli", "load",
        "--target", server.url, "--workload", str(workload), "--model", server.model,
        "--concurrency", "2", "--json", str(json_out), "--no-progress",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report: dict[str, Any] = json.loads(json_out.read_text())
    return report


def _wait_stored(sidecar: SidecarProcess, settle_s: float = 2.0) -> None:
    """Until the sidecar's block count stops growing (the connector's writes ended)."""
    from dscache_sidecar.client import SidecarClient

    with SidecarClient(sidecar.socket) as client:
        last = -1
        while (now := int(client.stats().blocks)) != last:
            last = now
            time.sleep(settle_s)


@dataclass(frozen=True)
class _Layout:
    """One attention layout's checkpoint and engine geometry."""

    name: str
    model: Path
    page_tokens: int
    bytes_per_token: int
    describe: str


def _layouts(names: list[str], size: str) -> list[_Layout]:
    from dscache_vllm.models import (
        HEAD_DIM,
        KV_LORA_RANK,
        MLA_SIZES,
        QK_ROPE_HEAD_DIM,
        SIZES,
        cached_checkpoint,
        cached_mla_checkpoint,
    )

    out = []
    for name in names:
        if name == "gqa":
            layers, _h, _heads, kv_heads, _i = SIZES[size]
            per_token = layers * 2 * kv_heads * HEAD_DIM * 4
            out.append(
                _Layout(
                    name, cached_checkpoint(size), PAGE_TOKENS, per_token,
                    f"Llama {size} ({layers} layers, {kv_heads} KV heads of {HEAD_DIM}, float32)",
                )
            )  # fmt: skip
        elif name == "mla":
            layers, _h, heads, _i, experts = MLA_SIZES[size]
            latent = KV_LORA_RANK + QK_ROPE_HEAD_DIM
            out.append(
                _Layout(
                    name, cached_mla_checkpoint(size), MLA_PAGE_TOKENS, layers * latent * 4,
                    f"DeepSeek-V3 {size} ({layers} layers, MLA latent {KV_LORA_RANK}+"
                    f"{QK_ROPE_HEAD_DIM}, {heads} heads, {experts} experts, float32)",
                )
            )  # fmt: skip
        else:
            raise ValueError(f"unknown layout {name!r}; expected gqa and/or mla")
    return out


def _run_layout(
    layout: _Layout, args: argparse.Namespace, base: Path, sidecar: SidecarProcess
) -> list[dict[str, Any]]:
    """The restart-warm figures of one layout: five fresh engines, one store."""
    contexts = [int(c) for c in str(args.context).split(",")]
    max_len = max(max(contexts) + 2 + NEXT_TURN_TOKENS + 62, 8192)
    # Two tokens past the context: dscache (whole 256-token blocks, never the last
    # token) and ExampleConnector (whole vLLM pages, never the last two) then both
    # load exactly `context` tokens and compute the same two-token tail.
    prompts = {ctx: _prompt(ctx + 2, ctx) for ctx in contexts}
    # The next turn of each: the same prompt and 256 new tokens (a follow-up question),
    # a different one per repeat (a repeat must not find the previous one's blocks).
    turns = {
        ("next", ctx, i): p + _prompt(NEXT_TURN_TOKENS, ctx * 100 + i)
        for ctx, p in prompts.items()
        for i in range(args.repeat)
    }
    extra = {"socket": sidecar.socket, "data_dir": str(sidecar.data_dir)}
    example = {"shared_storage_path": str(base / f"example-{layout.name}")}

    def engine(name: str, connector: str | None, settings: dict[str, Any]) -> VllmProbe:
        cfg = _config(layout.model, connector, settings, max_model_len=max_len)
        cfg["block_size"] = layout.page_tokens
        return VllmProbe(cfg, base / f"{layout.name}-{name}.log")

    # 1. Compute and store, with each connector (the first request's cost too).
    with engine("store-dscache", "dscache", extra) as p:
        stored = _measure(p, prompts, 1)
        p.flush(300)
    with engine("store-example", "example", example) as p:
        _measure(p, prompts, 1)
    # 2. Fresh engines: load from dscache, load from ExampleConnector, recompute; the
    # dscache engine also times one plain copy of the bytes each load moved.
    with engine("load-dscache", "dscache", extra) as p:
        warm = _measure(p, prompts, args.repeat)
        warm_next = _measure(p, turns, 1)
        memcpy = {
            ctx: p.memcpy(max(warm[ctx].cached_tokens, 1) * layout.bytes_per_token)
            for ctx in contexts
        }
    with engine("load-example", "example", example) as p:
        ex = _measure(p, prompts, args.repeat)
        ex_next = _measure(p, turns, 1)
    with engine("recompute", None, {}) as p:
        cold = _measure(p, prompts, args.repeat)
    results = []
    for ctx in contexts:
        d, e, c = warm[ctx], ex[ctx], cold[ctx]
        dn = _median_run([warm_next["next", ctx, i] for i in range(args.repeat)])
        en = _median_run([ex_next["next", ctx, i] for i in range(args.repeat)])
        example_ratio = e.load_s / d.load_s if d.load_s else None
        results.append(
            {
                "context": ctx,
                "layout": layout.name,
                "model": layout.describe,
                "page_tokens": layout.page_tokens,
                "dscache_s": d.ttft_s,
                "recompute_s": c.ttft_s,
                "example_connector_s": e.ttft_s,
                "dscache_load_s": d.load_s,
                "dscache_load_wait_s": d.wait_s,
                "example_connector_load_s": e.load_s,
                "memcpy_s": memcpy[ctx],
                "load_bytes": d.cached_tokens * layout.bytes_per_token,
                "dscache_cached_tokens": d.cached_tokens,
                "example_connector_cached_tokens": e.cached_tokens,
                "first_request_with_store_s": stored[ctx].ttft_s,
                "recompute_over_dscache": c.ttft_s / d.ttft_s,
                "example_over_dscache": e.ttft_s / d.ttft_s,
                "example_load_over_dscache_load": example_ratio,
                "example_connector_load_ratio": example_ratio,
                "load_over_memcpy": d.load_s / memcpy[ctx] if memcpy[ctx] else None,
                "dscache_next_turn_s": dn.ttft_s,
                "example_connector_next_turn_s": en.ttft_s,
                "dscache_next_turn_cached_tokens": dn.cached_tokens,
                "example_connector_next_turn_cached_tokens": en.cached_tokens,
                "example_over_dscache_next_turn": en.ttft_s / dn.ttft_s,
            }
        )
    return results


def _worst(results: list[dict[str, Any]], key: str, worst: Any) -> float | None:
    """``key`` at the largest context, the worst over the layouts."""
    top = max(r["context"] for r in results)
    values = [r[key] for r in results if r["context"] == top and r[key] is not None]
    return float(worst(values)) if values else None


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; its stores and engine logs go to ``--work-dir`` (kept) or
    to a temporary directory removed at the end (several GB: the stores of both
    connectors)."""
    if getattr(args, "quick", False):
        args.repeat, args.sessions = 1, 0
        args.lookup_repeat = min(args.lookup_repeat, 1000)
    if args.work_dir:
        base = Path(args.work_dir)
        base.mkdir(parents=True, exist_ok=True)
        return _run_in(base, args)
    with tempfile.TemporaryDirectory(prefix="dscache-bench-vllm-") as tmp:
        return _run_in(Path(tmp), args)


def _run_in(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    from dscache_vllm.models import SIZES
    from dscache_vllm.settings import fingerprint

    layouts = _layouts([n.strip() for n in str(args.layout).split(",") if n.strip()], args.model)
    sidecar = SidecarProcess(base / "store", "--capacity", args.capacity, "--segment-size", "64MiB")
    sidecar.start()
    results: list[dict[str, Any]] = []
    try:
        for layout in layouts:
            results.extend(_run_layout(layout, args, base, sidecar))
        layers, _hidden, _heads, kv_heads, _inter = SIZES[args.model]
        fp = fingerprint(
            model="dscache-bench-lookup",
            revision="0",
            num_layers=layers,
            kv_heads=kv_heads,
            head_size=64,
            dtype="float32",
            block_tokens=BLOCK_TOKENS,
        )
        lookup = _lookup_cost(sidecar, fp, args.lookup_repeat)
        gqa = [lay for lay in layouts if lay.name == "gqa"]
        multi = (
            _multi_turn(gqa[0].model, sidecar, base, args.sessions, 8192)
            if args.sessions > 0 and gqa
            else None
        )
    finally:
        sidecar.stop()
    return {
        "model": "; ".join(f"{lay.name}: {lay.describe}" for lay in layouts),
        "page_tokens": PAGE_TOKENS,
        "block_tokens": BLOCK_TOKENS,
        "repeat": args.repeat,
        "quick": bool(getattr(args, "quick", False)),
        "results": results,
        "load_over_memcpy": _worst(results, "load_over_memcpy", max),
        "example_connector_load_ratio": _worst(results, "example_connector_load_ratio", min),
        **lookup,
        "multi_turn": multi,
        "targets": {
            "recompute_over_dscache": TARGET_VS_RECOMPUTE,
            "example_connector_load_ratio": TARGET_VS_EXAMPLE,
            "load_over_memcpy": TARGET_OVER_MEMCPY,
            "lookup_p99_ms": TARGET_LOOKUP_P99_MS,
        },
    }


def format_table(doc: dict[str, Any]) -> str:
    """The plain-text report."""
    lines = [
        f"vLLM restart-warm TTFT on {doc['model']}; medians of {doc['repeat']} (a fresh "
        "engine each; prompts are the context + 2 tokens)",
        f"{'layout':>6} {'context':>8} {'recompute_s':>12} {'dscache_s':>10} {'example_s':>10} "
        f"{'recompute/dscache':>18} {'dscache_load_s':>15} {'example_load_s':>15} "
        f"{'example/dscache load':>21} {'memcpy_s':>9} {'load/memcpy':>12} "
        f"{'1st+store_s':>12}",
    ]

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in doc["results"]:
        lines.append(
            f"{r['layout']:>6} {r['context']:>8} {r['recompute_s']:>12.3f} "
            f"{r['dscache_s']:>10.3f} {r['example_connector_s']:>10.3f} "
            f"{r['recompute_over_dscache']:>18.1f} {r['dscache_load_s']:>15.4f} "
            f"{r['example_connector_load_s']:>15.4f} "
            f"{num(r['example_connector_load_ratio'], '.2f'):>21} {r['memcpy_s']:>9.4f} "
            f"{num(r['load_over_memcpy'], '.2f'):>12} {r['first_request_with_store_s']:>12.3f}"
        )
    lines.append(
        f"load path vs ExampleConnector's (worst layout, largest context): "
        f"{num(doc['example_connector_load_ratio'], '.2f')}x faster (target >= "
        f"{TARGET_VS_EXAMPLE}); vs one plain copy of the same bytes: "
        f"{num(doc['load_over_memcpy'], '.2f')}x its time (target <= {TARGET_OVER_MEMCPY})"
    )
    lines.append(
        f"lookup of 32 blocks in-process: p50 {doc['lookup_p50_ms']:.3f} ms, p99 "
        f"{doc['lookup_p99_ms']:.3f} ms (target p99 <= {TARGET_LOOKUP_P99_MS} ms); the "
        f"connector's whole call with the keys: p50 {doc['scheduler_p50_ms']:.3f} ms, "
        f"p99 {doc['scheduler_p99_ms']:.3f} ms"
    )
    lines.append(
        "next turn (the same prompt + 256 new tokens) in those fresh engines: "
        + ", ".join(
            f"{r['context']}: dscache {r['dscache_next_turn_s']:.3f} s "
            f"({r['dscache_next_turn_cached_tokens']} tokens loaded), ExampleConnector "
            f"{r['example_connector_next_turn_s']:.3f} s "
            f"({r['example_connector_next_turn_cached_tokens']} loaded), "
            f"{r['example_over_dscache_next_turn']:.1f}x"
            for r in doc["results"]
        )
    )
    multi = doc.get("multi_turn")
    if multi:
        lines.append("multi-turn finance sessions after a vLLM restart (vLLM prefix cache on):")
        for arm, m in multi.items():
            lines.append(
                f"  {arm:<13} token hit ratio {m['token_hit_ratio']:.3f}  TTFT p50 "
                f"{m['ttft_p50_s']:.3f} s  p99 {m['ttft_p99_s']:.3f} s  ({m['requests']} turns, "
                f"{m['errors']} errors)"
            )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``dscache bench vllm``."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the servers' health polls
    return report(
        "vllm",
        lambda: run_bench(args),
        format_table,
        args.json_out,
        (ValueError, RuntimeError, FileNotFoundError, TimeoutError),
    )
