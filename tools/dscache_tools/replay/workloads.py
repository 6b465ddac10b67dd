"""Built-in traces for ``dscache replay``: the finance workload and ShareGPT-style chats.

``--trace finance`` and ``--trace chat`` build a trace instead of reading one:

* ``finance``: the finance workload (:mod:`dscache_tools.workload`): sessions
  about listed companies, each opening with the company's shared filings.
* ``chat``: ShareGPT-style chats (:func:`dscache_tools.workload.chat.chat_workload`:
  a short system prompt, short turns, no shared documents), each conversation
  cut to a geometric number of turns (it goes on after a turn with probability
  0.65, mean about 2.9 turns, at most 12), as in public chat logs where most
  conversations are short and a few are long.

Contract:

* Every prompt goes through the model server's tokenizer and chat template and
  the cache-key contract (:mod:`dscache.keys`) with ``block_tokens``-token
  blocks, exactly as the server would key it; only full blocks are cached.
* Arrivals: ``poisson`` (default): sessions start as a Poisson process of
  ``rate`` sessions per second, and each turn follows the previous one after a
  think time drawn log-normally (median ``think_s``, sigma 1), so conversations
  interleave as they would on a served model; ``sequential``: sessions one after
  another, turns back to back (the issue-15 working-set setup). Seeded: the
  same arguments give the same trace.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from dscache_tools.replay.trace import Request, Trace, build_trace

#: Names ``--trace`` accepts instead of a file.
BUILTIN = ("finance", "chat")
ARRIVALS = ("poisson", "sequential")


@dataclass(frozen=True, slots=True)
class WorkloadTrace:
    """How to build a built-in trace."""

    name: str
    sessions: int = 0  # 0: the workload's default (finance 1,000, chat 4,000)
    block_tokens: int = 16
    arrivals: str = "poisson"
    rate: float = 0.5  # sessions per second
    think_s: float = 60.0
    seed: int = 0


def _chat_requests(sessions: int, seed: int) -> list[object]:
    from dscache_tools.workload.chat import chat_workload

    reqs = chat_workload(sessions, seed=seed, min_turns=12, max_turns=12)
    rng = random.Random(f"sharegpt/{seed}")
    keep: dict[str, int] = {}
    out: list[object] = []
    for r in reqs:
        if r.session not in keep:
            turns = 1
            while turns < 12 and rng.random() < 0.65:
                turns += 1
            keep[r.session] = turns
        if r.turn < keep[r.session]:
            out.append(r)
    return out


def _finance_requests(sessions: int, seed: int) -> list[object]:
    from dscache_tools.workload import WorkloadConfig, generate

    return list(generate(WorkloadConfig(sessions=sessions, seed=seed)))


def build(spec: WorkloadTrace) -> Trace:
    """Generates, tokenizes and keys the workload; returns it as a trace.

    Raises:
        ValueError: on an unknown name or arrival model, or a bad number.
        RuntimeError: when the model server's tokenizer is not installed.
    """
    if spec.name not in BUILTIN:
        raise ValueError(f"unknown built-in trace {spec.name!r}; known: {', '.join(BUILTIN)}")
    if spec.arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrivals {spec.arrivals!r}; known: {', '.join(ARRIVALS)}")
    if spec.sessions < 0 or spec.block_tokens < 1 or spec.rate <= 0 or spec.think_s <= 0:
        raise ValueError("sessions >= 0, block tokens >= 1, rate and think time > 0 needed")
    from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint
    from dscache_tools.workload import load_server_tokenizer
    from dscache_tools.workload.ideal import prompt_ids
    from dscache_tools.workload.model import ChatRequest

    if spec.name == "finance":
        reqs = _finance_requests(spec.sessions or 1000, spec.seed)
    else:
        reqs = _chat_requests(spec.sessions or 4000, spec.seed)
    tokenizer = load_server_tokenizer()
    layout = KVLayout(
        LayoutKind.GQA, num_layers=1, dtype="float32", num_kv_heads=1, head_dim=1, v_head_dim=1
    )
    chain = KeyChain(ModelFingerprint("replay", "0", layout, block_tokens=spec.block_tokens), b"")
    sessions: dict[str, list[tuple[list[bytes], int]]] = {}
    for r in reqs:
        assert isinstance(r, ChatRequest)
        ids = prompt_ids(tokenizer, r)
        sessions.setdefault(r.session, []).append((chain.keys(ids), len(ids)))
    timed = _arrivals(list(sessions.values()), spec)
    intern: dict[bytes, int] = {}
    out = [
        Request(
            [intern.setdefault(k, len(intern)) for k in keys],
            spec.block_tokens,
            spec.block_tokens,
            tokens,
            t,
        )
        for t, keys, tokens in timed
        if keys
    ]
    label = (
        f"{spec.name} ({len(sessions)} sessions, {spec.block_tokens}-token blocks, {spec.arrivals})"
    )
    return build_trace(label, out)


def _arrivals(
    sessions: list[list[tuple[list[bytes], int]]], spec: WorkloadTrace
) -> list[tuple[float, list[bytes], int]]:
    """Each turn with its arrival time, in time order."""
    if spec.arrivals == "sequential":
        flat = [turn for s in sessions for turn in s]
        return [(float(i), keys, tokens) for i, (keys, tokens) in enumerate(flat)]
    rng = random.Random(f"arrivals/{spec.seed}")
    mu = math.log(spec.think_s)
    heap: list[tuple[float, int, int]] = []  # (time, session, turn)
    start = 0.0
    for s in range(len(sessions)):
        start += rng.expovariate(spec.rate)
        heap.append((start, s, 0))
    heapq.heapify(heap)
    out: list[tuple[float, list[bytes], int]] = []
    while heap:
        t, s, turn = heapq.heappop(heap)
        keys, tokens = sessions[s][turn]
        out.append((t, keys, tokens))
        if turn + 1 < len(sessions[s]):
            heapq.heappush(heap, (t + rng.lognormvariate(mu, 1.0), s, turn + 1))
    return out
