"""``dscache demo``: the finance workload with the cache off, then on, side by side.

What runs (all real processes on loopback, see :mod:`dscache_tools.demo.stack`):

1. *cache off*: two model servers without a sidecar behind NGINX; the workload
   sample is replayed at a fixed concurrency.
2. *cache on*: the same two servers, each with its own sidecar (fresh, empty), the
   company documents prewarmed on each pod (the operator's prewarm job), and the
   same requests at the same concurrency.
3. (default run only) *cache on without the prompt-key fallback*: as 2, but the
   router does not key id-less requests by their prompt, which shows what the
   fallback is worth for the 40% of requests that lost their session id.

Contract:
    * Both passes send the same requests in the same order at the same concurrency.
    * The report's hit ratios are counter deltas read from the servers' /metrics
      over the timed run only (the prewarm is not counted); the ideal ratio is
      computed for the same requests after the same prewarm.
    * Every child is stopped on exit, including on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dscache_tools.demo.procs import terminate_on_sigterm
from dscache_tools.demo.stack import LocalStack, Server, StackOptions
from dscache_tools.loadgen import LoadConfig, LoadReport, run_load
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    ideal_hit_ratio,
    load_server_tokenizer,
    prewarm_requests,
    summary,
)

log = logging.getLogger(__name__)

#: Keys every pass's JSON carries (the documented report).
REPORT_KEYS = (
    "token_hit_ratio",
    "block_hit_ratio",
    "session_hit_ratio",
    "recomputed_share",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "e2e_p50_s",
    "e2e_p95_s",
    "e2e_p99_s",
    "qps",
    "requests",
    "errors",
    "duration_s",
)


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of ``dscache demo``.

    Attributes:
        quick: the ~2-minute profile (fewer sessions and companies, two passes).
        model: model preset for both servers.
        servers: model servers (pods) in the stable track.
        concurrency: sessions in flight (the same for both passes).
        sessions: sessions in the workload sample (None: the profile's).
        companies: companies the sample draws from (None: the profile's).
        seed: workload seed.
        max_tokens: completion tokens per request.
        drop_id_share: share of requests whose session id is dropped.
        drop_mode: drop per request or per session (see ``WorkloadConfig``).
        prewarm: send each company's documents to every pod before the cache-on run.
        fallback_pass: also run cache-on without the router's prompt-key fallback
            (None: only in the default profile).
        prometheus: also start Prometheus scraping every server and sidecar.
        workdir: where children keep files and logs (None: a temp dir, removed
            after a successful run).
        threads: torch threads per server.
    """

    quick: bool = False
    model: str = "mini-gqa"
    servers: int = 2
    concurrency: int = 4
    sessions: int | None = None
    companies: int | None = None
    seed: int = 0
    max_tokens: int = 8
    drop_id_share: float = 0.4
    drop_mode: Literal["request", "session"] = "request"
    prewarm: bool = True
    fallback_pass: bool | None = None
    prometheus: bool = False
    workdir: Path | None = None
    threads: int = 1

    def profile(self) -> tuple[int, int, bool]:
        """(sessions, companies, fallback pass) after applying the profile."""
        sessions, companies, fallback = (8, 3, False) if self.quick else (40, 6, True)
        return (
            self.sessions or sessions,
            self.companies or companies,
            fallback if self.fallback_pass is None else self.fallback_pass,
        )


@dataclass
class PassResult:
    """One pass: its name, load report and stack facts."""

    name: str
    report: LoadReport
    startup_s: float
    load_avg: float  # the machine's 1-minute load average around the run

    def figures(self) -> dict[str, Any]:
        """The documented keys plus a few more, JSON-ready."""
        d = self.report.to_dict(with_results=False)
        out: dict[str, Any] = {k: d[k] for k in REPORT_KEYS}
        out["client_token_hit_ratio"] = d["client_token_hit_ratio"]
        out["prompt_tokens"] = d["prompt_tokens"]
        out["cached_tokens"] = d["cached_tokens"]
        out["error_kinds"] = d["error_kinds"]
        out["startup_s"] = self.startup_s
        out["load_avg"] = self.load_avg
        # A cache-off server counts no hits; its hit ratio is 0 by definition.
        if out["token_hit_ratio"] is None:
            out["token_hit_ratio"] = 0.0
        if out["recomputed_share"] is None:
            out["recomputed_share"] = 1.0
        return out


def build_workload(opts: DemoOptions) -> list[ChatRequest]:
    """The demo's workload sample."""
    sessions, companies, _ = opts.profile()
    return generate(
        WorkloadConfig(
            sessions=sessions,
            seed=opts.seed,
            companies=companies,
            max_tokens=opts.max_tokens,
            drop_id_share=opts.drop_id_share,
            drop_mode=opts.drop_mode,
            min_turns=3,
            max_turns=8,
        )
    )


def _prewarm(servers: Sequence[Server], warm: Sequence[ChatRequest]) -> None:
    """Sends every shared prefix to every pod (pods in parallel, each in order)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one_pod(server: Server) -> None:
        with httpx.Client(base_url=server.url, timeout=600.0) as client:
            for r in warm:
                body = {"messages": r.messages, "max_tokens": 1, "temperature": 0.0}
                client.post("/v1/chat/completions", json=body).raise_for_status()

    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        for future in [pool.submit(one_pod, s) for s in servers]:
            future.result()
    # Blocks are stored in the background: give the stores a moment to land.
    time.sleep(1.0)


def _run_pass(
    name: str,
    stack: LocalStack,
    opts: DemoOptions,
    workload: Sequence[ChatRequest],
    *,
    cache: bool,
    prompt_key: bool = True,
) -> PassResult:
    print(f"\n== {name}: starting {opts.servers} model servers ({opts.model}, cache "
          f"{'on' if cache else 'off'}) ...", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    servers = stack.start_servers(opts.servers, cache=cache)
    router = stack.start_router(servers, prompt_key=prompt_key)
    if cache and opts.prewarm:
        _prewarm(servers, prewarm_requests(workload))
    if opts.prometheus:
        port = stack.start_prometheus(run_label=name.replace(" ", "_").replace(",", ""))
        print(f"   Prometheus on http://127.0.0.1:{port} (label run)", flush=True)
    startup = time.perf_counter() - t0
    print(f"   ready in {startup:.0f}s; router {router.url}; replaying {len(workload)} "
          f"requests at concurrency {opts.concurrency}", flush=True)  # fmt: skip
    cfg = LoadConfig(
        target=router.url,
        concurrency=opts.concurrency,
        metrics_urls=tuple(s.metrics_url for s in servers),
        timeout_s=600.0,
    )
    load_before = os.getloadavg()[0]
    report = asyncio.run(run_load(cfg, workload))
    load_after = os.getloadavg()[0]
    print(f"   done: {report.requests} requests in {report.duration_s:.0f}s, "
          f"{report.errors} errors", flush=True)  # fmt: skip
    for server in list(servers):
        stack.stop_server(server)
    stack.stop_router()
    return PassResult(name, report, startup, (load_before + load_after) / 2)


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Runs the demo; returns the JSON report (also printed as a table)."""
    started = time.perf_counter()
    workload = build_workload(opts)
    _, _, fallback = opts.profile()
    warm = prewarm_requests(workload) if opts.prewarm else []
    tok = load_server_tokenizer()
    ideal = ideal_hit_ratio(workload, tok, warm=warm)
    info = summary(workload)
    print(f"workload: {info['requests']} requests, {info['sessions']} sessions, "
          f"{info['companies']} companies, {100 * info['zh_share']:.0f}% Chinese, "
          f"{100 * info['dropped_id_share']:.0f}% without session id, "
          f"{info['reconnected_sessions']} reconnected sessions; mean prompt "
          f"{ideal.mean_prompt_tokens:.0f} tokens; ideal token hit ratio "
          f"{ideal.token_hit_ratio:.3f}", flush=True)  # fmt: skip
    own_dir = opts.workdir is None
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="dscache-demo-"))
    stack = LocalStack(
        workdir,
        StackOptions(model=opts.model, threads=opts.threads, max_queue=max(64, opts.concurrency)),
    )
    passes: dict[str, PassResult] = {}
    ok = False
    try:
        with terminate_on_sigterm(), stack:
            passes["cache_off"] = _run_pass("cache off", stack, opts, workload, cache=False)
            passes["cache_on"] = _run_pass("cache on", stack, opts, workload, cache=True)
            if fallback:
                passes["cache_on_no_prompt_key"] = _run_pass(
                    "cache on, no prompt-key fallback",
                    stack,
                    opts,
                    workload,
                    cache=True,
                    prompt_key=False,
                )
        ok = True
    except KeyboardInterrupt:
        print(f"\ninterrupted: every process stopped; logs in {workdir / 'logs'}", flush=True)
        raise
    except Exception:
        print(f"\nfailed: every process stopped; logs in {workdir / 'logs'}", flush=True)
        raise
    finally:
        if own_dir and ok:
            shutil.rmtree(workdir, ignore_errors=True)
    result: dict[str, Any] = {name: p.figures() for name, p in passes.items()}
    result["ideal_token_hit_ratio"] = ideal.token_hit_ratio
    result["workload"] = {**info, "mean_prompt_tokens": ideal.mean_prompt_tokens}
    result["settings"] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()
    }
    result["targets"] = check_targets(result)
    result["wall_s"] = time.perf_counter() - started
    result["latencies"] = {
        name: {
            "ttft_s": [r.ttft_s for r in p.report.results if r.ok and r.ttft_s is not None],
            "e2e_s": [r.e2e_s for r in p.report.results if r.ok],
        }
        for name, p in passes.items()
    }
    return result


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def check_targets(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's targets, cache on vs off: value, goal and whether it is met."""
    off, on = result["cache_off"], result["cache_on"]
    ideal = result["ideal_token_hit_ratio"]
    rows: list[tuple[str, float | None, str, bool | None]] = []

    def add(name: str, value: float | None, goal: str, met: bool | None) -> None:
        rows.append((name, value, goal, met))

    hit = on["token_hit_ratio"]
    add("token_hit_ratio", hit, ">= 0.85", hit is not None and hit >= 0.85)
    share = _div(hit, ideal)
    add("hit_vs_ideal", share, ">= 0.95", share is not None and share >= 0.95)
    rec = on["recomputed_share"]
    add("recomputed_share", rec, "<= 0.15", rec is not None and rec <= 0.15)
    ttft = _div(on["ttft_p99_s"], off["ttft_p99_s"])
    add("ttft_p99_on_over_off", ttft, "<= 0.4", ttft is not None and ttft <= 0.4)
    qps = _div(on["qps"], off["qps"])
    add("qps_on_over_off", qps, ">= 1.8", qps is not None and qps >= 1.8)
    errors = float(on["errors"] + off["errors"])
    add("errors", errors, "== 0", errors == 0)
    return {n: {"value": v, "goal": g, "met": m} for n, v, g, m in rows}


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "ratio":
        return f"{value:.3f}"
    if kind == "s":
        return f"{value:.3f} s"
    if kind == "qps":
        return f"{value:.2f}"
    return str(value)


_ROWS: tuple[tuple[str, str, str], ...] = (
    ("token hit ratio", "token_hit_ratio", "ratio"),
    ("block hit ratio", "block_hit_ratio", "ratio"),
    ("session hit ratio", "session_hit_ratio", "ratio"),
    ("recomputed share of prompt tokens", "recomputed_share", "ratio"),
    ("TTFT P50", "ttft_p50_s", "s"),
    ("TTFT P99", "ttft_p99_s", "s"),
    ("end-to-end P99", "e2e_p99_s", "s"),
    ("QPS", "qps", "qps"),
    ("requests", "requests", "n"),
    ("errors", "errors", "n"),
)


def format_table(result: dict[str, Any]) -> str:
    """The side-by-side table (markdown, so it pastes into docs as is)."""
    cols = [c for c in ("cache_off", "cache_on", "cache_on_no_prompt_key") if c in result]
    titles = {
        "cache_off": "cache off",
        "cache_on": "cache on",
        "cache_on_no_prompt_key": "cache on, no prompt key",
    }
    header = "| | " + " | ".join(titles[c] for c in cols) + " | on / off |"
    lines = [header, "|---|" + "---:|" * (len(cols) + 1)]
    for label, key, kind in _ROWS:
        cells = [_fmt(result[c].get(key), kind) for c in cols]
        ratio = ""
        if kind in ("s", "qps"):
            r = _div(result["cache_on"].get(key), result["cache_off"].get(key))
            ratio = "-" if r is None else f"{r:.2f}x"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
    lines.append(f"ideal token hit ratio of this workload: {result['ideal_token_hit_ratio']:.3f}")
    cores = os.cpu_count() or 1
    loads = {c: result[c].get("load_avg", 0.0) for c in cols}
    lines.append(
        f"machine load average during the runs ({cores} cores): "
        + ", ".join(f"{titles[c]} {v:.1f}" for c, v in loads.items())
    )
    if max(loads.values()) > cores:
        lines.append(
            "note: other work competed for the CPU during the runs; the latency and QPS "
            "ratios are only as fair as that load was even"
        )
    for name, t in result["targets"].items():
        mark = "met" if t["met"] else "MISSED"
        lines.append(f"target {name}: {_fmt(t['value'], 'ratio')} (goal {t['goal']}) {mark}")
    return "\n".join(lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a clear error."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            f"the PNG needs the 'bench' extra: pip install 'dscache[bench]' ({exc})"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_png(result: dict[str, Any], path: Path) -> None:
    """Latency distributions (CDF of TTFT and end-to-end) and hit ratios, as a PNG."""
    plt = pyplot()

    colors = {"cache_off": "#c0392b", "cache_on": "#27ae60", "cache_on_no_prompt_key": "#2980b9"}
    labels = {
        "cache_off": "cache off",
        "cache_on": "cache on",
        "cache_on_no_prompt_key": "cache on, no prompt key",
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in (
        (axes[0], "ttft_s", "time to first token"),
        (axes[1], "e2e_s", "end-to-end latency"),
    ):
        for name, lat in result["latencies"].items():
            xs = sorted(lat[key])
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", color=colors.get(name), label=labels.get(name, name))
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{title} (CDF)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax = axes[2]
    names = [n for n in ("cache_off", "cache_on", "cache_on_no_prompt_key") if n in result]
    metrics = [
        ("token", "token_hit_ratio"),
        ("block", "block_hit_ratio"),
        ("session", "session_hit_ratio"),
        ("recomputed", "recomputed_share"),
    ]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [result[name].get(k) or 0.0 for _, k in metrics]
        xs = [j + i * width for j in range(len(metrics))]
        ax.bar(xs, vals, width=width, color=colors.get(name), label=labels.get(name, name))
    ax.axhline(
        result["ideal_token_hit_ratio"], color="black", ls="--", lw=1, label="ideal token hit"
    )
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(metrics))])
    ax.set_xticklabels([m for m, _ in metrics])
    ax.set_ylim(0, 1.05)
    ax.set_title("hit ratios and recomputed share")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8)
    off, on = result["cache_off"], result["cache_on"]
    fig.suptitle(
        f"dscache demo: QPS {off['qps']:.2f} -> {on['qps']:.2f}, "
        f"TTFT P99 {off['ttft_p99_s'] or 0:.2f}s -> {on['ttft_p99_s'] or 0:.2f}s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(opts: DemoOptions, json_out: Path | None, png_out: Path | None) -> int:
    """Runs the demo, prints the table, writes JSON and PNG; returns the exit code."""
    try:
        result = run_demo(opts)
    except KeyboardInterrupt:
        return 130
    print()
    print(format_table(result))
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nJSON written to {json_out}")
    if png_out is not None:
        write_png(result, png_out)
        print(f"PNG written to {png_out}")
    print(f"demo took {result['wall_s']:.0f}s")
    return 0
