"""``dscache replay``: replays a request trace against the eviction policies.

Contract:

* Input: a JSONL trace, one request per line, in either format (detected per
  line; blank lines are skipped):

  - Mooncake: ``{"timestamp", "input_length", "output_length", "hash_ids"}``,
    512-token blocks, ``len(hash_ids) == ceil(input_length / 512)``; every
    block holds 512 tokens except the last, which holds
    ``input_length - 512 * (len(hash_ids) - 1)``.
  - dscache request log: ``{"block_keys": [hex, ...], "prompt_tokens": int,
    "block_tokens": int}``; every key is a full block; tokens past the last
    full block count in the denominator only (they are never cached).

  Keys are chained ids (a key names its whole prefix), so a block's parent is
  the block before it in any request that holds it.
* Prefix semantics: a block hits only if every earlier block of the request
  hit (a lookup returns the number of *leading* blocks present). The token hit
  ratio is hit tokens over prompt tokens, the block hit ratio hit blocks over
  blocks.
* The simulated store follows the callers' protocol documented in
  :mod:`dscache_sidecar.eviction`: after the lookup, the blocks after the
  first miss are computed and stored, and the request's chain is walked once,
  deepest first, admitting new blocks and accessing hit ones; then the store
  evicts (``victim``) until it is back within its capacity, so the request's
  own blocks are the freshest while it is served (the daemon's leases play
  that part). Evicting a block cascades to its cached descendants, so the
  cache always holds whole prefixes (a cached block's parent is cached). A
  request longer than the capacity stores only its first ``capacity`` blocks.
* Bounds at the same capacity: the infinite-cache *ideal* (a block hits if its
  whole prefix was seen before) and the offline-optimal *Belady* bound: on
  every insertion, the block whose next use is furthest in the future goes,
  the incoming block included (then it is not stored); ties go to the deeper
  block. A child is never used before its parent, so Belady keeps whole
  prefixes by itself and is optimal for the block hit ratio; it is the
  reference for the token ratio too (exact when blocks are full).
* Exit codes: 0 on success, 2 on bad arguments or an unreadable trace (a
  message naming the file and line, no traceback).
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dscache_sidecar.eviction import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy

logger = logging.getLogger(__name__)

#: Tokens per block in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512

#: Progress callback: called with the number of requests just replayed.
Tick = Callable[[int], None]


class TraceError(ValueError):
    """The trace cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its chained block ids and how many tokens each block holds.

    Attributes:
        blocks: interned block ids, root first.
        block_tokens: tokens in every block but the last.
        last_tokens: tokens in the last block (``block_tokens`` if it is full).
        prompt_tokens: all input tokens of the request (the ratio's denominator).
    """

    blocks: list[int]
    block_tokens: int
    last_tokens: int
    prompt_tokens: int

    def prefix_tokens(self, n_blocks: int) -> int:
        """Tokens in the first ``n_blocks`` blocks."""
        if n_blocks <= 0:
            return 0
        if n_blocks >= len(self.blocks):
            return (len(self.blocks) - 1) * self.block_tokens + self.last_tokens
        return n_blocks * self.block_tokens


@dataclass
class Trace:
    """A parsed trace plus the structure the simulators need.

    Attributes:
        path: where it came from (for reports).
        requests: the requests in order.
        children: block id -> ids of the blocks that follow it in some request.
    """

    path: str
    requests: list[Request]
    children: dict[int, list[int]] = field(default_factory=dict)
    _next_use: list[list[int]] | None = field(default=None, repr=False)

    @property
    def total_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def total_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    def next_use(self) -> list[list[int]]:
        """For each request and block position, the index of the next request using
        that block (``len(requests)`` if none)."""
        if self._next_use is None:
            never = len(self.requests)
            last: dict[int, int] = {}
            out: list[list[int]] = [[] for _ in self.requests]
            for t in range(len(self.requests) - 1, -1, -1):
                blocks = self.requests[t].blocks
                row = [last.get(b, never) for b in blocks]
                for b in blocks:
                    last[b] = t
                out[t] = row
            self._next_use = out
        return self._next_use


def build_trace(path: str, requests: list[Request]) -> Trace:
    """Wraps parsed requests with their parent -> children map."""
    children: dict[int, list[int]] = {}
    edges: set[tuple[int, int]] = set()
    for req in requests:
        blocks = req.blocks
        for i in range(1, len(blocks)):
            edge = (blocks[i - 1], blocks[i])
            if edge not in edges:
                edges.add(edge)
                children.setdefault(edge[0], []).append(edge[1])
    return Trace(path=path, requests=requests, children=children)


def parse_trace(lines: Iterable[str], source: str) -> list[Request]:
    """Parses JSONL trace lines (either format) into requests.

    Raises:
        TraceError: on a line that is not JSON or not a request of a known shape.
    """
    intern: dict[object, int] = {}
    requests: list[Request] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if "hash_ids" in obj:
            requests.append(_mooncake_request(obj, intern, where))
        elif "block_keys" in obj:
            requests.append(_dscache_request(obj, intern, where))
        else:
            raise TraceError(
                f"{where}: neither a Mooncake record (hash_ids) nor a dscache "
                "request log record (block_keys)"
            )
    return requests


def _int_field(obj: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _mooncake_request(obj: dict[str, Any], intern: dict[object, int], where: str) -> Request:
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    input_length = _int_field(obj, "input_length", where, 0)
    expected = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length} "
            f"(expected ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {expected})"
        )
    blocks = [intern.setdefault(h, len(intern)) for h in hash_ids]
    last = input_length - MOONCAKE_BLOCK_TOKENS * (len(blocks) - 1) if blocks else 0
    return Request(blocks, MOONCAKE_BLOCK_TOKENS, last, input_length)


def _dscache_request(obj: dict[str, Any], intern: dict[object, int], where: str) -> Request:
    keys = obj["block_keys"]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TraceError(f"{where}: 'block_keys' must be a list of hex strings")
    block_tokens = _int_field(obj, "block_tokens", where, 1)
    prompt_tokens = _int_field(obj, "prompt_tokens", where, 0)
    if len(keys) * block_tokens > prompt_tokens:
        raise TraceError(
            f"{where}: {len(keys)} blocks of {block_tokens} tokens exceed "
            f"prompt_tokens {prompt_tokens}"
        )
    # The "s:" tag keeps string keys apart from Mooncake's integer ids.
    blocks = [intern.setdefault("s:" + k, len(intern)) for k in keys]
    return Request(blocks, block_tokens, block_tokens, prompt_tokens)


def load_trace(path: str | Path) -> Trace:
    """Reads and parses a trace file.

    Raises:
        TraceError: if the file cannot be read or a line is malformed.
    """
    source = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            requests = parse_trace(f, source)
    except OSError as exc:
        raise TraceError(f"cannot read trace {source}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"cannot read trace {source}: not UTF-8 text ({exc.reason})") from None
    return build_trace(source, requests)


@dataclass(frozen=True, slots=True)
class HitRatios:
    """Hits of one replay, as ratios and as counts."""

    token_hit_ratio: float
    block_hit_ratio: float
    hit_tokens: int
    hit_blocks: int
    evictions: int = 0
    cascaded: int = 0

    def as_json(self) -> dict[str, float]:
        return {"token_hit_ratio": self.token_hit_ratio, "block_hit_ratio": self.block_hit_ratio}


def _ratios(
    trace: Trace, hit_tokens: int, hit_blocks: int, evictions: int = 0, cascaded: int = 0
) -> HitRatios:
    tokens, blocks = trace.total_tokens, trace.total_blocks
    return HitRatios(
        token_hit_ratio=hit_tokens / tokens if tokens else 0.0,
        block_hit_ratio=hit_blocks / blocks if blocks else 0.0,
        hit_tokens=hit_tokens,
        hit_blocks=hit_blocks,
        evictions=evictions,
        cascaded=cascaded,
    )


_TICK_EVERY = 512


def simulate(
    trace: Trace, policy: EvictionPolicy[int], capacity: int, tick: Tick | None = None
) -> HitRatios:
    """Replays ``trace`` through a cache of ``capacity`` blocks run by ``policy``.

    Raises:
        ValueError: if ``capacity`` < 1.
        RuntimeError: if the policy breaks its contract (returns a key it does
            not hold, or nothing while holding keys).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    cached: set[int] = set()
    children = trace.children
    admit, access, remove, victim = policy.admit, policy.access, policy.remove, policy.victim
    hit_tokens = hit_blocks = evictions = cascaded = 0

    def evict_one() -> None:
        nonlocal evictions, cascaded
        v = victim()
        if v is None or v not in cached:
            raise RuntimeError(
                f"policy {policy.name!r} returned {v!r} as victim while holding "
                f"{len(cached)} blocks"
            )
        cached.remove(v)
        evictions += 1
        stack = [v]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child in cached:
                    cached.remove(child)
                    remove(child)
                    cascaded += 1
                    stack.append(child)

    for done, req in enumerate(trace.requests, start=1):
        ids = req.blocks
        n = len(ids)
        h = 0
        while h < n and ids[h] in cached:
            h += 1
        hit_blocks += h
        hit_tokens += req.prefix_tokens(h)
        # One sweep, deepest first: new blocks admitted, hit ones accessed, so
        # every parent ends up fresher than its children.
        for i in range(min(n, capacity) - 1, -1, -1):
            b = ids[i]
            if i >= h and b not in cached:
                cached.add(b)
                admit(b)
            else:
                access(b)
        while len(cached) > capacity:
            evict_one()
        if tick is not None and done % _TICK_EVERY == 0:
            tick(_TICK_EVERY)
    if tick is not None:
        tick(len(trace.requests) % _TICK_EVERY)
    if len(policy) != len(cached):
        raise RuntimeError(
            f"policy {policy.name!r} holds {len(policy)} blocks, the cache {len(cached)}"
        )
    return _ratios(trace, hit_tokens, hit_blocks, evictions, cascaded)


def simulate_ideal(trace: Trace) -> HitRatios:
    """Hit ratios of an infinite cache (every block ever computed is kept)."""
    seen: set[int] = set()
    hit_tokens = hit_blocks = 0
    for req in trace.requests:
        ids = req.blocks
        h = 0
        while h < len(ids) and ids[h] in seen:
            h += 1
        hit_blocks += h
        hit_tokens += req.prefix_tokens(h)
        seen.update(ids)
    return _ratios(trace, hit_tokens, hit_blocks)


def simulate_belady(trace: Trace, capacity: int, tick: Tick | None = None) -> HitRatios:
    """Offline-optimal replay: evicts the block whose next use is furthest away.

    A max-heap of ``(next use, depth)`` per cached block with lazy
    invalidation: an access pushes a fresh entry; entries whose block is gone
    or whose next use changed are dropped when they reach the top; the heap is
    rebuilt when stale entries outnumber live ones.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    next_use = trace.next_use()
    children = trace.children
    nu: dict[int, int] = {}  # cached block -> next use (request index)
    depth: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block)
    never = len(trace.requests)
    hit_tokens = hit_blocks = evictions = cascaded = 0
    push, pop = heapq.heappush, heapq.heappop

    for t, req in enumerate(trace.requests):
        ids = req.blocks
        nx = next_use[t]
        n = len(ids)
        h = 0
        while h < n and ids[h] in nu:
            h += 1
        if h:
            hit_blocks += h
            hit_tokens += req.prefix_tokens(h)
            for i in range(h):
                b = ids[i]
                nu[b] = nx[i]
                push(heap, (-nx[i], -depth[b], b))
        for i in range(h, n):
            b, nb = ids[i], nx[i]
            if b in nu:  # only with non-chained keys: already cached deeper down
                nu[b] = nb
                push(heap, (-nb, -depth[b], b))
                continue
            if nb >= never:
                continue  # never used again: storing it cannot help
            if len(nu) >= capacity:
                while True:
                    neg_nu, neg_depth, top = heap[0]
                    if nu.get(top) == -neg_nu and depth[top] == -neg_depth:
                        break
                    pop(heap)
                if (nb, i) >= (-neg_nu, -neg_depth):
                    continue  # the incoming block is the furthest: do not store it
                pop(heap)
                del nu[top]
                evictions += 1
                stack = [top]
                while stack:  # a no-op for chained keys (children are used later)
                    for child in children.get(stack.pop(), ()):
                        if child in nu:
                            del nu[child]
                            cascaded += 1
                            stack.append(child)
            nu[b] = nb
            depth[b] = i
            push(heap, (-nb, -i, b))
        if len(heap) > 4 * len(nu) + 4096:
            heap = [(-u, -depth[b], b) for b, u in nu.items()]
            heapq.heapify(heap)
        if tick is not None and (t + 1) % _TICK_EVERY == 0:
            tick(_TICK_EVERY)
    if tick is not None:
        tick(len(trace.requests) % _TICK_EVERY)
    return _ratios(trace, hit_tokens, hit_blocks, evictions, cascaded)


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy at one capacity."""

    policy: str
    capacity_blocks: int
    ratios: HitRatios


@dataclass(frozen=True, slots=True)
class BeladyResult:
    """The offline-optimal bound at one capacity."""

    capacity_blocks: int
    ratios: HitRatios


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """Everything one ``dscache replay`` run measured."""

    trace: str
    requests: int
    results: list[PolicyResult]
    ideal: HitRatios
    belady: list[BeladyResult]

    def as_json(self) -> dict[str, Any]:
        """The documented JSON shape."""
        return {
            "trace": self.trace,
            "requests": self.requests,
            "results": [
                {"policy": r.policy, "capacity_blocks": r.capacity_blocks, **r.ratios.as_json()}
                for r in self.results
            ],
            "ideal": self.ideal.as_json(),
            "belady": [
                {"capacity_blocks": b.capacity_blocks, **b.ratios.as_json()} for b in self.belady
            ],
        }

    def result(self, policy: str, capacity: int) -> HitRatios | None:
        for r in self.results:
            if r.policy == policy and r.capacity_blocks == capacity:
                return r.ratios
        return None

    def belady_at(self, capacity: int) -> HitRatios | None:
        for b in self.belady:
            if b.capacity_blocks == capacity:
                return b.ratios
        return None


def replay(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    belady: bool = True,
    tick: Tick | None = None,
) -> ReplayReport:
    """Runs every policy at every capacity, plus the ideal and (optionally) Belady."""
    results: list[PolicyResult] = []
    bounds: list[BeladyResult] = []
    for capacity in capacities:
        for name in policies:
            policy: EvictionPolicy[int] = make_policy(name, capacity)
            ratios = simulate(trace, policy, capacity, tick)
            logger.debug(
                "%s @ %d blocks: token %.4f block %.4f (%d evictions, %d cascaded)",
                name,
                capacity,
                ratios.token_hit_ratio,
                ratios.block_hit_ratio,
                ratios.evictions,
                ratios.cascaded,
            )
            results.append(PolicyResult(name, capacity, ratios))
        if belady:
            bounds.append(BeladyResult(capacity, simulate_belady(trace, capacity, tick)))
    return ReplayReport(
        trace=trace.path,
        requests=len(trace.requests),
        results=results,
        ideal=simulate_ideal(trace),
        belady=bounds,
    )


def format_table(report: ReplayReport) -> str:
    """Plain aligned text: one row per policy and capacity, then the bounds.

    ``of Belady`` is the policy's token hit ratio over Belady's at the same
    capacity; ``x LRU`` its token hit ratio over LRU's.
    """
    header = ("capacity", "policy", "token hit", "block hit", "of Belady", "x LRU")
    rows: list[tuple[str, ...]] = []
    capacities = list(dict.fromkeys(r.capacity_blocks for r in report.results))
    capacities += [b.capacity_blocks for b in report.belady if b.capacity_blocks not in capacities]
    for capacity in capacities:
        bound = report.belady_at(capacity)
        lru = report.result("lru", capacity)
        for r in report.results:
            if r.capacity_blocks != capacity:
                continue
            tok = r.ratios.token_hit_ratio
            rows.append(
                (
                    str(capacity),
                    r.policy,
                    f"{tok:.4f}",
                    f"{r.ratios.block_hit_ratio:.4f}",
                    _ratio(tok, bound.token_hit_ratio if bound else None, "{:.1%}"),
                    _ratio(tok, lru.token_hit_ratio if lru else None, "{:.3f}"),
                )
            )
        if bound is not None:
            rows.append(
                (
                    str(capacity),
                    "belady",
                    f"{bound.token_hit_ratio:.4f}",
                    f"{bound.block_hit_ratio:.4f}",
                    "100.0%",
                    _ratio(bound.token_hit_ratio, lru.token_hit_ratio if lru else None, "{:.3f}"),
                )
            )
    rows.append(
        (
            "inf",
            "ideal",
            f"{report.ideal.token_hit_ratio:.4f}",
            f"{report.ideal.block_hit_ratio:.4f}",
            "",
            "",
        )
    )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        f"trace {report.trace}: {report.requests} requests",
        "  ".join(
            h.rjust(w) if i != 1 else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        ),
    ]
    for row in rows:
        lines.append(
            "  ".join(
                c.rjust(w) if i != 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    return "\n".join(lines)


def _ratio(value: float, base: float | None, fmt: str) -> str:
    if base is None or base <= 0:
        return "-"
    return fmt.format(value / base)


def write_png(report: ReplayReport, path: str | Path) -> None:
    """Token hit ratio per policy vs capacity, with the Belady and ideal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for name in dict.fromkeys(r.policy for r in report.results):
            points = sorted(
                (r.capacity_blocks, r.ratios.token_hit_ratio)
                for r in report.results
                if r.policy == name
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        if report.belady:
            points = sorted((b.capacity_blocks, b.ratios.token_hit_ratio) for b in report.belady)
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "k--",
                marker="s",
                label="belady (offline optimal)",
            )
        ax.axhline(
            report.ideal.token_hit_ratio, color="grey", linestyle=":", label="ideal (infinite)"
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("token hit ratio")
        ax.set_title(f"{Path(report.trace).name}: {report.requests} requests")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def _parse_capacities(text: str) -> list[int]:
    out: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"--capacity-blocks: {part!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"--capacity-blocks: {value} must be >= 1")
        out.append(value)
    if not out:
        raise ValueError("--capacity-blocks: give at least one capacity")
    return list(dict.fromkeys(out))


def _parse_policies(text: str | None) -> list[str]:
    if text is None:
        return list(dict.fromkeys([DEFAULT_POLICY, "lru"]))
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(POLICIES)
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        known = ", ".join(POLICIES)
        raise ValueError(
            f"--policy: unknown {', '.join(unknown) or '(empty)'}; known: {known}, all"
        )
    return list(dict.fromkeys(names))


def run_cli(args: argparse.Namespace) -> int:
    """``dscache replay``: prints the table, writes JSON/PNG if asked; returns the exit code."""
    try:
        capacities = _parse_capacities(str(args.capacity_blocks))
        policies = _parse_policies(args.policy)
        trace = load_trace(args.trace)
    except ValueError as exc:  # TraceError included
        print(f"dscache replay: {exc}", file=sys.stderr)
        return 2
    if not trace.requests:
        print(f"dscache replay: no requests in {args.trace}", file=sys.stderr)
        return 2
    logger.info(
        "replaying %d requests (%d blocks) from %s: policies %s at %s blocks",
        len(trace.requests),
        trace.total_blocks,
        trace.path,
        ",".join(policies),
        ",".join(map(str, capacities)),
    )
    from tqdm import tqdm

    runs = len(capacities) * (len(policies) + (0 if args.no_belady else 1))
    with tqdm(total=runs * len(trace.requests), unit="req", file=sys.stderr, disable=None) as bar:

        def tick(n: int) -> None:
            bar.update(n)

        report = replay(trace, policies, capacities, belady=not args.no_belady, tick=tick)
    print(format_table(report))
    if args.json_out:
        try:
            Path(args.json_out).write_text(json.dumps(report.as_json(), indent=2) + "\n")
        except OSError as exc:
            print(f"dscache replay: cannot write {args.json_out}: {exc}", file=sys.stderr)
            return 2
    if args.png_out:
        try:
            write_png(report, args.png_out)
        except ModuleNotFoundError as exc:
            print(
                f"dscache replay: --png needs matplotlib: pip install 'dscache[bench]' ({exc})",
                file=sys.stderr,
            )
            return 2
        except OSError as exc:
            print(f"dscache replay: cannot write {args.png_out}: {exc}", file=sys.stderr)
            return 2
    return 0
