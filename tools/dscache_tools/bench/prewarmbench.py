"""``dscache bench prewarm``: a canary's first requests after each prewarm placement.

The canary of a rollout is a track of several pods behind the router. Each mode
starts that track (real model servers, each with its own fresh sidecar, and
NGINX in front: :class:`~dscache_tools.demo.stack.LocalStack`), prewarms it
with the finance workload's user list (each company's system prompt and
document) through ``dscache prewarm``'s own placement, waits for the stores to
land, and replays new sessions through the router, as the canary's first step
receives them (the gateway drops the session id of ``--drop-id-share`` of the
requests; ``--concurrency`` sessions at a time, 1 by default: a first step takes
a tenth of the sessions, a trickle per pod):

* ``none``: no prewarm;
* ``all``: every prompt to every pod (``placement: all``, the old default);
* ``ring``: each prompt to the one pod the router's consistent hash tries first
  for it (``placement: ring``, one copy: what the operator warms before 10%);
* ``ring_kv``: the same prewarm, with the picker deciding (KV-aware routing):
  a new session starting with a warmed document goes to the pod holding it.

JSON: ``modes`` (a list: ``name``, ``placement``, ``routing``, ``prewarm_requests``,
``prewarm_s``, ``token_hit_ratio``, ``ideal_token_hit_ratio``, ``ttft_p50_s``,
``ttft_p99_s``, ``requests``, ``errors``), ``ratios`` (``prewarm_requests_ring_vs_all``,
``prewarm_s_ring_vs_all``, ``token_hit_ring_vs_all``, ``token_hit_ring_kv_vs_all``,
``token_hit_all_vs_none``) and ``workload``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dscache_tools.bench import Doc, ratio, report
from dscache_tools.bench.sharedtier import settle
from dscache_tools.demo.stack import LocalStack, StackOptions
from dscache_tools.loadgen.replay import LoadConfig, run_load
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    ideal_hit_ratio,
    load_server_tokenizer,
    prewarm_requests,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """How big a run is: pods of the canary, companies, sessions, requests measured."""

    pods: int
    companies: int
    sessions: int
    requests: int


#: Seconds until a block stored now shows in the picker's copy of its pod's filter.
HOLDINGS_VISIBLE_S = 4.0

QUICK = Profile(pods=2, companies=4, sessions=8, requests=12)
FULL = Profile(pods=3, companies=12, sessions=40, requests=60)


@dataclass(frozen=True)
class Mode:
    """One run: where the prewarm sends its prompts and how the router decides."""

    name: str
    placement: Literal["none", "all", "ring"]
    routing: Literal["hash", "kv"]


MODES = (
    Mode("none", "none", "hash"),
    Mode("all", "all", "hash"),
    Mode("ring", "ring", "hash"),
    Mode("ring_kv", "ring", "kv"),
)


def traffic(prof: Profile, seed: int, drop_id_share: float) -> list[ChatRequest]:
    """The new sessions the canary receives, in arrival order (first turns first)."""
    requests = generate(
        WorkloadConfig(
            sessions=prof.sessions,
            seed=seed,
            companies=prof.companies,
            min_turns=1,
            max_turns=3,
            drop_id_share=drop_id_share,
            max_tokens=2,  # the prompt is what is measured; keep decoding short
        )
    )
    return requests[: prof.requests]


def _run_mode(
    work: Path, mode: Mode, prof: Profile, args: argparse.Namespace, reqs: list[ChatRequest]
) -> Doc:
    from dscache_server.prewarm import PlacementOptions, PrewarmOptions, place, send_placed

    opts = PrewarmOptions(concurrency=1)
    prompts = [opts.chat(r.messages) for r in prewarm_requests(reqs)]
    with LocalStack(work / mode.name, StackOptions(model=args.model)) as stack:
        servers = stack.start_servers(prof.pods, cache=True, prefix=mode.name)
        router = stack.start_router(servers, routing=mode.routing)
        t0 = time.perf_counter()
        sent = 0
        if mode.placement != "none":
            placed = place(prompts, [s.url for s in servers], PlacementOptions(mode.placement))
            results = send_placed(placed, opts, progress=False)
            sent = sum(r.sent for r in results.values())
            if any(r.failed for r in results.values()):
                raise RuntimeError(f"{mode.name}: prewarm prompts failed")
            settle(stack)
        prewarm_s = time.perf_counter() - t0
        if mode.routing == "kv":
            # The sidecars rebuild their holdings filters every 2 s and the picker
            # fetches them every second: what was just stored is visible after both.
            time.sleep(HOLDINGS_VISIBLE_S)
        cfg = LoadConfig(
            target=router.url,
            concurrency=args.concurrency,
            metrics_urls=tuple(s.url + "/metrics" for s in servers),
            progress=False,
        )
        rep = asyncio.run(run_load(cfg, reqs))
    return {
        "name": mode.name,
        "placement": mode.placement,
        "routing": mode.routing,
        "prewarm_requests": sent,
        "prewarm_s": prewarm_s,
        "requests": rep.requests,
        "errors": rep.errors,
        "token_hit_ratio": rep.token_hit_ratio,
        "ttft_p50_s": rep.ttft_p50_s,
        "ttft_p99_s": rep.ttft_p99_s,
    }


def run_bench(args: argparse.Namespace) -> Doc:
    """Every mode on the same traffic, and the ratios."""
    prof = QUICK if args.quick else FULL
    reqs = traffic(prof, args.seed, args.drop_id_share)
    warm = prewarm_requests(reqs)
    ideal = ideal_hit_ratio(reqs, load_server_tokenizer(), warm=warm).token_hit_ratio
    doc: Doc = {
        "model": args.model,
        "profile": "quick" if args.quick else "full",
        "workload": {
            "seed": args.seed,
            "pods": prof.pods,
            "companies": prof.companies,
            "prewarm_prompts": len(warm),
            "requests": len(reqs),
            "drop_id_share": args.drop_id_share,
            "concurrency": args.concurrency,
        },
        "modes": [],
    }
    with tempfile.TemporaryDirectory(prefix="dscache-bench-prewarm-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        for mode in MODES:
            log.info("bench prewarm: %s", mode.name)
            row = _run_mode(work, mode, prof, args, reqs)
            row["ideal_token_hit_ratio"] = ideal if mode.placement != "none" else None
            doc["modes"].append(row)
    m: dict[str, Any] = {row["name"]: row for row in doc["modes"]}
    failed = sum(int(v["errors"]) for v in m.values())
    if failed:
        raise RuntimeError(f"{failed} requests failed; see the servers' logs")
    hit = {k: v["token_hit_ratio"] for k, v in m.items()}
    doc["ratios"] = {
        "prewarm_requests_ring_vs_all": ratio(
            m["ring"]["prewarm_requests"], m["all"]["prewarm_requests"]
        ),
        "prewarm_s_ring_vs_all": ratio(m["ring"]["prewarm_s"], m["all"]["prewarm_s"]),
        "token_hit_ring_vs_all": ratio(hit["ring"], hit["all"]),
        "token_hit_ring_kv_vs_all": ratio(hit["ring_kv"], hit["all"]),
        "token_hit_all_vs_none": ratio(hit["all"], hit["none"]),
    }
    return doc


def table(doc: Doc) -> str:
    """The human-readable summary."""
    w = doc["workload"]
    lines = [
        f"finance workload on a {w['pods']}-pod canary: its first {w['requests']} requests "
        f"({100 * w['drop_id_share']:.0f}% without a session id, {w['concurrency']} at a time), "
        f"{w['prewarm_prompts']} prewarm prompts",
        f"{'mode':<9}{'routing':>8}{'prewarm':>9}{'prewarm s':>11}{'hit ratio':>11}"
        f"{'TTFT P50':>11}{'TTFT P99':>11}",
    ]
    for r in doc["modes"]:
        lines.append(
            f"{r['name']:<9}{r['routing']:>8}{r['prewarm_requests']:>9}{r['prewarm_s']:>10.1f}s"
            f"{r['token_hit_ratio'] or 0:>11.3f}"
            f"{r['ttft_p50_s'] or 0:>10.3f}s{r['ttft_p99_s'] or 0:>10.3f}s"
        )
    for key, value in doc["ratios"].items():
        lines.append(f"{key:<30}{'n/a' if value is None else f'{value:.2f}x'}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench prewarm``: the runs, the table, the JSON (1 if any failed)."""
    with terminate_on_sigterm():
        return report("prewarm", lambda: run_bench(args), table, args.json_out, (RuntimeError,))
