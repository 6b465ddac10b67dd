"""``dscache demo``: the finance workload with the cache off, then on, side by side.

What runs (all real processes on loopback, see :mod:`dscache_tools.demo.stack`):

1. *cache off*: two model servers without a sidecar behind NGINX; the workload
   sample is replayed at a fixed concurrency.
2. *cache on*: the same two servers, each with its own sidecar (fresh, empty), the
   company documents prewarmed on each pod (the operator's prewarm job), and the
   same requests at the same concurrency, routed by the session / prompt-key hash.
3. (``kv`` in ``routing``, the default) *cache on, kv routing*: as 2, but the router
   asks the KV-aware picker which pod holds the longest cached prefix.
4. (default run only) *cache on without the prompt-key fallback*: as 2, but the
   router does not key id-less requests by their prompt, which shows what the
   fallback is worth for the 40% of requests that lost their session id.

The requests are the generated finance sample (``standard`` or ``varied``
openings) or a workload file in ``dscache workload``'s format.

Contract:
    * Every pass sends the same requests in the same order at the same concurrency;
      every cache-on pass gets the same prewarm.
    * The report's hit ratios are counter deltas read from the servers' /metrics
      over the timed run only (the prewarm is not counted); the ideal ratio is
      computed for the same requests after the same prewarm.
    * ``routing`` in the report lists each cache-on pass as a routing mode with its
      token hit ratio (``ROUTING_PASSES``), in that order; ``cache_on`` is always
      the ``hash`` pass.
    * A workload that cannot be read or built is an error before any child starts.
    * Every child is stopped on exit, including on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dscache_tools.demo.output import publish
from dscache_tools.demo.run_report import check_targets, format_table, write_png
from dscache_tools.demo.stack import LocalStack, Server, StackOptions
from dscache_tools.loadgen import LoadConfig, LoadReport, run_load
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    prewarm_requests,
    read_jsonl,
    summary,
    summary_line,
)
from dscache_tools.workload.ideal import ideal_hit_ratio, load_server_tokenizer

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

#: The cache-on passes ``routing`` lists, in order: (routing mode, pass key).
ROUTING_PASSES = (
    ("hash", "cache_on"),
    ("kv", "cache_on_kv"),
    ("hash-no-prompt-key", "cache_on_no_prompt_key"),
)

#: Routing modes a run can compare (``DemoOptions.routing``).
RoutingMode = Literal["hash", "kv"]


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of ``dscache demo``.

    Attributes:
        quick: the ~1-minute profile (fewer sessions and companies, two passes).
        model: model preset for both servers.
        servers: model servers (pods) in the stable track.
        concurrency: sessions in flight (the same for both passes).
        sessions: sessions in the workload sample (None: the profile's).
        companies: companies the sample draws from (None: the profile's).
        seed: workload seed.
        max_tokens: completion tokens per request.
        drop_id_share: share of requests whose session id is dropped.
        drop_mode: drop per request or per session (see ``WorkloadConfig``).
        workload_variant: the generated sample's variant (see ``WorkloadConfig``).
        workload_file: replay this JSONL instead of a generated sample (the sample's
            knobs above do not apply).
        routing: routing modes to compare, each a cache-on pass; must include
            ``hash`` (the cache-on pass); ``kv`` adds the KV-aware pass.
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
    workload_variant: Literal["standard", "varied"] = "standard"
    workload_file: Path | None = None
    routing: tuple[RoutingMode, ...] = ("hash", "kv")
    prewarm: bool = True
    fallback_pass: bool | None = None
    prometheus: bool = False
    workdir: Path | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        unknown = set(self.routing) - {"hash", "kv"}
        if unknown or "hash" not in self.routing:
            raise ValueError(f"routing must include 'hash' and only hash, kv: {self.routing}")

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
        out["breakdown"] = d["breakdown"]
        out["startup_s"] = self.startup_s
        out["load_avg"] = self.load_avg
        # A cache-off server counts no hits; its hit ratio is 0 by definition.
        if out["token_hit_ratio"] is None:
            out["token_hit_ratio"] = 0.0
        if out["recomputed_share"] is None:
            out["recomputed_share"] = 1.0
        return out


@dataclass(frozen=True)
class DemoWorkload:
    """What every pass replays, and the prewarm every cache-on pass sends first.

    Attributes:
        requests: the requests, in replay order.
        warm: the prewarm (one shared prefix per company), or empty.
        file: the workload file, or None for a generated sample.
        prewarm_note: one line saying what the prewarm is, or why there is none.
    """

    requests: list[ChatRequest]
    warm: list[ChatRequest]
    file: Path | None
    prewarm_note: str


def build_workload(opts: DemoOptions) -> list[ChatRequest]:
    """The demo's generated workload sample."""
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
            variant=opts.workload_variant,
        )
    )


def choose_prewarm(
    requests: Sequence[ChatRequest], *, enabled: bool
) -> tuple[list[ChatRequest], str]:
    """The prewarm of ``requests`` and a line saying what it is, or why there is none.

    The prewarm is each company's system messages (:func:`prewarm_requests`); a
    company whose first request has none gets no prewarm request.
    """
    if not enabled:
        return [], "no prewarm (--no-prewarm)"
    warm = [w for w in prewarm_requests(requests) if any(m["role"] == "system" for m in w.messages)]
    if not warm:
        return [], "no prewarm: the requests carry no system messages (the shared prefix)"
    return warm, (
        f"prewarm: the system messages of {len(warm)} "
        f"compan{'y' if len(warm) == 1 else 'ies'} on every pod before each cache-on pass"
    )


def load_workload(opts: DemoOptions) -> DemoWorkload:
    """The requests of ``opts`` (the file's, or a generated sample) and their prewarm.

    Raises:
        ValueError: a malformed workload file (the message names the line), an
            empty one, or sample knobs out of range.
        OSError: the file cannot be read.
    """
    if opts.workload_file is not None:
        requests = read_jsonl(opts.workload_file)
        if not requests:
            raise ValueError(f"{opts.workload_file}: no requests")
    else:
        requests = build_workload(opts)
    warm, note = choose_prewarm(requests, enabled=opts.prewarm)
    return DemoWorkload(requests, warm, opts.workload_file, note)


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
    warm: Sequence[ChatRequest] = (),
    *,
    cache: bool,
    prompt_key: bool = True,
    routing: RoutingMode = "hash",
) -> PassResult:
    print(f"\n== {name}: starting {opts.servers} model servers ({opts.model}, cache "
          f"{'on' if cache else 'off'}, {routing} routing) ...", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    servers = stack.start_servers(opts.servers, cache=cache)
    router = stack.start_router(servers, prompt_key=prompt_key, routing=routing)
    if cache and warm:
        _prewarm(servers, warm)
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


def run_demo(opts: DemoOptions, workload: DemoWorkload | None = None) -> dict[str, Any]:
    """Runs the demo on ``workload`` (default: ``load_workload(opts)``); returns the JSON report.

    The report is also printed as a table by :func:`main`.
    """
    started = time.perf_counter()
    if workload is None:
        workload = load_workload(opts)
    requests, warm = workload.requests, workload.warm
    _, _, fallback = opts.profile()
    tok = load_server_tokenizer()
    ideal = ideal_hit_ratio(requests, tok, warm=warm)
    info = summary(requests)
    variant = opts.workload_variant if workload.file is None else None
    what = f"{variant} finance sample" if workload.file is None else str(workload.file)
    print(f"workload ({what}): {summary_line(info)}; mean prompt {ideal.mean_prompt_tokens:.0f} "
          f"tokens; ideal token hit ratio {ideal.token_hit_ratio:.3f}", flush=True)  # fmt: skip
    print(workload.prewarm_note, flush=True)
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
            passes["cache_off"] = _run_pass("cache off", stack, opts, requests, cache=False)
            passes["cache_on"] = _run_pass("cache on", stack, opts, requests, warm, cache=True)
            if "kv" in opts.routing:
                passes["cache_on_kv"] = _run_pass(
                    "cache on, kv routing", stack, opts, requests, warm, cache=True, routing="kv"
                )
            if fallback:
                passes["cache_on_no_prompt_key"] = _run_pass(
                    "cache on, no prompt-key fallback",
                    stack,
                    opts,
                    requests,
                    warm,
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
    return assemble_result(
        passes,
        ideal_token_hit_ratio=ideal.token_hit_ratio,
        workload={
            **info,
            "mean_prompt_tokens": ideal.mean_prompt_tokens,
            "file": None if workload.file is None else str(workload.file),
            "variant": variant,
            "prewarm_requests": len(warm),
        },
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        wall_s=time.perf_counter() - started,
    )


def assemble_result(
    passes: Mapping[str, PassResult],
    *,
    ideal_token_hit_ratio: float,
    workload: dict[str, Any],
    settings: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """The JSON report of finished passes (pure: no stack, no clock).

    ``passes`` holds ``cache_off`` and ``cache_on`` at least, by their report keys;
    ``routing`` lists the cache-on passes of ``ROUTING_PASSES`` that ran.
    """
    result: dict[str, Any] = {name: p.figures() for name, p in passes.items()}
    result["ideal_token_hit_ratio"] = ideal_token_hit_ratio
    result["routing"] = [
        {"name": mode, "token_hit_ratio": result[key]["token_hit_ratio"]}
        for mode, key in ROUTING_PASSES
        if key in passes
    ]
    result["workload"] = workload
    result["settings"] = settings
    result["targets"] = check_targets(result)
    result["wall_s"] = wall_s
    result["latencies"] = {
        name: {
            "ttft_s": [r.ttft_s for r in p.report.results if r.ok and r.ttft_s is not None],
            "e2e_s": [r.e2e_s for r in p.report.results if r.ok],
        }
        for name, p in passes.items()
    }
    return result


def main(opts: DemoOptions, json_out: Path | None, png_out: Path | None) -> int:
    """Runs the demo, prints the table, writes JSON and PNG; returns the exit code.

    A workload that cannot be read is exit code 2, before anything starts.
    """
    try:
        workload = load_workload(opts)
    except (OSError, ValueError) as exc:
        print(f"dscache demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_demo(opts, workload)
    except KeyboardInterrupt:
        return 130
    publish(result, format_table(result), json_out, png_out, write_png)
    return 0
