"""``dscache bench balance``: what bounded loads cost in hits and buy in latency.

The router sends a request without a session id by a hash of its prompt's opening.
On the finance workload every session about one company opens with that company's
filings, so under a plain consistent hash all its id-less requests go to one pod,
which queues them while the other pod idles. With bounded loads (``balance_factor``
> 0) a pod over ``factor x`` the track's mean in-flight count passes a request to
the next pod on the ring: a few more misses (the second pod has to learn the
prefix), much less queueing.

One run per factor, each on a fresh local stack (router + 2 model servers + 2
sidecars, empty caches) and the same requests in the same order; every figure a
ratio to the plain-hash run of the same invocation:

* ``token_hit_ratio``: prompt tokens restored / prompt tokens (the servers' counters);
* ``ttft_p50_s`` / ``ttft_p99_s``: client-side time to the whole (short) answer;
* ``busiest_pod_share``: the share of requests the busiest pod answered
  (0.5 is an even split);
* ``spills``: requests the router passed a pod over its bound for (router counter).

JSON (``--json``): ``runs`` (one object per factor with the figures above plus
``requests``, ``failed``, ``qps``) and ``ratios`` (balanced over plain:
``token_hit_ratio``, ``ttft_p50_s``, ``ttft_p99_s``, ``qps``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dscache import metricnames as names
from dscache_tools.bench import ratio
from dscache_tools.chaos import counters
from dscache_tools.demo.stack import LocalStack, StackOptions
from dscache_tools.loadgen import LoadConfig, LoadReport, run_load
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.workload import ChatRequest, WorkloadConfig, generate

#: Factors compared: the plain consistent hash (the baseline) and the router's default.
FACTORS = (0.0, 1.25)


@dataclass(frozen=True)
class BalanceRun:
    """The figures of one factor's run."""

    balance_factor: float
    requests: int
    failed: int
    qps: float
    token_hit_ratio: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    busiest_pod_share: float
    spills: float


def busiest_share(upstreams: Sequence[str | None]) -> float:
    """The share of answered requests that the busiest pod answered (0 for none)."""
    counts = Counter(u for u in upstreams if u)
    total = sum(counts.values())
    return max(counts.values()) / total if total else 0.0


def ratios(plain: BalanceRun, balanced: BalanceRun) -> dict[str, float | None]:
    """Balanced over plain for the figures a reader compares."""
    return {
        "token_hit_ratio": ratio(balanced.token_hit_ratio, plain.token_hit_ratio),
        "ttft_p50_s": ratio(balanced.ttft_p50_s, plain.ttft_p50_s),
        "ttft_p99_s": ratio(balanced.ttft_p99_s, plain.ttft_p99_s),
        "qps": ratio(balanced.qps, plain.qps),
    }


def workload(quick: bool, seed: int, max_tokens: int) -> list[ChatRequest]:
    """The finance workload with half the requests id-less (they route by prompt)."""
    return generate(
        WorkloadConfig(
            sessions=12 if quick else 40,
            seed=seed,
            companies=2,
            min_turns=2,
            max_turns=4 if quick else 6,
            drop_id_share=0.5,
            reconnect_share=0.0,
            max_tokens=max_tokens,
        )
    )


def run_factor(
    factor: float, requests: Sequence[ChatRequest], *, model: str, concurrency: int
) -> BalanceRun:
    """One run on a fresh stack with the router's ``balance_factor`` = ``factor``."""
    opts = StackOptions(model=model, balance_factor=factor, sidecar_capacity="512MiB")
    with (
        tempfile.TemporaryDirectory(prefix="dscache-balance-") as tmp,
        LocalStack(Path(tmp), opts) as st,
    ):
        st.start_servers(2, cache=True)
        router = st.start_router()
        cfg = LoadConfig(
            target=router.url,
            concurrency=concurrency,
            metrics_urls=tuple(s.metrics_url for s in st.servers),
            timeout_s=300.0,
            stream=False,
            progress=False,
        )
        report: LoadReport = asyncio.run(run_load(cfg, requests))
        skips = counters.read(router.url + names.ROUTER_METRICS_PATH, names.ROUTER_OVERLOAD_SKIPS)
    return BalanceRun(
        balance_factor=factor,
        requests=report.requests,
        failed=report.errors,
        qps=report.qps,
        token_hit_ratio=report.token_hit_ratio,
        ttft_p50_s=report.ttft_p50_s,
        ttft_p99_s=report.ttft_p99_s,
        busiest_pod_share=busiest_share([r.upstream for r in report.results if r.ok]),
        spills=skips or 0.0,
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: Sequence[BalanceRun], rel: dict[str, float | None]) -> str:
    """The printed table: one row per factor, then the ratios."""
    lines = [
        f"{'factor':>7} {'requests':>8} {'failed':>6} {'token hit':>9} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'QPS':>6} {'busiest pod':>11} {'spills':>6}"
    ]
    for r in runs:
        lines.append(
            f"{r.balance_factor:>7g} {r.requests:>8} {r.failed:>6} "
            f"{_fmt(r.token_hit_ratio, '.3f'):>9} {_fmt(r.ttft_p50_s, '.2f'):>8}s "
            f"{_fmt(r.ttft_p99_s, '.2f'):>8}s {r.qps:>6.2f} {r.busiest_pod_share:>11.2f} "
            f"{r.spills:>6g}"
        )
    lines.append(
        "balanced / plain: token hit "
        f"{_fmt(rel['token_hit_ratio'], '.3f')}x, TTFT p50 {_fmt(rel['ttft_p50_s'], '.2f')}x, "
        f"TTFT p99 {_fmt(rel['ttft_p99_s'], '.2f')}x, QPS {_fmt(rel['qps'], '.2f')}x"
    )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench balance``: both runs, the table, the JSON (exit 1 if any failed)."""
    requests = workload(args.quick, args.seed, args.max_tokens)
    runs = []
    with terminate_on_sigterm():
        for factor in FACTORS:
            print(f"balance factor {factor:g}: {len(requests)} requests ...", flush=True)
            runs.append(
                run_factor(factor, requests, model=args.model, concurrency=args.concurrency)
            )
    rel = ratios(runs[0], runs[1])
    print(table(runs, rel))
    if args.json_out:
        doc: dict[str, Any] = {
            "model": args.model,
            "concurrency": args.concurrency,
            "runs": [asdict(r) for r in runs],
            "ratios": rel,
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r.failed for r in runs) else 0
