"""``dscache bench router``: the latency the picker's KV-aware choice adds per request.

With a picker configured the router's Lua asks it, for every request, which pod
holds the longest cached prefix (an internal subrequest carrying the body); the
picker tokenizes the prompt, computes its block keys, matches them against each
pod's holdings filter and its MinHash index. This bench measures what that costs
a client, and nothing else: model servers are far too slow and noisy for a
figure of a few milliseconds, so the upstreams are :class:`StandInPod` children (a
tiny Starlette app answering every chat completion with one fixed small answer at
once) that publish what a real pod publishes to the picker: ``/dscache/keyinfo``
with a key-chain root and 256-token blocks, and a holdings filter
(:mod:`dscache_sidecar.holdings`) of the block keys of half the workload's
requests, split between the two pods, so the picker does its real work.

Two real NGINX routers (:func:`dscache_router.nginx.render_nginx_conf`, the
Debian Lua modules, bounded loads with factor 1.25) stand in front of the same
two stand-ins: ``hash`` (no picker: session / prompt-key hash) and ``kv`` (a real
``dscache picker`` child fetching the stand-ins' keyinfo and filters). The same
finance requests (:func:`dscache_tools.workload.generate`, with and without
``X-Session-ID`` as the workload says) go through each, one at a time and four
at a time, in rounds that alternate the two routers so the machine's noise hits
both; latency is the client's (httpx), from sending the request to having read
the whole answer.

JSON (``--json``): ``rows`` (per concurrency: ``concurrency``, ``hash_p50_ms``,
``hash_p99_ms``, ``kv_p50_ms``, ``kv_p99_ms``, ``added_p50_ms``,
``added_p99_ms`` (kv - hash), ``p50_ratio``, ``p99_ratio`` (kv / hash)),
``picker_decision_mean_ms`` (the picker's own ``dscache_picker_decision_seconds``
over the measured requests: tokenizing and matching, not the HTTP round trip),
``picks`` (the kv router's ``dscache_router_picks_total`` by reason over the
measured requests; ``failed``: the picker did not answer in time),
``requests`` (measured requests, both routers), ``failed`` (requests without a
200 answer), ``workload_requests`` (requests per pass), ``rounds``, and
``feeds``: how fast and at what cost a router learns a pod's new blocks from its
sidecar's KV events against its holdings filter (:mod:`dscache_tools.bench.feeds`), and
``epp``: the picker's endpoint-picker face as a gateway meets it (time to the pick
against a null processor, token hits against the ring and the ideal:
:mod:`dscache_tools.bench.eppbench`).
The command exits 1 when a request failed; a pick the picker left unanswered
(the hash placed that request) is counted in ``picks.failed`` and logged.

Contract:
    * Every child (stand-ins, picker, NGINX) is on loopback, with its files in a
      temporary directory, and stopped when the bench ends, also on Ctrl-C.
    * Percentiles pool every round of a router at a concurrency; a pass is
      measured only after both routers and the picker answered warm-up requests
      and the picker holds the stand-ins' filters.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any

import httpx
from dscache_router.nginx import DEBIAN_LUA_MODULES, PromptKey, RouterConfig, render_nginx_conf
from dscache_sidecar.holdings import HoldingsFilter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dscache import metricnames as names
from dscache.keys import block_keys
from dscache_tools.bench import Doc, ratio
from dscache_tools.bench.eppbench import epp_table, run_epp
from dscache_tools.bench.feeds import feeds_table, run_feeds
from dscache_tools.demo.output import pyplot
from dscache_tools.demo.parts import child_env, find_nginx
from dscache_tools.loadgen.report import percentile
from dscache_tools.net import free_port
from dscache_tools.procs import (
    Child,
    ProcessGroup,
    StartError,
    http_ok,
    terminate_on_sigterm,
)
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    load_server_tokenizer,
    prompt_ids,
)

log = logging.getLogger(__name__)

#: This module, run as a stand-in pod by ``python -m``.
STAND_IN_MODULE = "dscache_tools.bench.router"
#: Tokens per block the stand-ins announce (the model server's default).
BLOCK_TOKENS = 256
#: The stand-ins' key-chain root: any 32 bytes do; both pods serve one model.
STAND_IN_ROOT = hashlib.sha256(b"dscache bench router: stand-in model").digest()
#: Requests in flight per pass.
CONCURRENCIES = (1, 4)
#: The routers compared; ``hash`` is the baseline.
ROUTINGS = ("hash", "kv")
#: The picker's decision timer (:class:`dscache_router.picker.PickerMetrics`).
PICKER_DECISION_SECONDS = "dscache_picker_decision_seconds"
#: The picker's gauge of pods whose holdings filter it has.
PICKER_FILTERS = "dscache_picker_filters"
#: Reasons the router counts picks under (``failed``: no answer in time).
PICK_REASONS = ("pinned", "prefix", "similar", "hash", "overloaded", "failed")
#: The stand-in's one answer: OpenAI-shaped, small, the same every time.
ANSWER = json.dumps(
    {
        "id": "chatcmpl-stand-in",
        "object": "chat.completion",
        "created": 0,
        "model": "stand-in",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
    }
).encode()


@dataclass(frozen=True)
class Profile:
    """How big a run is.

    Attributes:
        sessions: finance sessions of the workload.
        max_turns: most turns per session.
        rounds: passes per router and concurrency, interleaved.
    """

    sessions: int
    max_turns: int
    rounds: int


QUICK = Profile(sessions=16, max_turns=4, rounds=3)
FULL = Profile(sessions=48, max_turns=6, rounds=5)


@dataclass(frozen=True)
class StandInPod:
    """A running stand-in model pod (see the module docstring); not a model server."""

    port: int
    child: Child

    @property
    def address(self) -> str:
        """``host:port`` as the router and the picker name it."""
        return f"127.0.0.1:{self.port}"

    @property
    def holdings_url(self) -> str:
        """Where it serves its holdings filter."""
        return f"http://{self.address}/holdings"


@dataclass(frozen=True)
class Pass:
    """One pass of the workload through one router."""

    routing: str
    concurrency: int
    latencies_ms: list[float]
    failed: int


# -- the stand-in pod (a child process) -----------------------------------------------


def stand_in_app(root: bytes, holdings: bytes) -> Starlette:
    """The stand-in's ASGI app: keyinfo, the holdings filter, one fixed chat answer."""
    keyinfo = {
        "model": "stand-in",
        "block_tokens": BLOCK_TOKENS,
        "fingerprint": hashlib.sha256(root).hexdigest(),
        "root": root.hex(),
    }

    async def get_keyinfo(_request: Request) -> Response:
        return JSONResponse(keyinfo)

    async def get_holdings(_request: Request) -> Response:
        return Response(holdings, media_type="application/octet-stream")

    async def chat(request: Request) -> Response:
        await request.body()  # read it, as a server does
        return Response(ANSWER, media_type="application/json")

    return Starlette(
        routes=[
            Route("/dscache/keyinfo", get_keyinfo),
            Route("/holdings", get_holdings),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


def stand_in_main(argv: Sequence[str]) -> int:
    """Serves :func:`stand_in_app` on ``--port`` until SIGTERM (the bench's child)."""
    import uvicorn

    p = argparse.ArgumentParser(prog="dscache bench router stand-in pod")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--root", required=True, help="key-chain root, hex")
    p.add_argument("--holdings", type=Path, required=True, help="holdings filter bytes")
    args = p.parse_args(argv)
    app = stand_in_app(bytes.fromhex(args.root), args.holdings.read_bytes())
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


# -- the workload and what the stand-ins hold -------------------------------------------


def workload(profile: Profile, seed: int, limit: int | None = None) -> list[ChatRequest]:
    """The finance workload (ids dropped as its defaults say), cut to ``limit`` requests."""
    requests = generate(
        WorkloadConfig(
            sessions=profile.sessions,
            seed=seed,
            companies=4,
            min_turns=2,
            max_turns=profile.max_turns,
            max_tokens=8,
        )
    )
    return requests[:limit] if limit is not None else requests


def holdings(requests: Sequence[ChatRequest], pods: int) -> list[bytes]:
    """Each pod's filter: every other request's block keys, dealt round the pods.

    The keys are the picker's (the server's chat template, :mod:`dscache.keys`
    under :data:`STAND_IN_ROOT`), so half the requests find a pod holding them.
    """
    tokenizer = load_server_tokenizer()
    held: list[list[bytes]] = [[] for _ in range(pods)]
    for i, req in enumerate(requests[::2]):
        held[i % pods] += block_keys(STAND_IN_ROOT, prompt_ids(tokenizer, req), BLOCK_TOKENS)
    return [HoldingsFilter.of(keys, max(len(keys), 1) * 2).to_bytes() for keys in held]


def body(req: ChatRequest) -> bytes:
    """The request body a client sends for ``req`` (non-streamed)."""
    doc = {
        "model": "stand-in",
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": False,
    }
    return json.dumps(doc, ensure_ascii=False).encode()


def headers(req: ChatRequest) -> dict[str, str]:
    """Its headers: ``X-Session-ID`` only where the workload kept the id."""
    out = {"Content-Type": "application/json"}
    if req.session_id is not None:
        out["X-Session-ID"] = req.session_id
    return out


# -- the children -------------------------------------------------------------------------


def start_stand_ins(procs: ProcessGroup, work: Path, filters: Sequence[bytes]) -> list[StandInPod]:
    """Starts one stand-in pod per filter and waits until each serves."""
    pods = []
    for i, data in enumerate(filters):
        path = work / f"pod{i}.holdings"
        path.write_bytes(data)
        port = free_port()
        argv = [sys.executable, "-m", STAND_IN_MODULE, "--port", str(port)]
        argv += ["--root", STAND_IN_ROOT.hex()]
        child = procs.start(f"pod{i}", [*argv, "--holdings", str(path)], env=child_env())
        pods.append(StandInPod(port, child))
    for pod in pods:
        ready = functools.partial(http_ok, f"http://{pod.address}/dscache/keyinfo")
        pod.child.wait_ready(ready, timeout_s=60, what="serving")
    return pods


def start_picker(procs: ProcessGroup, pods: Sequence[StandInPod]) -> tuple[str, Child]:
    """Starts ``dscache picker`` knowing the stand-ins' filters; its ``host:port``."""
    port = free_port()
    args = ["picker", "--host", "127.0.0.1", "--port", str(port), "--refresh", "0.5"]
    for pod in pods:
        args += ["--holdings", f"{pod.address}={pod.holdings_url}"]
    argv = [sys.executable, "-m", "dscache.cli", "--log-level", "WARNING", *args]
    child = procs.start("picker", argv, env=child_env())
    url = f"http://127.0.0.1:{port}/health"
    child.wait_ready(lambda: http_ok(url), timeout_s=60, what="serving")
    return f"127.0.0.1:{port}", child


def start_router(
    procs: ProcessGroup, work: Path, name: str, pods: Sequence[StandInPod], picker: str | None
) -> str:
    """Starts NGINX with the rendered router config in front of ``pods``; its URL."""
    nginx = find_nginx()
    workdir = work / name
    workdir.mkdir()
    # NGINX run as root drops its workers to 'nobody'; they must reach the dir.
    for d in (work, workdir):
        d.chmod(0o755)
    port = free_port()
    cfg = RouterConfig(
        listen=f"127.0.0.1:{port}",
        stable=tuple(p.address for p in pods),
        prompt_key=PromptKey(mode="lua"),
        balance_factor=1.25,
        picker=picker,
        picker_timeout_ms=1000,
        load_modules=DEBIAN_LUA_MODULES,
        pid_file=str(workdir / "nginx.pid"),
        temp_dir=str(workdir),
        error_log=str(workdir / "error.log"),
    )
    conf = workdir / "nginx.conf"
    conf.write_text(render_nginx_conf(cfg))
    argv = [nginx, "-p", str(workdir), "-c", str(conf), "-e", "stderr", "-g", "daemon off;"]
    child = procs.start(f"nginx-{name}", argv, stop_signal=signal.SIGQUIT)
    url = f"http://127.0.0.1:{port}"
    child.wait_ready(lambda: http_ok(url + "/dscache/router/health"), timeout_s=30, what="serving")
    return url


# -- the metrics ----------------------------------------------------------------------------


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def router_picks(url: str) -> dict[str, float]:
    """The router's ``dscache_router_picks_total`` by reason (every reason, 0 if absent)."""
    out = dict.fromkeys(PICK_REASONS, 0.0)
    for name, labels, value in _samples(url + names.ROUTER_METRICS_PATH):
        if name == names.ROUTER_PICKS + "_total":
            out[labels.get("reason", "")] = value
    return out


def picker_filters(picker: str) -> float:
    """Pods whose holdings filter the picker has (0 while it cannot say)."""
    try:
        samples = _samples(f"http://{picker}/metrics")
    except httpx.HTTPError:
        return 0.0
    return next((value for name, _, value in samples if name == PICKER_FILTERS), 0.0)


def picker_decisions(picker: str) -> tuple[float, float]:
    """The picker's decision timer: (seconds summed, decisions)."""
    total = count = 0.0
    for name, _, value in _samples(f"http://{picker}/metrics"):
        if name == PICKER_DECISION_SECONDS + "_sum":
            total = value
        elif name == PICKER_DECISION_SECONDS + "_count":
            count = value
    return total, count


# -- the measurement ------------------------------------------------------------------------


def _no_cookies() -> CookieJar:
    # The router sets a cookie on an id-less request; a client keeping it would
    # turn the workload's id-less requests into cookie sessions.
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


async def run_pass(
    client: httpx.AsyncClient,
    routing: str,
    requests: Sequence[tuple[bytes, dict[str, str]]],
    concurrency: int,
) -> Pass:
    """Sends every request through ``client``'s router, ``concurrency`` at a time."""
    latencies: list[float] = []
    failed = 0
    todo = iter(requests)

    async def worker() -> None:
        nonlocal failed
        for content, hdrs in todo:
            started = time.perf_counter()
            try:
                resp = await client.post("/v1/chat/completions", content=content, headers=hdrs)
                ok = resp.status_code == 200 and bool(resp.json().get("choices"))
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("request through the %s router failed: %s", routing, exc)
                ok = False
            if ok:
                latencies.append(1000 * (time.perf_counter() - started))
            else:
                failed += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Pass(routing, concurrency, latencies, failed)


async def run_rounds(
    urls: dict[str, str], requests: Sequence[ChatRequest], rounds: int
) -> list[Pass]:
    """``rounds`` passes per router and concurrency, the routers' order alternating."""
    prepared = [(body(r), headers(r)) for r in requests]
    limits = httpx.Limits(max_connections=max(CONCURRENCIES))
    clients = {
        routing: httpx.AsyncClient(base_url=url, timeout=30.0, limits=limits, cookies=_no_cookies())
        for routing, url in urls.items()
    }
    passes: list[Pass] = []
    try:
        for i in range(rounds):
            order = ROUTINGS if i % 2 == 0 else ROUTINGS[::-1]
            for concurrency in CONCURRENCIES:
                for routing in order:
                    passes.append(await run_pass(clients[routing], routing, prepared, concurrency))
    finally:
        for client in clients.values():
            await client.aclose()
    return passes


def _diff(new: float | None, base: float | None) -> float | None:
    return new - base if new is not None and base is not None else None


def rows(passes: Sequence[Pass]) -> list[dict[str, Any]]:
    """Per concurrency: both routers' P50 / P99 (all rounds pooled), kv - hash, kv / hash."""
    out = []
    for concurrency in CONCURRENCIES:
        pct: dict[str, float | None] = {}
        for routing in ROUTINGS:
            pooled = [
                ms
                for p in passes
                if p.routing == routing and p.concurrency == concurrency
                for ms in p.latencies_ms
            ]
            pct[f"{routing}_p50_ms"] = percentile(pooled, 50)
            pct[f"{routing}_p99_ms"] = percentile(pooled, 99)
        out.append(
            {
                "concurrency": concurrency,
                **pct,
                "added_p50_ms": _diff(pct["kv_p50_ms"], pct["hash_p50_ms"]),
                "added_p99_ms": _diff(pct["kv_p99_ms"], pct["hash_p99_ms"]),
                "p50_ratio": ratio(pct["kv_p50_ms"], pct["hash_p50_ms"]),
                "p99_ratio": ratio(pct["kv_p99_ms"], pct["hash_p99_ms"]),
            }
        )
    return out


def run_bench(quick: bool, seed: int = 0, limit: int | None = None) -> Doc:
    """Starts the stand-ins, the picker and both routers, measures, returns the JSON doc.

    ``limit`` cuts the workload to its first requests (a shorter run for tests).
    """
    profile = QUICK if quick else FULL
    requests = workload(profile, seed, limit)
    filters = holdings(requests, pods=2)
    with (
        tempfile.TemporaryDirectory(prefix="dscache-bench-router-") as tmp,
        ProcessGroup(Path(tmp) / "logs") as procs,
    ):
        work = Path(tmp)
        pods = start_stand_ins(procs, work, filters)
        picker, picker_child = start_picker(procs, pods)
        picker_child.wait_ready(
            lambda: picker_filters(picker) >= len(pods),
            timeout_s=30,
            what="holding the stand-ins' filters",
        )
        urls = {
            "hash": start_router(procs, work, "hash", pods, None),
            "kv": start_router(procs, work, "kv", pods, picker),
        }
        asyncio.run(run_rounds(urls, requests[:8], 1))  # warm-up: connections, Lua code
        picks_before = router_picks(urls["kv"])
        seconds_before, count_before = picker_decisions(picker)
        print(
            f"{len(requests)} requests per pass, {profile.rounds} rounds of "
            f"{', '.join(ROUTINGS)} x concurrency {', '.join(map(str, CONCURRENCIES))} ...",
            flush=True,
        )
        passes = asyncio.run(run_rounds(urls, requests, profile.rounds))
        picks_after = router_picks(urls["kv"])
        seconds_after, count_after = picker_decisions(picker)
        picks = {r: round(picks_after[r] - picks_before.get(r, 0.0)) for r in picks_after}
        if picks["failed"]:
            # Why is in NGINX's log (a timeout, a refused or closed connection).
            lines = (work / "kv" / "error.log").read_text(errors="replace").splitlines()
            log.warning(
                "the picker gave no answer for %d requests; the kv router's log ends:\n%s",
                picks["failed"],
                "\n".join(lines[-20:]),
            )
        print("the endpoint picker face (ext_proc): time to the pick, routing quality ...")
        flags = ["--seed", str(seed), *(["--quick"] if quick else [])]
        flags += ["--requests", str(limit)] if limit is not None else []
        epp = run_epp(procs, work, start_stand_ins, flags)
    decisions = count_after - count_before
    print("holdings feeds: KV events and filters of one sidecar, side by side ...", flush=True)
    feeds = run_feeds(quick)
    return {
        "epp": epp,
        "feeds": feeds,
        "rows": rows(passes),
        "picker_decision_mean_ms": (
            1000 * (seconds_after - seconds_before) / decisions if decisions else None
        ),
        "picks": picks,
        "requests": sum(len(p.latencies_ms) + p.failed for p in passes),
        "failed": sum(p.failed for p in passes),
        "workload_requests": len(requests),
        "rounds": profile.rounds,
    }


# -- the report -----------------------------------------------------------------------------


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(doc: Doc) -> str:
    """The printed table: one row per concurrency, then the picker's figures."""
    lines = [
        f"{'conc':>4} {'hash P50':>9} {'hash P99':>9} {'kv P50':>9} {'kv P99':>9} "
        f"{'added P50':>10} {'added P99':>10} {'P50 x':>6} {'P99 x':>6}   (ms)"
    ]
    for r in doc["rows"]:
        lines.append(
            f"{r['concurrency']:>4} {_f(r['hash_p50_ms'], '.2f'):>9} "
            f"{_f(r['hash_p99_ms'], '.2f'):>9} {_f(r['kv_p50_ms'], '.2f'):>9} "
            f"{_f(r['kv_p99_ms'], '.2f'):>9} {_f(r['added_p50_ms'], '+.2f'):>10} "
            f"{_f(r['added_p99_ms'], '+.2f'):>10} {_f(r['p50_ratio'], '.2f'):>6} "
            f"{_f(r['p99_ratio'], '.2f'):>6}"
        )
    picks = ", ".join(f"{k} {v}" for k, v in doc["picks"].items())
    lines.append(
        f"picker decision (its own timer) mean {_f(doc['picker_decision_mean_ms'], '.2f')} ms; "
        f"kv router picks: {picks}"
    )
    lines.append(
        f"{doc['requests']} requests ({doc['workload_requests']} per pass, {doc['rounds']} "
        f"rounds), {doc['failed']} failed"
    )
    if "epp" in doc:
        lines.append(epp_table(doc["epp"]))
    if "feeds" in doc:
        lines.append(feeds_table(doc["feeds"]))
    return "\n".join(lines)


def write_png(doc: Doc, path: Path) -> None:
    """P50 and P99 of both routers per concurrency."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(doc["rows"]), figsize=(5 * len(doc["rows"]), 4))
    for ax, r in zip(axes, doc["rows"], strict=True):
        xs = [0, 1]
        for j, routing in enumerate(ROUTINGS):
            values = [r[f"{routing}_p50_ms"] or 0.0, r[f"{routing}_p99_ms"] or 0.0]
            ax.bar([x + 0.4 * j for x in xs], values, 0.4, label=routing)
        ax.set_xticks([x + 0.2 for x in xs], ["P50", "P99"])
        ax.set_ylabel("ms")
        ax.set_title(f"concurrency {r['concurrency']}")
        ax.legend()
    fig.suptitle("router latency with stand-in pods: hash vs KV-aware (picker)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench router``: the runs, the table, the JSON and PNG (1 on a failure)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        with terminate_on_sigterm():
            doc = run_bench(args.quick, args.seed, args.requests)
    except (StartError, RuntimeError) as exc:
        log.error("bench router failed: %s", exc)
        return 1
    print(table(doc))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")
    if args.png_out:
        write_png(doc, Path(args.png_out))
        print(f"wrote {args.png_out}")
    return 1 if doc["failed"] else 0


if __name__ == "__main__":  # the stand-in pod, started by start_stand_ins
    raise SystemExit(stand_in_main(sys.argv[1:]))
