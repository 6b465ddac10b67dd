"""``dscache bench admission``: cost-based admission vs the fixed 512-token threshold.

One chat-like workload (:mod:`dscache_tools.workload.chat`: many short turns, no
shared documents, every prompt under a couple of thousand tokens) replayed three
times, each on a fresh real model server and sidecar (:class:`LocalStack`), at the
same concurrency:

* ``off``: no cache (the baseline of "never worse than no cache");
* ``fixed``: the old default, prompts under 512 tokens skip the cache (no lookup,
  no store), the start-up calibration decides the rest and is never refitted;
* ``cost``: today's default, no floor: a prefix is loaded where the cost model
  (calibrated at start, refitted from the served requests every 5 s) says loading
  beats recomputing it.

JSON: ``workload`` (requests, prompt tokens, ideal token hit ratio with and without
the floor), ``modes`` (per mode: ``reused_tokens``, ``token_hit_ratio``,
``ttft_p50_s``, ``ttft_p99_s``, ``errors``, the admission decisions and the final
range) and ``ratios`` (``reused_cost_vs_fixed``, ``ttft_p50_cost_vs_fixed``,
``ttft_p99_cost_vs_fixed``, ``ttft_p50_cost_vs_off``, ``ttft_p99_cost_vs_off``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dscache_tools.bench import Doc, ratio, report
from dscache_tools.demo.stack import LocalStack, StackOptions
from dscache_tools.loadgen.replay import LoadConfig, run_load
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.workload import ChatRequest, ideal_hit_ratio, load_server_tokenizer
from dscache_tools.workload.chat import chat_workload

log = logging.getLogger(__name__)

FIXED_THRESHOLD = 512


@dataclass(frozen=True)
class Profile:
    """How big a run is."""

    sessions: int
    min_turns: int
    max_turns: int
    concurrency: int


QUICK = Profile(sessions=8, min_turns=4, max_turns=8, concurrency=2)
FULL = Profile(sessions=24, min_turns=4, max_turns=12, concurrency=2)

#: (mode, cache on, extra server flags)
_FIXED_FLAGS = ("--min-cache-tokens", str(FIXED_THRESHOLD), "--admission-refit", "0")
MODES: tuple[tuple[str, bool, tuple[str, ...]], ...] = (
    ("off", False, ()),
    ("fixed", True, (*_FIXED_FLAGS, "--admission-probe", "0")),
    ("cost", True, ()),
)


def _run_mode(
    work: Path,
    name: str,
    *,
    model: str,
    cache: bool,
    flags: tuple[str, ...],
    requests: list[ChatRequest],
    concurrency: int,
) -> dict[str, Any]:
    opts = StackOptions(model=model, server_args=flags)
    with LocalStack(work / name, opts) as stack:
        (server,) = stack.start_servers(1, cache=cache, prefix=name)
        cfg = LoadConfig(
            target=server.url,
            concurrency=concurrency,
            metrics_urls=(server.url + "/metrics",),
            progress=False,
        )
        rep = asyncio.run(run_load(cfg, requests))
        decisions, gauges = _server_figures(server.url)
    return {
        "requests": rep.requests,
        "errors": rep.errors,
        "prompt_tokens": rep.prompt_tokens,
        "reused_tokens": rep.cached_tokens,
        "token_hit_ratio": rep.client_token_hit_ratio,
        "ttft_p50_s": rep.ttft_p50_s,
        "ttft_p99_s": rep.ttft_p99_s,
        "admission": decisions,
        "range_tokens": gauges,
    }


def _server_figures(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """The server's admission decisions (it is fresh: its totals are this run's) and
    its final admission range."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    decisions: dict[str, float] = {}
    gauges = {"lower": -1.0, "upper": -1.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dscache_server_cache_admission_total":
                decisions[sample.labels["decision"]] = sample.value
            elif sample.name == "dscache_server_cache_crossover_tokens":
                gauges["lower"] = sample.value
            elif sample.name == "dscache_server_cache_admission_upper_tokens":
                gauges["upper"] = sample.value
    return decisions, gauges


def run_bench(args: argparse.Namespace) -> Doc:
    """The three runs and their ratios."""
    prof = QUICK if args.quick else FULL
    requests = chat_workload(
        prof.sessions, seed=args.seed, min_turns=prof.min_turns, max_turns=prof.max_turns
    )
    tok = load_server_tokenizer()
    ideal = ideal_hit_ratio(requests, tok, block_tokens=256)
    ideal_fixed = ideal_hit_ratio(requests, tok, block_tokens=256, min_tokens=FIXED_THRESHOLD)
    doc: Doc = {
        "model": args.model,
        "profile": "quick" if args.quick else "full",
        "concurrency": prof.concurrency,
        "workload": {
            "sessions": prof.sessions,
            "requests": ideal.requests,
            "prompt_tokens": ideal.prompt_tokens,
            "mean_prompt_tokens": ideal.mean_prompt_tokens,
            "max_prompt_tokens": ideal.max_prompt_tokens,
            "ideal_token_hit_ratio": ideal.token_hit_ratio,
            "ideal_token_hit_ratio_fixed": ideal_fixed.token_hit_ratio,
        },
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="dscache-bench-admission-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        for name, cache, flags in MODES:
            log.info("bench admission: %s", name)
            doc["modes"][name] = _run_mode(
                work,
                name,
                model=args.model,
                cache=cache,
                flags=flags,
                requests=requests,
                concurrency=prof.concurrency,
            )
    m = doc["modes"]
    failed = sum(int(v["errors"]) for v in m.values())
    if failed:
        raise RuntimeError(f"{failed} requests failed; see the servers' logs")
    doc["ratios"] = {
        "reused_cost_vs_fixed": ratio(m["cost"]["reused_tokens"], m["fixed"]["reused_tokens"]),
        "ttft_p50_cost_vs_fixed": ratio(m["cost"]["ttft_p50_s"], m["fixed"]["ttft_p50_s"]),
        "ttft_p99_cost_vs_fixed": ratio(m["cost"]["ttft_p99_s"], m["fixed"]["ttft_p99_s"]),
        "ttft_p50_cost_vs_off": ratio(m["cost"]["ttft_p50_s"], m["off"]["ttft_p50_s"]),
        "ttft_p99_cost_vs_off": ratio(m["cost"]["ttft_p99_s"], m["off"]["ttft_p99_s"]),
    }
    return doc


def table(doc: Doc) -> str:
    """The human-readable summary."""
    w = doc["workload"]
    lines = [
        f"chat workload: {w['requests']} requests, mean prompt {w['mean_prompt_tokens']:.0f} "
        f"tokens (max {w['max_prompt_tokens']}); ideal token hit {w['ideal_token_hit_ratio']:.3f}"
        f" (with a {FIXED_THRESHOLD}-token floor {w['ideal_token_hit_ratio_fixed']:.3f})",
        f"{'mode':<8}{'reused tokens':>15}{'hit ratio':>11}{'TTFT P50':>11}{'TTFT P99':>11}"
        "  admission",
    ]
    for name, r in doc["modes"].items():
        hit = r["token_hit_ratio"] or 0.0
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["admission"].items()) if v)
        lines.append(
            f"{name:<8}{r['reused_tokens']:>15}{hit:>11.3f}{r['ttft_p50_s'] or 0:>10.3f}s"
            f"{r['ttft_p99_s'] or 0:>10.3f}s  {decisions or '-'}"
        )
    for key, value in doc["ratios"].items():
        lines.append(f"{key:<26}{'n/a' if value is None else f'{value:.2f}x'}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench admission``: the runs, the table, the JSON (1 if any failed)."""
    with terminate_on_sigterm():
        return report("admission", lambda: run_bench(args), table, args.json_out, (RuntimeError,))
