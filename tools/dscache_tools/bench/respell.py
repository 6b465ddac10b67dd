"""``dscache bench respell``: a restarted model server continuing conversations whose
answers were stored under the ids a model generated, with and without following
the stored tokenization.

A model's generated ids are not always what encoding its answer's text gives. The
server that gave an answer remembers its ids; a restarted one (or another pod on
the node's store) has only the text. Two arms, each a fresh real model server and
sidecar (:class:`LocalStack`), the same conversations:

1. Store: every turn of each conversation is sent as token ids (``/v1/completions``,
   one token): the history with its answers in the ids "the model generated",
   where a share of the answers (``--resplit-share``) have a stretch that is not
   what encoding their text gives (one character per token). The server stores
   their KV, as it does after answering.
2. The server is killed and started again (its sidecar and store stay).
3. Each conversation's next turn arrives as a chat (the answers as text): the
   cached share of its prompt and its TTFT.
4. One more turn of each, answered by the restarted server itself: the usual case,
   where following costs only a lookup (the tokenize phase of the server's timing).

Arms: ``respell`` (the default) and ``encode`` (``--no-respell``: the text encoded
anew only). JSON: ``workload``, ``arms`` (per arm: ``token_hit_ratio``,
``cached_tokens``, ``prompt_tokens``, ``ttft_p50_s``, ``ttft_p99_s``,
``tokenize_p50_s`` of step 3 and ``usual_tokenize_p50_s`` of step 4) and
``ratios`` (``hit_ratio_respell_vs_encode``, ``ttft_p50_respell_vs_encode``,
``usual_tokenize_p50_respell_vs_encode``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from dscache_tools.bench import Doc, ratio, report
from dscache_tools.demo.stack import LocalStack, Server, StackOptions
from dscache_tools.procs import StartError, terminate_on_sigterm

log = logging.getLogger(__name__)

_WORDS = ("market", "risk", "bond", "yield", "equity", "credit", "rate", "fund", "asset")


@dataclass(frozen=True)
class Profile:
    """How big a run is."""

    conversations: int
    turns: int


QUICK = Profile(conversations=4, turns=3)
FULL = Profile(conversations=12, turns=4)


@dataclass
class Conversation:
    """One conversation: its messages as text and its stored ids (answers as generated)."""

    messages: list[dict[str, str]]
    ids: list[int]
    resplit: int = 0  # answers stored under another tokenization


def _text(rng: np.random.Generator, tokenizer: Any, tokens: int) -> str:
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(f"{rng.choice(_WORDS)}{int(rng.integers(0, 1000))}" for _ in range(16))
        text += ". "
    return text


def spelled_apart(tokenizer: Any, ids: Sequence[int], start: int, end: int) -> list[int]:
    """``ids`` with the tokens in ``[start, end)`` spelled one character at a time:
    the same text, tokenized as no encoder would (as a model may generate it)."""
    chars = [ch for t in ids[start:end] for ch in tokenizer.decode([t])]
    apart = [c for ch in chars for c in tokenizer.encode(ch)]
    return [*ids[:start], *apart, *ids[end:]]


def conversations(prof: Profile, share: float, seed: int, tokenizer: Any) -> list[Conversation]:
    """The workload: a long system prompt each, then ``prof.turns`` exchanges."""
    from dscache_server.tokenizer import ChatMessage

    rng = np.random.default_rng(seed)
    out: list[Conversation] = []
    for _ in range(prof.conversations):
        messages = [
            {"role": "system", "content": _text(rng, tokenizer, 300)},
            {"role": "user", "content": _text(rng, tokenizer, 100)},
        ]
        chat = [ChatMessage(m["role"], m["content"]) for m in messages]
        conv = Conversation(messages, tokenizer.apply_chat_template(chat))
        for _turn in range(prof.turns):
            answer = _text(rng, tokenizer, 200)
            ids = tokenizer.encode(answer)
            if rng.random() < share:
                ids = spelled_apart(tokenizer, ids, 20, 60)
                conv.resplit += 1
            conv.ids += [*ids, tokenizer.eos_id]
            question = _text(rng, tokenizer, 100)
            conv.messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
            conv.ids += [tokenizer.user_id, *tokenizer.encode(question), tokenizer.assistant_id]
        out.append(conv)
    return out


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    resp = client.post(url, json=body)
    elapsed = time.perf_counter() - t0
    resp.raise_for_status()
    return resp.json(), elapsed


def _store_history(client: httpx.Client, server: Server, conv: Conversation, eos: int) -> None:
    """Each turn's prompt with its answer as generated, as token ids: the server
    stores their blocks as it would after answering."""
    ends = [i + 1 for i, t in enumerate(conv.ids) if t == eos]
    for end in ends:
        _post(
            client,
            server.url + "/v1/completions",
            {"model": "", "prompt": conv.ids[:end], "max_tokens": 1},
        )


def _run_arm(
    work: Path,
    name: str,
    *,
    model: str,
    flags: tuple[str, ...],
    convs: list[Conversation],
    eos: int,
) -> dict[str, Any]:
    opts = StackOptions(model=model, server_args=flags)
    with LocalStack(work / name, opts) as stack, httpx.Client(timeout=300) as client:
        (server,) = stack.start_servers(1, cache=True, prefix=name)
        for conv in convs:
            _store_history(client, server, conv, eos)
        stack.kill_server(server)
        time.sleep(1.0)
        server = stack.restart_server(server)
        cached = prompt = 0
        ttfts: list[float] = []
        tokenize: list[float] = []
        usual: list[float] = []
        answers: list[str] = []
        for conv in convs:
            body = {"model": "", "messages": conv.messages, "max_tokens": 16, "temperature": 0}
            doc, elapsed = _post(client, server.url + "/v1/chat/completions", body)
            usage = doc["usage"]
            prompt += int(usage["prompt_tokens"])
            cached += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            ttfts.append(float(doc.get("timings", {}).get("ttft", elapsed)))
            tokenize.append(float(doc.get("timings", {}).get("tokenize", 0.0)))
            answers.append(doc["choices"][0]["message"]["content"] or "")
        for conv, answer in zip(convs, answers, strict=True):
            messages = [
                *conv.messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "and then?"},
            ]
            body = {"model": "", "messages": messages, "max_tokens": 1}
            doc, _ = _post(client, server.url + "/v1/chat/completions", body)
            usual.append(float(doc.get("timings", {}).get("tokenize", 0.0)))
    ttfts.sort()
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_ratio": cached / prompt if prompt else None,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tokenize_p50_s": statistics.median(tokenize),
        "usual_tokenize_p50_s": statistics.median(usual),
    }


ARMS: tuple[tuple[str, tuple[str, ...]], ...] = (("encode", ("--no-respell",)), ("respell", ()))


def run_bench(args: argparse.Namespace) -> Doc:
    """The two arms and their ratios."""
    from dscache_server.tokenizer import DeepSeekTokenizer

    tokenizer = DeepSeekTokenizer()
    prof = QUICK if args.quick else FULL
    convs = conversations(prof, args.resplit_share, args.seed, tokenizer)
    doc: Doc = {
        "model": args.model,
        "profile": "quick" if args.quick else "full",
        "workload": {
            "conversations": len(convs),
            "turns_stored": prof.turns,
            "answers_resplit": sum(c.resplit for c in convs),
            "answers": prof.turns * len(convs),
            "resplit_share": args.resplit_share,
        },
        "arms": {},
    }
    with tempfile.TemporaryDirectory(prefix="dscache-bench-respell-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        for name, flags in ARMS:
            log.info("bench respell: %s", name)
            doc["arms"][name] = _run_arm(
                work, name, model=args.model, flags=flags, convs=convs, eos=tokenizer.eos_id
            )
    a = doc["arms"]
    doc["ratios"] = {
        "hit_ratio_respell_vs_encode": ratio(
            a["respell"]["token_hit_ratio"], a["encode"]["token_hit_ratio"]
        ),
        "ttft_p50_respell_vs_encode": ratio(a["respell"]["ttft_p50_s"], a["encode"]["ttft_p50_s"]),
        "usual_tokenize_p50_respell_vs_encode": ratio(
            a["respell"]["usual_tokenize_p50_s"], a["encode"]["usual_tokenize_p50_s"]
        ),
    }
    return doc


def table(doc: Doc) -> str:
    """The human-readable summary."""
    w = doc["workload"]
    lines = [
        f"{w['conversations']} conversations, {w['answers_resplit']} of {w['answers']} stored "
        "answers under another tokenization; next turn after a server restart:",
        f"{'arm':<9}{'hit ratio':>10}{'cached':>9}{'prompt':>9}{'TTFT P50':>10}{'TTFT P99':>10}"
        f"{'tokenize':>10}{'usual tok.':>11}",
    ]
    for name, r in doc["arms"].items():
        lines.append(
            f"{name:<9}{r['token_hit_ratio'] or 0:>10.3f}{r['cached_tokens']:>9}"
            f"{r['prompt_tokens']:>9}{r['ttft_p50_s']:>9.3f}s{r['ttft_p99_s']:>9.3f}s"
            f"{r['tokenize_p50_s'] * 1e3:>8.2f}ms{r['usual_tokenize_p50_s'] * 1e3:>9.2f}ms"
        )
    for key, value in doc["ratios"].items():
        lines.append(f"{key:<38}{'n/a' if value is None else f'{value:.2f}x'}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench respell``: the arms, the table, the JSON (1 if a run failed)."""
    with terminate_on_sigterm():
        failures = (RuntimeError, StartError, httpx.HTTPError)
        return report("respell", lambda: run_bench(args), table, args.json_out, failures)
