"""``dscache workload``, ``dscache load`` and ``dscache demo``.

Light module: argument parsing only; each handler imports its implementation, so
``dscache --help`` stays fast and loads neither httpx nor matplotlib.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dscache.cli import Commands

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")

#: ``WorkloadConfig.variant``'s values (kept here so parsing imports no workload code).
VARIANTS = ("standard", "varied")

#: Routing modes ``dscache demo --routing`` compares.
ROUTING_MODES = ("hash", "kv")


def register(sub: Commands, bench: Commands) -> None:
    """Adds the workload, load-generator and demo subcommands."""
    del bench  # nothing here is a benchmark of one component
    _add_workload(sub)
    _add_load(sub)
    _add_demo(sub)


def _add_workload(sub: Commands) -> None:
    w = sub.add_parser("workload", help="generate a workload file (JSONL of chat requests)")
    wsub = w.add_subparsers(dest="workload_kind", metavar="KIND", required=True)
    f = wsub.add_parser(
        "finance", help="multi-turn chats about listed companies (Chinese and English)"
    )
    f.add_argument("--sessions", type=int, default=200, help="conversations (default 200)")
    f.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    f.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    f.add_argument(
        "--drop-id-share",
        type=float,
        default=0.4,
        help="share of requests without a session id: no header, no cookie (default 0.4)",
    )
    f.add_argument(
        "--drop-mode",
        choices=["request", "session"],
        default="request",
        help="drop ids per request, or for that share of whole sessions (default request)",
    )
    f.add_argument(
        "--reconnect-share",
        type=float,
        default=0.1,
        help="share of sessions that reconnect under a new id (default 0.1)",
    )
    f.add_argument(
        "--variant",
        choices=VARIANTS,
        default="standard",
        help="standard: sessions about a company share their opening (system prompt and "
        "dossier); varied: each session opens its own way, so none shares a prefix from the "
        "start (default standard)",
    )
    f.add_argument("--min-turns", type=int, default=2, help="fewest turns per session (2)")
    f.add_argument("--max-turns", type=int, default=8, help="most turns per session (8)")
    f.add_argument("--companies", type=int, default=None, help="companies to use (default all 12)")
    f.add_argument("--max-tokens", type=int, default=24, help="completion tokens asked (24)")
    f.add_argument("--block-tokens", type=int, default=256, help="block size for the ideal (256)")
    f.add_argument(
        "--no-ideal", action="store_true", help="skip the ideal hit ratio (needs the tokenizer)"
    )
    f.add_argument(
        "--prewarm-out",
        type=Path,
        default=None,
        help="also write each company's shared prefix, one chat per line: the prompts of a "
        "prewarm Job (kubectl create configmap finance-prompts --from-file=prompts.jsonl=FILE)",
    )
    f.set_defaults(handler=_run_workload)
    c = wsub.add_parser(
        "chat", help="short multi-turn chats with no shared documents (little reuse across users)"
    )
    c.add_argument("--sessions", type=int, default=100, help="conversations (default 100)")
    c.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    c.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    c.add_argument(
        "--drop-id-share",
        type=float,
        default=0.4,
        help="share of requests without a session id, drawn per request (default 0.4)",
    )
    c.add_argument("--min-turns", type=int, default=4, help="fewest turns per session (4)")
    c.add_argument("--max-turns", type=int, default=10, help="most turns per session (10)")
    c.add_argument("--max-tokens", type=int, default=16, help="completion tokens asked (16)")
    c.set_defaults(handler=_run_chat_workload)


def _add_load(sub: Commands) -> None:
    ld = sub.add_parser("load", help="replay a workload file against a server or the router")
    ld.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    ld.add_argument("--workload", required=True, type=Path, help="JSONL from dscache workload")
    ld.add_argument("--concurrency", type=int, default=4, help="sessions in flight (default 4)")
    limit = ld.add_mutually_exclusive_group()
    limit.add_argument("--requests", type=int, default=None, help="stop after N requests")
    limit.add_argument(
        "--duration",
        dest="duration_s",
        metavar="DURATION",
        type=_duration,
        default=None,
        help="stop starting requests after T (90s, 5m)",
    )
    ld.add_argument(
        "--metrics",
        action="append",
        default=[],
        help="a model server's /metrics URL for the cache figures (repeat per server)",
    )
    ld.add_argument("--json", dest="json_out", type=Path, default=None, help="write the report")
    ld.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="TIMEOUT",
        type=float,
        default=300.0,
        help="seconds per request (300)",
    )
    ld.add_argument(
        "--think",
        dest="think_s",
        metavar="THINK",
        type=_duration,
        default=0.0,
        help="mean pause between a session's turns (a user reading and typing; default 0); "
        "with it, --concurrency is the number of live sessions",
    )
    ld.add_argument("--model", default=None, help="model name to send (default: none)")
    ld.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="ask for whole JSON answers (a router can retry them on another pod); "
        "TTFT is then the time to the whole answer",
    )
    ld.add_argument(
        "--answers",
        choices=["workload", "served"],
        default="workload",
        help="the history's assistant messages: the workload's canned answers (default) or "
        "the answers the server gave, sent back as a chat client does",
    )
    ld.add_argument("--no-progress", action="store_true", help="no progress bar")
    ld.set_defaults(handler=_run_load)


def _add_demo(sub: Commands) -> None:
    d = sub.add_parser(
        "demo",
        help="run sidecars, two model servers and NGINX locally; replay the finance "
        "workload with the cache off and on; print the gain",
    )
    d.add_argument("--quick", action="store_true", help="the ~1-minute profile")
    d.add_argument("--model", default="mini-gqa", help="model preset (default mini-gqa)")
    d.add_argument("--json", dest="json_out", type=Path, default=None, help="write the report")
    d.add_argument("--png", dest="png_out", type=Path, default=None, help="write the figure")
    d.add_argument("--concurrency", type=int, default=4, help="sessions in flight (default 4)")
    d.add_argument("--sessions", type=int, default=None, help="sessions (quick 8, default 40)")
    d.add_argument("--companies", type=int, default=None, help="companies (quick 3, default 6)")
    d.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    d.add_argument("--max-tokens", type=int, default=8, help="completion tokens (default 8)")
    d.add_argument(
        "--drop-id-share", type=float, default=0.4, help="requests without id (default 0.4)"
    )
    d.add_argument(
        "--drop-mode",
        choices=["request", "session"],
        default="request",
        help="drop ids per request, or for whole sessions (default request)",
    )
    source = d.add_mutually_exclusive_group()
    source.add_argument(
        "--workload-variant",
        choices=VARIANTS,
        default="standard",
        help="the generated sample: standard, or varied (each session opens its own way, so "
        "sessions share no prefix from the start; see dscache workload finance --variant)",
    )
    source.add_argument(
        "--workload",
        dest="workload_file",
        metavar="FILE",
        type=Path,
        default=None,
        help="replay this JSONL (dscache workload's format) instead of a generated sample; "
        "the sample's options (--sessions, --companies, --seed, --drop-*) do not apply",
    )
    d.add_argument(
        "--routing",
        metavar="MODE[,MODE]",
        type=_routing,
        default=ROUTING_MODES,
        help="routing modes to compare, each a cache-on pass: hash (the session / prompt-key "
        "hash: the cache-on pass) and kv (the KV-aware picker) (default hash,kv)",
    )
    d.add_argument("--no-prewarm", action="store_true", help="start the cache-on pass cold")
    d.add_argument(
        "--fallback-pass",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run cache-on without the prompt-key fallback (default: not with --quick)",
    )
    d.add_argument("--prometheus", action="store_true", help="also run Prometheus")
    d.add_argument("--workdir", type=Path, default=None, help="keep files and logs here")
    d.add_argument("--threads", type=int, default=1, help="torch threads per server (1)")
    d.set_defaults(handler=_run_demo)

    _add_kube_demo(d.add_subparsers(dest="demo_kind", metavar="KIND"))


def _add_kube_demo(kinds: Commands) -> None:
    k = kinds.add_parser(
        "kubernetes",
        help="on a cluster whose pods run: the cache-warmth-aware canary against a blind "
        "rolling update, a bad revision rolled back by the gate",
        description="Installs the operator with Helm, applies examples/04-dev-cluster, drives "
        "the finance workload through the router Service, and compares a warm canary rollout "
        "with a plain rolling update of the same Deployment. Without --kubeconfig it uses the "
        "running dev cluster, or starts one with a real node and stops it afterwards. "
        "--engine vllm runs it on vLLM pods (examples/07-vllm-dev-cluster).",
    )
    k.add_argument("--quick", action="store_true", help="the ~15-minute profile")
    k.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="the model pods: dscache's model server (default) or vLLM with the dscache "
        "connector (one pod per track)",
    )
    k.add_argument("--json", dest="json_out", type=Path, default=None, help="write the report")
    k.add_argument(
        "--png",
        dest="png_out",
        type=Path,
        default=None,
        help="the figure (default: next to --json)",
    )
    k.add_argument("--kubeconfig", type=Path, default=None, help="an existing cluster")
    k.add_argument(
        "--prometheus-url", default=None, help="Prometheus the operator queries (with --kubeconfig)"
    )
    k.add_argument("--concurrency", type=int, default=24, help="live sessions (default 24)")
    k.add_argument(
        "--think",
        dest="think_s",
        metavar="THINK",
        type=_duration,
        default=15.0,
        help="mean pause between a session's turns (default 15s)",
    )
    k.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    k.add_argument(
        "--interval", type=_duration, default=None, help="rollout step interval (quick 40s, 90s)"
    )
    k.add_argument("--workdir", type=Path, default=None, help="keep the cluster's logs here")
    k.add_argument(
        "--max-ttft-p99-ratio",
        type=float,
        default=None,
        help="the rollout gate's latency bound, canary over stable P99 TTFT (example: 2.0)",
    )
    k.add_argument(
        "--min-hit-rate-ratio",
        type=float,
        default=None,
        help="the rollout gate's hit-rate bound, canary over stable hit rate (example: 0.9)",
    )
    k.add_argument(
        "--router-replicas",
        type=int,
        default=2,
        help="router pods; the load spreads every request over them, as a Service does "
        "(default 2; they agree on each session's track and pod through the pods)",
    )
    k.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the users' sampling temperature, seeded per turn (default 1, OpenAI's; "
        "0: greedy, alike openings get the same answer)",
    )
    k.set_defaults(handler=_run_kube_demo)


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 5m)")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2) or "s"]
    return float(m.group(1)) * scale


def _routing(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    bad = [m for m in modes if m not in ROUTING_MODES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown routing mode {bad[0]!r} (choose from {', '.join(ROUTING_MODES)})"
        )
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a routing mode is named twice: {text!r}")
    if "hash" not in modes:
        raise argparse.ArgumentTypeError(
            "the cache-on pass routes by hash, so the list must include it: e.g. hash,kv"
        )
    return modes


def _options(cls: type[_T], args: argparse.Namespace, **overrides: Any) -> _T:
    """``cls`` built from the parsed flags whose ``dest`` is one of its fields.

    Flags are named for the user and their ``dest`` for the field they set, so
    each handler names only what it computes (``overrides``).
    """
    given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{**given, **overrides})


def _run_workload(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dscache_tools.workload import (
        COMPANIES,
        WorkloadConfig,
        generate,
        ideal_hit_ratio,
        load_server_tokenizer,
        prewarm_requests,
        prompts_jsonl,
        summary,
        summary_line,
        write_jsonl,
    )

    cfg = _options(WorkloadConfig, args, companies=args.companies or len(COMPANIES))
    if args.prewarm_out is not None and cfg.variant != "standard":
        print(
            "dscache workload: error: --prewarm-out needs --variant standard (varied "
            "sessions share no opening a prewarm could warm)",
            file=sys.stderr,
        )
        return 2
    requests = generate(cfg)
    write_jsonl(requests, args.out)
    if args.prewarm_out is not None:
        warm = prewarm_requests(generate(replace(cfg, sessions=max(cfg.sessions, 2000))))
        args.prewarm_out.write_text(prompts_jsonl(warm))
        print(f"wrote the shared prefixes of {len(warm)} companies to {args.prewarm_out}")
    print(f"wrote {summary_line(summary(requests))} to {args.out}")
    if not args.no_ideal:
        ideal = ideal_hit_ratio(requests, load_server_tokenizer(), block_tokens=args.block_tokens)
        print(
            f"prompt tokens {ideal.prompt_tokens} (mean {ideal.mean_prompt_tokens:.0f}, max "
            f"{ideal.max_prompt_tokens}); ideal token hit ratio {ideal.token_hit_ratio:.3f} "
            f"(infinite cache, {args.block_tokens}-token blocks, prefix semantics)"
        )
    return 0


def _run_chat_workload(args: argparse.Namespace) -> int:
    from dscache_tools.workload import summary, summary_line, write_jsonl
    from dscache_tools.workload.chat import chat_workload

    try:
        requests = chat_workload(
            args.sessions,
            seed=args.seed,
            min_turns=args.min_turns,
            max_turns=args.max_turns,
            max_tokens=args.max_tokens,
            drop_id_share=args.drop_id_share,
        )
    except ValueError as exc:
        print(f"dscache workload chat: error: {exc}", file=sys.stderr)
        return 2
    write_jsonl(requests, args.out)
    print(f"wrote {summary_line(summary(requests))} to {args.out}")
    return 0


def _run_load(args: argparse.Namespace) -> int:
    import asyncio

    from dscache_tools.loadgen import LoadConfig, format_report, run_load, write_json
    from dscache_tools.workload import read_jsonl

    cfg = _options(
        LoadConfig, args, metrics_urls=tuple(args.metrics), progress=not args.no_progress
    )
    report = asyncio.run(run_load(cfg, read_jsonl(args.workload)))
    print(format_report(report))
    if args.json_out is not None:
        write_json(report, args.json_out)
        print(f"JSON written to {args.json_out}")
    return 0 if report.errors == 0 else 1


def _run_kube_demo(args: argparse.Namespace) -> int:
    from dscache_tools.demo.kube import KubeDemoOptions, main

    opts = _options(
        KubeDemoOptions, args, interval_s=round(args.interval) if args.interval else None
    )
    png = args.png_out
    if png is None:
        png = (
            args.json_out.with_suffix(".png")
            if args.json_out
            else Path("dscache-demo-kubernetes.png")
        )
    return main(opts, args.json_out, png)


def _run_demo(args: argparse.Namespace) -> int:
    from dscache_tools.demo.run import DemoOptions, main

    opts = _options(DemoOptions, args, prewarm=not args.no_prewarm)
    return main(opts, args.json_out, args.png_out)
