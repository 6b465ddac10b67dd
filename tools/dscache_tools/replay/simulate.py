"""The simulation of ``dscache replay``: policies over a trace, and the bounds.

Contract:

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
  Every ``admit`` names the block's parent.
* A chain-aware policy (``chain_aware``, the ``chain`` policy) sees the calls in
  the live store's order instead: the hit blocks accessed deepest first (the
  Lease), then the new blocks admitted deepest first (the Commit), nothing
  more (the store skips its ancestor touch for it). Its clock is the trace's
  time (:class:`TraceClock`), so it runs the same code as the store.
* Signals (:mod:`~dscache_tools.replay.signals`), when given, reach a policy
  that takes them (:class:`~dscache_sidecar.eviction.Signalled`): ``queued``
  before a request is served, for the requests arriving within the queue
  window; ``ended``/``expected`` after it, on its chain.
* Bounds at the same capacity: the infinite-cache *ideal* (a block hits if its
  whole prefix was seen before) and the offline-optimal *Belady* bound: on
  every insertion, the block whose next use is furthest in the future goes,
  the incoming block included (then it is not stored); ties go to the deeper
  block. A child is never used before its parent, so Belady keeps whole
  prefixes by itself and is optimal for the block hit ratio; it is the
  reference for the token ratio too (exact when blocks are full).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from dscache_sidecar.eviction import CLOCKED, EvictionPolicy, Signalled, make_policy

from dscache_tools.replay.signals import SignalPlan
from dscache_tools.replay.trace import Trace

logger = logging.getLogger(__name__)

#: Progress callback: called with the number of requests just replayed.
Tick = Callable[[int], None]


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


def _progress(tick: Tick | None, done: int | None, total: int = 0) -> None:
    """Reports progress every ``_TICK_EVERY`` requests; ``done=None`` reports the rest."""
    if tick is None:
        return
    if done is None:
        tick(total % _TICK_EVERY)
    elif done % _TICK_EVERY == 0:
        tick(_TICK_EVERY)


def _leading_hits(ids: list[int], cached: Container[int]) -> int:
    """How many leading blocks of a request are cached (prefix semantics)."""
    h = 0
    while h < len(ids) and ids[h] in cached:
        h += 1
    return h


class TraceClock:
    """The replay's time for time-aware policies: the current request's ``time_s``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    trace: Trace,
    policy: EvictionPolicy[int],
    capacity: int,
    tick: Tick | None = None,
    *,
    clock: TraceClock | None = None,
    signals: SignalPlan | None = None,
) -> HitRatios:
    """Replays ``trace`` through a cache of ``capacity`` blocks run by ``policy``.

    ``clock``: set to each request's time before it is served (give the same one
    to the policy). ``signals``: delivered to a policy that takes them.

    Raises:
        ValueError: if ``capacity`` < 1.
        RuntimeError: if the policy breaks its contract (returns a key it does
            not hold, or nothing while holding keys).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    cached: set[int] = set()
    children = trace.children
    remove, victim = policy.remove, policy.victim
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

    store_order = bool(getattr(policy, "chain_aware", False))
    signal = policy.signal if signals is not None and isinstance(policy, Signalled) else None
    requests = trace.requests
    for done, req in enumerate(requests, start=1):
        if clock is not None:
            clock.now = req.time_s
        ids = req.blocks
        n = len(ids)
        if signal is not None:
            assert signals is not None
            for u in signals.before[done - 1]:
                signal(requests[u].blocks, "queued", signals.queue_s + 1.0)
        h = _leading_hits(ids, cached)
        hit_blocks += h
        hit_tokens += req.prefix_tokens(h)
        stored = min(n, capacity)
        _touch(ids, h, stored, cached, policy, store_order=store_order)
        if signal is not None:
            assert signals is not None
            kind = signals.after[done - 1]
            if kind:
                signal(ids[:stored], kind)
        while len(cached) > capacity:
            evict_one()
        _progress(tick, done)
    _progress(tick, None, len(trace.requests))
    if len(policy) != len(cached):
        raise RuntimeError(
            f"policy {policy.name!r} holds {len(policy)} blocks, the cache {len(cached)}"
        )
    return _ratios(trace, hit_tokens, hit_blocks, evictions, cascaded)


def _touch(
    ids: list[int],
    h: int,
    stored: int,
    cached: set[int],
    policy: EvictionPolicy[int],
    *,
    store_order: bool,
) -> None:
    """Tells ``policy`` of one request: ``h`` hit blocks, new ones up to ``stored``."""
    admit, access = policy.admit, policy.access
    if store_order:
        for i in range(min(h, stored) - 1, -1, -1):
            access(ids[i])
        for i in range(stored - 1, h - 1, -1):
            b = ids[i]
            if b not in cached:
                cached.add(b)
                admit(b, 1, ids[i - 1] if i else None)
        return
    # One sweep, deepest first: new blocks admitted, hit ones accessed, so
    # every parent ends up fresher than its children.
    for i in range(stored - 1, -1, -1):
        b = ids[i]
        if i >= h and b not in cached:
            cached.add(b)
            admit(b, 1, ids[i - 1] if i else None)
        else:
            access(b)


def simulate_ideal(trace: Trace) -> HitRatios:
    """Hit ratios of an infinite cache (every block ever computed is kept)."""
    seen: set[int] = set()
    hit_tokens = hit_blocks = 0
    for req in trace.requests:
        ids = req.blocks
        h = _leading_hits(ids, seen)
        hit_blocks += h
        hit_tokens += req.prefix_tokens(h)
        seen.update(ids)
    return _ratios(trace, hit_tokens, hit_blocks)


class _BeladyCache:
    """Cached blocks keyed by next use, furthest first (lazy max-heap).

    An access pushes a fresh entry; entries whose block is gone or whose next use
    changed are dropped when they reach the top; :meth:`compact` rebuilds the heap
    when stale entries outnumber live ones.
    """

    def __init__(self, capacity: int, children: dict[int, list[int]]) -> None:
        self.capacity = capacity
        self.children = children
        self.nu: dict[int, int] = {}  # cached block -> next use (request index)
        self.depth: dict[int, int] = {}
        self.heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block)
        self.evictions = self.cascaded = 0

    def refresh(self, b: int, next_use: int) -> None:
        """A cached block was used; it is next used at ``next_use``."""
        self.nu[b] = next_use
        heapq.heappush(self.heap, (-next_use, -self.depth[b], b))

    def offer(self, b: int, next_use: int, depth: int) -> None:
        """Stores a new block unless it is the one used furthest in the future."""
        if len(self.nu) >= self.capacity:
            top_use, top_depth, top = self._furthest()
            if (next_use, depth) >= (top_use, top_depth):
                return  # the incoming block is the furthest: do not store it
            heapq.heappop(self.heap)
            self._evict(top)
        self.nu[b] = next_use
        self.depth[b] = depth
        heapq.heappush(self.heap, (-next_use, -depth, b))

    def _furthest(self) -> tuple[int, int, int]:
        heap, nu, depth = self.heap, self.nu, self.depth
        while True:
            neg_nu, neg_depth, top = heap[0]
            if nu.get(top) == -neg_nu and depth[top] == -neg_depth:
                return -neg_nu, -neg_depth, top
            heapq.heappop(heap)

    def _evict(self, top: int) -> None:
        del self.nu[top]
        self.evictions += 1
        stack = [top]
        while stack:  # a no-op for chained keys (children are used later)
            for child in self.children.get(stack.pop(), ()):
                if child in self.nu:
                    del self.nu[child]
                    self.cascaded += 1
                    stack.append(child)

    def compact(self) -> None:
        """Drops stale heap entries once they outnumber the live ones."""
        if len(self.heap) > 4 * len(self.nu) + 4096:
            self.heap = [(-u, -self.depth[b], b) for b, u in self.nu.items()]
            heapq.heapify(self.heap)


def simulate_belady(trace: Trace, capacity: int, tick: Tick | None = None) -> HitRatios:
    """Offline-optimal replay: evicts the block whose next use is furthest away."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    next_use = trace.next_use()
    cache = _BeladyCache(capacity, trace.children)
    never = len(trace.requests)
    hit_tokens = hit_blocks = 0
    for t, req in enumerate(trace.requests):
        ids, nx = req.blocks, next_use[t]
        h = _leading_hits(ids, cache.nu)
        hit_blocks += h
        hit_tokens += req.prefix_tokens(h)
        for i in range(h):
            cache.refresh(ids[i], nx[i])
        for i in range(h, len(ids)):
            if ids[i] in cache.nu:  # only with non-chained keys: already cached deeper down
                cache.refresh(ids[i], nx[i])
            elif nx[i] < never:  # a block never used again cannot help
                cache.offer(ids[i], nx[i], i)
        cache.compact()
        _progress(tick, t + 1)
    _progress(tick, None, len(trace.requests))
    return _ratios(trace, hit_tokens, hit_blocks, cache.evictions, cache.cascaded)


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy at one capacity (``signals``: the serving-path signals it got)."""

    policy: str
    capacity_blocks: int
    ratios: HitRatios
    signals: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The policy's name, with ``+signals`` when it got any."""
        return f"{self.policy}+signals" if self.signals else self.policy


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
                {
                    "policy": r.label,
                    "capacity_blocks": r.capacity_blocks,
                    **r.ratios.as_json(),
                    "signals": list(r.signals),
                }
                for r in self.results
            ],
            "ideal": self.ideal.as_json(),
            "belady": [
                {"capacity_blocks": b.capacity_blocks, **b.ratios.as_json()} for b in self.belady
            ],
        }

    def result(self, policy: str, capacity: int) -> HitRatios | None:
        """The ratios of ``policy`` (a label: ``chain+signals`` for the signalled run)."""
        for r in self.results:
            if r.label == policy and r.capacity_blocks == capacity:
                return r.ratios
        return None

    def belady_at(self, capacity: int) -> HitRatios | None:
        for b in self.belady:
            if b.capacity_blocks == capacity:
                return b.ratios
        return None


def _takes_signals(name: str) -> bool:
    return isinstance(make_policy(name, 1), Signalled)


def replay(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    belady: bool = True,
    tick: Tick | None = None,
    signals: SignalPlan | None = None,
) -> ReplayReport:
    """Runs every policy at every capacity, plus the ideal and (optionally) Belady.

    With ``signals``, each policy that takes signals runs a second time with them
    (reported as ``<name>+signals``).
    """
    results: list[PolicyResult] = []
    bounds: list[BeladyResult] = []
    for capacity in capacities:
        for name in policies:
            runs: list[SignalPlan | None] = [None]
            if signals is not None and signals.kinds and _takes_signals(name):
                runs.append(signals)
            for plan in runs:
                clock = TraceClock()
                policy: EvictionPolicy[int] = make_policy(
                    name, capacity, clock if name in CLOCKED else None
                )
                ratios = simulate(trace, policy, capacity, tick, clock=clock, signals=plan)
                logger.debug(
                    "%s @ %d blocks: token %.4f block %.4f (%d evictions, %d cascaded)",
                    name,
                    capacity,
                    ratios.token_hit_ratio,
                    ratios.block_hit_ratio,
                    ratios.evictions,
                    ratios.cascaded,
                )
                kinds = plan.kinds if plan is not None else ()
                results.append(PolicyResult(name, capacity, ratios, kinds))
        if belady:
            bounds.append(BeladyResult(capacity, simulate_belady(trace, capacity, tick)))
    return ReplayReport(
        trace=trace.path,
        requests=len(trace.requests),
        results=results,
        ideal=simulate_ideal(trace),
        belady=bounds,
    )
