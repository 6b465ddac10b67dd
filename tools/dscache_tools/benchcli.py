"""``dscache replay`` and the component benchmarks (``bench store``, ``ttft``, ``balance``,
``vllm``, ``shared-tier``, ``codec``, ``admission``, ``coldstart``, ``prewarm``).

Light module: argument parsing only; each handler imports its implementation,
so ``dscache --help`` never loads torch or matplotlib.
"""

from __future__ import annotations

import argparse

from dscache.cli import Commands


def register(sub: Commands, bench: Commands) -> None:
    """Adds the trace replay and the component benchmarks."""
    r = sub.add_parser(
        "replay",
        help="replay a request trace against eviction policies (hit ratios, Belady bound)",
    )
    _replay_arguments(r)
    r.set_defaults(handler=_run_replay)

    bs = bench.add_parser(
        "store", help="KV store write/read paths vs torch.save/load, memcpy, write()"
    )
    bs.add_argument("--tokens", type=int, default=4096, help="KV length in tokens (default 4096)")
    bs.add_argument(
        "--repeat", type=int, default=7, help="repetitions per figure (median; default 7)"
    )
    bs.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bs.add_argument("--data-dir", default=None, help="where to put the store (default: a temp dir)")
    bs.set_defaults(handler=_run_bench_store)

    b = bench.add_parser(
        "ttft",
        help="time to first token: full prefill vs cache hit via the sidecar vs in-memory KV",
    )
    b.add_argument("--model", default="tiny-gqa", help="preset or checkpoint dir (tiny-gqa)")
    b.add_argument(
        "--context", default="1024,4096,8192", help="comma-separated prompt lengths, tokens"
    )
    b.add_argument(
        "--new-tokens", type=int, default=64, help="uncached suffix tokens on a hit (64)"
    )
    b.add_argument("--repeat", type=int, default=3, help="runs per figure, median (>= 3)")
    b.add_argument(
        "--hit-repeat",
        type=int,
        default=9,
        help="hit / in-memory runs (cheap; median; default 9)",
    )
    b.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    b.add_argument("--block-tokens", type=int, default=256, help="tokens per block (256)")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    b.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="model and KV dtype (float32)",
    )
    b.add_argument(
        "--data-dir", default=None, help="sidecar data dir (default: a temporary directory)"
    )
    b.add_argument("--capacity", default="2GiB", help="sidecar capacity (default 2GiB)")
    b.set_defaults(handler=_run_bench_ttft)

    bb = bench.add_parser(
        "balance",
        help="router bounded loads vs plain consistent hash: hit ratio, TTFT, pod shares",
    )
    bb.add_argument("--quick", action="store_true", help="the short profile (12 sessions)")
    bb.add_argument("--model", default="tiny-gqa", help="preset of both servers (tiny-gqa)")
    bb.add_argument("--concurrency", type=int, default=4, help="sessions in flight (4)")
    bb.add_argument("--max-tokens", type=int, default=8, help="completion tokens (8)")
    bb.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    bb.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bb.set_defaults(handler=_run_bench_balance)

    bv = bench.add_parser(
        "vllm",
        help="real vLLM restarted warm: dscache vs ExampleConnector vs recompute, lookups",
    )
    bv.add_argument("--context", default="8192", help="comma-separated prompt lengths (8192)")
    bv.add_argument(
        "--layout", default="gqa,mla", help="attention layouts: gqa (Llama), mla (DeepSeek-V3)"
    )
    bv.add_argument(
        "--quick",
        action="store_true",
        help="one run per figure, no multi-turn sessions, 1000 lookups (2 cores: ~15 min)",
    )
    bv.add_argument("--model", default="small", help="local checkpoint size: tiny or small (small)")
    bv.add_argument("--repeat", type=int, default=3, help="TTFT runs per figure, median (3)")
    bv.add_argument(
        "--lookup-repeat", type=int, default=2000, help="lookups timed for the p99 (2000)"
    )
    bv.add_argument(
        "--sessions",
        type=int,
        default=6,
        help="finance sessions of the multi-turn comparison; 0 skips it (6)",
    )
    bv.add_argument("--capacity", default="2GiB", help="sidecar capacity (2GiB)")
    bv.add_argument("--work-dir", default=None, help="where stores and logs go (a temp dir)")
    bv.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bv.set_defaults(handler=_run_bench_vllm)
    _add_shared_tier(bench)
    _add_respell(bench)


def _add_shared_tier(bench: Commands) -> None:
    bt = bench.add_parser(
        "shared-tier",
        help="sessions moved to a fresh pod, scale-out, remote faults: with vs without "
        "a shared Redis Cluster tier",
    )
    bt.add_argument("--quick", action="store_true", help="the short profile (12 sessions)")
    bt.add_argument("--model", default="mini-gqa", help="preset of every server (mini-gqa)")
    bt.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    bt.add_argument("--work-dir", default=None, help="where stores and logs go (a temp dir)")
    bt.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bt.set_defaults(handler=_run_bench_shared_tier)

    bc = bench.add_parser(
        "codec",
        help="bytes per token, encode/decode speed and quality (perplexity, greedy agreement) "
        "of fp32 / bf16 / int8 / zstd KV on small trained models",
    )
    bc.add_argument("--quick", action="store_true", help="the short profile (2 windows)")
    bc.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bc.add_argument("--png", dest="png_out", default=None, help="write a chart here")
    bc.set_defaults(handler=_run_bench_codec)

    ba = bench.add_parser(
        "admission",
        help="cost-based cache admission vs the fixed 512-token threshold vs no cache, "
        "on a chat-like workload of short turns",
    )
    ba.add_argument("--quick", action="store_true", help="the short profile (8 sessions)")
    ba.add_argument("--model", default="mini-gqa", help="preset of the servers (mini-gqa)")
    ba.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    ba.add_argument("--work-dir", default=None, help="where stores and logs go (a temp dir)")
    ba.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    ba.set_defaults(handler=_run_bench_admission)

    bk = bench.add_parser(
        "coldstart",
        help="a cold pod's first requests with no prewarm, the user's document list, or "
        "templates mined from earlier traffic: token hit ratio and TTFT",
    )
    bk.add_argument("--quick", action="store_true", help="the short profile (8 requests)")
    bk.add_argument("--model", default="mini-gqa", help="preset of the servers (mini-gqa)")
    bk.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    bk.add_argument("--work-dir", default=None, help="where stores and logs go (a temp dir)")
    bk.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bk.set_defaults(handler=_run_bench_coldstart)

    bp = bench.add_parser(
        "prewarm",
        help="a canary's first requests after no prewarm, every prompt on every pod, or each "
        "prompt on the pod the router's hash picks (with and without the picker)",
    )
    bp.add_argument("--quick", action="store_true", help="the short profile (2 pods, 12 requests)")
    bp.add_argument("--model", default="mini-gqa", help="preset of the servers (mini-gqa)")
    bp.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    bp.add_argument(
        "--drop-id-share",
        type=float,
        default=0.4,
        help="share of requests the gateway sends without a session id (0.4)",
    )
    bp.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="sessions in flight (1: a first canary step's trickle)",
    )
    bp.add_argument("--work-dir", default=None, help="where stores and logs go (a temp dir)")
    bp.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bp.set_defaults(handler=_run_bench_prewarm)

    bo = bench.add_parser(
        "operator",
        help="50 DeepSeekCacheDeployments in 10 namespaces on 200 simulated nodes rolling out "
        "at once under the two peered operator replicas: reconcile latency, the operator's "
        "memory and CPU, API requests per reconcile, stuck rollouts (needs the dev cluster's "
        "binaries)",
    )
    bo.add_argument("--quick", action="store_true", help="the same scale, a shorter timeout")
    bo.add_argument("--work-dir", default=None, help="where the cluster and logs go (a temp dir)")
    bo.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bo.set_defaults(handler=_run_bench_operator)

    bq = bench.add_parser(
        "router",
        help="the latency the picker's KV-aware choice adds per request, against the plain "
        "hash router, with stand-in pods (P50 / P99 at concurrency 1 and 4)",
    )
    bq.add_argument("--quick", action="store_true", help="the short profile (about a minute)")
    bq.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    bq.add_argument(
        "--requests", type=int, default=None, help="cut the workload to its first N requests"
    )
    bq.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bq.add_argument("--png", dest="png_out", default=None, help="write a chart here")
    bq.set_defaults(handler=_run_bench_router)


def _run_bench_coldstart(args: argparse.Namespace) -> int:
    from dscache_tools.bench.coldstart import run_cli

    return run_cli(args)


def _run_bench_prewarm(args: argparse.Namespace) -> int:
    from dscache_tools.bench.prewarmbench import run_cli

    return run_cli(args)


def _run_bench_operator(args: argparse.Namespace) -> int:
    from dscache_tools.bench.operatorbench import run_cli

    return run_cli(args)


def _run_bench_router(args: argparse.Namespace) -> int:
    from dscache_tools.bench.router import run_cli

    return run_cli(args)


def _add_respell(bench: Commands) -> None:
    br = bench.add_parser(
        "respell",
        help="a restarted model server continuing conversations whose answers were stored "
        "under the ids a model generated: following the stored tokenization vs encoding anew",
    )
    br.add_argument("--quick", action="store_true", help="the short profile (4 conversations)")
    br.add_argument("--model", default="mini-gqa", help="preset of the servers (mini-gqa)")
    br.add_argument(
        "--resplit-share",
        type=float,
        default=0.5,
        help="share of the stored answers whose generated ids are not what encoding their "
        "text gives (0.5)",
    )
    br.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    br.add_argument("--work-dir", default=None, help="where stores and logs go (a temp dir)")
    br.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    br.set_defaults(handler=_run_bench_respell)


def _run_bench_respell(args: argparse.Namespace) -> int:
    from dscache_tools.bench.respell import run_cli

    return run_cli(args)


def _run_bench_admission(args: argparse.Namespace) -> int:
    from dscache_tools.bench.admission import run_cli

    return run_cli(args)


def _run_bench_codec(args: argparse.Namespace) -> int:
    from dscache_tools.bench.codec import run_cli

    return run_cli(args)


def _replay_arguments(r: argparse.ArgumentParser) -> None:
    """``dscache replay``'s arguments."""
    r.add_argument(
        "--trace",
        required=True,
        help="Mooncake JSONL trace, a dscache request log, or a built-in workload: "
        "finance, chat (ShareGPT-style)",
    )
    r.add_argument(
        "--capacity-blocks",
        default="16384",
        help="comma-separated cache capacities in blocks, or N%% of the trace's distinct "
        "blocks (default 16384)",
    )
    r.add_argument(
        "--signals",
        default="",
        help="comma-separated serving-path signals (ended, expected, queued) for a second "
        "run of each policy that takes them (default: none)",
    )
    r.add_argument(
        "--signal-coverage",
        type=float,
        default=1.0,
        help="share of requests whose client sends ended/expected (default 1)",
    )
    r.add_argument(
        "--queue-s",
        type=float,
        default=2.0,
        help="queued: requests arriving within this many seconds wait in the queue (2)",
    )
    r.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="built-in traces: sessions (finance 1000, chat 4000)",
    )
    r.add_argument(
        "--block-tokens", type=int, default=16, help="built-in traces: tokens per block (16)"
    )
    r.add_argument(
        "--arrivals",
        default="poisson",
        choices=["poisson", "sequential"],
        help="built-in traces: interleaved sessions (poisson) or one after another",
    )
    r.add_argument("--seed", type=int, default=0, help="built-in traces and signals: seed")
    r.add_argument(
        "--policy",
        default=None,
        help="comma-separated policies, or 'all' (default: the store's default policy and lru)",
    )
    r.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    r.add_argument("--png", dest="png_out", default=None, help="write a hit-ratio chart here")
    r.add_argument(
        "--no-belady",
        action="store_true",
        help="skip the offline-optimal bound (slow on big traces)",
    )


def _run_replay(args: argparse.Namespace) -> int:
    from dscache_tools.replay import run_cli

    return run_cli(args)


def _run_bench_store(args: argparse.Namespace) -> int:
    from dscache_tools.bench.store import run_cli

    return run_cli(args)


def _run_bench_ttft(args: argparse.Namespace) -> int:
    from dscache_tools.bench.server import run_cli

    return run_cli(args)


def _run_bench_vllm(args: argparse.Namespace) -> int:
    from dscache_tools.bench.vllm import run_cli

    return run_cli(args)


def _run_bench_shared_tier(args: argparse.Namespace) -> int:
    from dscache_tools.bench.sharedtier import run_cli

    return run_cli(args)


def _run_bench_balance(args: argparse.Namespace) -> int:
    from dscache_tools.bench.balance import run_cli

    return run_cli(args)
