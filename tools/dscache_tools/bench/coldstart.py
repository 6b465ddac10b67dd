"""``dscache bench coldstart``: a new pod's first requests, prewarmed three ways.

One finance workload (:func:`dscache_tools.workload.generate`) is cut in two at a
session boundary: the earlier sessions are the history a prompt log would have
captured, the later ones are the new traffic a freshly started pod receives. Each
mode starts one real model server with its own fresh sidecar
(:class:`~dscache_tools.demo.stack.LocalStack`), prewarms it through the chat API
with ``dscache prewarm``'s own client, waits for the stores to land, then sends
the first requests of the new traffic, one at a time:

* ``none``: no prewarm (the cache fills as the traffic arrives);
* ``user_list``: the prompts a user would list, the system prompt and document of
  every company (:func:`dscache_tools.workload.prewarm_requests`);
* ``mined``: the templates ``dscache templates mine`` finds in the history.

The two samples share the seed on purpose: the workload's seed also draws the
company dossiers, so another seed would be another set of documents rather than a
later day of the same service. They share no session.

JSON: ``modes`` (a list: ``name``, ``token_hit_ratio`` from the server's
``/metrics`` counters over the measured requests, ``ttft_p50_s``, ``ttft_p99_s``,
``prewarm_prompts``, ``prewarm_s``, ``requests``, ``errors``,
``ideal_token_hit_ratio`` of an infinite cache warmed the same way), ``ratios``
(``token_hit_mined_vs_none``, ``token_hit_user_list_vs_none``,
``token_hit_mined_vs_user_list``, ``ttft_p50_mined_vs_none``,
``ttft_p50_user_list_vs_none``) and ``workload`` (samples, companies, requests,
prompt tokens, the mined templates and their coverage of the history).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dscache_tools.bench import Doc, ratio, report
from dscache_tools.bench.sharedtier import settle
from dscache_tools.demo.stack import LocalStack, StackOptions
from dscache_tools.loadgen.replay import LoadConfig, run_load
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.templates import Chat, MineOptions, mine
from dscache_tools.workload import (
    ChatRequest,
    ChatTokenizer,
    WorkloadConfig,
    generate,
    ideal_hit_ratio,
    load_server_tokenizer,
    prewarm_requests,
    sessions_of,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """How big a run is.

    Attributes:
        companies: companies of the workload (the first N).
        history_sessions: sessions mined for templates.
        new_sessions: sessions of new traffic generated after them.
        requests: new requests measured (the pod's first ones).
        min_turns: fewest turns per session.
        max_turns: most turns per session.
        top: templates kept.
    """

    companies: int
    history_sessions: int
    new_sessions: int
    requests: int
    min_turns: int
    max_turns: int
    top: int = 100


QUICK = Profile(
    companies=2, history_sessions=8, new_sessions=6, requests=8, min_turns=1, max_turns=2
)
FULL = Profile(
    companies=12, history_sessions=40, new_sessions=30, requests=60, min_turns=1, max_turns=4
)

MODES = ("none", "user_list", "mined")


def samples(prof: Profile, seed: int) -> tuple[list[ChatRequest], list[ChatRequest]]:
    """(history, new traffic): one workload cut at a session boundary."""
    requests = generate(
        WorkloadConfig(
            sessions=prof.history_sessions + prof.new_sessions,
            seed=seed,
            companies=prof.companies,
            min_turns=prof.min_turns,
            max_turns=prof.max_turns,
            max_tokens=2,  # the prompt is what is measured; keep decoding short
        )
    )
    sessions = list(sessions_of(requests).values())
    history = [r for turns in sessions[: prof.history_sessions] for r in turns]
    new = [r for turns in sessions[prof.history_sessions :] for r in turns]
    return history, new[: prof.requests]


def _as_requests(chats: list[list[dict[str, str]]]) -> list[ChatRequest]:
    return [
        ChatRequest(f"prewarm-{n}", 0, "", "", None, False, messages=m, max_tokens=1)
        for n, m in enumerate(chats)
    ]


def _run_mode(
    work: Path,
    name: str,
    *,
    model: str,
    prewarm_chats: list[list[dict[str, str]]],
    traffic: list[ChatRequest],
    tokenizer: ChatTokenizer,
) -> dict[str, Any]:
    from dscache_server.prewarm import PrewarmOptions, prewarm

    ideal = ideal_hit_ratio(traffic, tokenizer, warm=_as_requests(prewarm_chats))
    with LocalStack(work / name, StackOptions(model=model)) as stack:
        (server,) = stack.start_servers(1, cache=True, prefix=name)
        t0 = time.perf_counter()
        if prewarm_chats:
            warmed = prewarm(server.url, prewarm_chats, PrewarmOptions(), progress=False)
            if warmed.failed:
                raise RuntimeError(f"{name}: {warmed.failed} prewarm prompts failed")
            settle(stack)
        prewarm_s = time.perf_counter() - t0
        cfg = LoadConfig(
            target=server.url,
            concurrency=1,  # a cold pod's first requests, in order
            metrics_urls=(server.url + "/metrics",),
            progress=False,
        )
        rep = asyncio.run(run_load(cfg, traffic))
    return {
        "name": name,
        "requests": rep.requests,
        "errors": rep.errors,
        "prompt_tokens": rep.prompt_tokens,
        "token_hit_ratio": rep.token_hit_ratio,
        "client_token_hit_ratio": rep.client_token_hit_ratio,
        "ideal_token_hit_ratio": ideal.token_hit_ratio,
        "ttft_p50_s": rep.ttft_p50_s,
        "ttft_p99_s": rep.ttft_p99_s,
        "prewarm_prompts": len(prewarm_chats),
        "prewarm_s": prewarm_s,
    }


def run_bench(args: argparse.Namespace) -> Doc:
    """The three runs and their ratios."""
    prof = QUICK if args.quick else FULL
    history, traffic = samples(prof, args.seed)
    tok = load_server_tokenizer()
    mined = mine([Chat(r.messages, r.session) for r in history], tok, MineOptions(top=prof.top))
    prewarms = {
        "none": [],
        "user_list": [r.messages for r in prewarm_requests([*history, *traffic])],
        "mined": [t.messages for t in mined.templates],
    }
    doc: Doc = {
        "model": args.model,
        "profile": "quick" if args.quick else "full",
        "workload": {
            "seed": args.seed,
            "companies": prof.companies,
            "history_sessions": prof.history_sessions,
            "history_requests": len(history),
            "requests": len(traffic),
            "companies_in_requests": len({r.company for r in traffic}),
            "templates": len(mined.templates),
            "template_coverage_of_history": mined.coverage,
        },
        "modes": [],
    }
    with tempfile.TemporaryDirectory(prefix="dscache-bench-coldstart-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        for name in MODES:
            log.info("bench coldstart: %s (%d prewarm prompts)", name, len(prewarms[name]))
            doc["modes"].append(
                _run_mode(
                    work,
                    name,
                    model=args.model,
                    prewarm_chats=prewarms[name],
                    traffic=traffic,
                    tokenizer=tok,
                )
            )
    m = {mode["name"]: mode for mode in doc["modes"]}
    failed = sum(int(v["errors"]) for v in m.values())
    if failed:
        raise RuntimeError(f"{failed} requests failed; see the servers' logs")
    hit = {k: v["token_hit_ratio"] for k, v in m.items()}
    ttft = {k: v["ttft_p50_s"] for k, v in m.items()}
    doc["ratios"] = {
        "token_hit_mined_vs_none": ratio(hit["mined"], hit["none"]),
        "token_hit_user_list_vs_none": ratio(hit["user_list"], hit["none"]),
        "token_hit_mined_vs_user_list": ratio(hit["mined"], hit["user_list"]),
        "ttft_p50_mined_vs_none": ratio(ttft["mined"], ttft["none"]),
        "ttft_p50_user_list_vs_none": ratio(ttft["user_list"], ttft["none"]),
    }
    return doc


def table(doc: Doc) -> str:
    """The human-readable summary."""
    w = doc["workload"]
    lines = [
        f"finance workload: a cold pod's first {w['requests']} requests "
        f"({w['companies_in_requests']} companies); {w['templates']} templates mined from "
        f"{w['history_requests']} earlier requests "
        f"(coverage {w['template_coverage_of_history']:.3f})",
        f"{'mode':<10}{'prewarm':>8}{'prewarm s':>11}{'hit ratio':>11}{'ideal':>8}"
        f"{'TTFT P50':>11}{'TTFT P99':>11}",
    ]
    for r in doc["modes"]:
        lines.append(
            f"{r['name']:<10}{r['prewarm_prompts']:>8}{r['prewarm_s']:>10.1f}s"
            f"{r['token_hit_ratio'] or 0:>11.3f}{r['ideal_token_hit_ratio']:>8.3f}"
            f"{r['ttft_p50_s'] or 0:>10.3f}s{r['ttft_p99_s'] or 0:>10.3f}s"
        )
    for key, value in doc["ratios"].items():
        lines.append(f"{key:<30}{'n/a' if value is None else f'{value:.2f}x'}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench coldstart``: the runs, the table, the JSON (1 if any failed)."""
    with terminate_on_sigterm():
        return report("coldstart", lambda: run_bench(args), table, args.json_out, (RuntimeError,))
