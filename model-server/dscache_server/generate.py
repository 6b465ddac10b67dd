"""One request's path through the engine: restore, prefill the rest, generate, store.

Contract:
    * ``Generator.run`` runs on a worker thread and owns the engine for the duration
      of one forward at a time; ``emit`` is called with text deltas in order and must
      not block.
    * The cached prefix never changes the output: the request restores what the
      cache has, prefills the rest, and generates as a full recompute would.
    * New full prompt blocks are queued for storing right after the prefill, before
      the first token is emitted, on the cache's background thread.
    * Stop strings are never emitted, not even partly: text that could be the start
      of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from cachetools import LRUCache

from dscache.keys import KeyChain
from dscache_server.cache import PrefixCache
from dscache_server.engine import Engine
from dscache_server.metrics import ServerMetrics
from dscache_server.tokenizer import DeepSeekTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    Attributes:
        max_tokens: completion tokens at most.
        temperature: 0 means greedy.
        top_p: nucleus mass kept (1 = all).
        seed: sampling seed (None = random).
        stop: strings that end the completion (not included in it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class GenerationRequest:
    """A tokenized request ready for the engine."""

    token_ids: list[int]
    params: SamplingParams
    chain: KeyChain
    session_id: str | None = None
    tenant_label: str = "default"  # the metrics' tenant label (dscache_server.auth)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class GenerationResult:
    """What a finished request reports."""

    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    token_ids: list[int]
    ttft_s: float
    fallback: str | None = None


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Picks the next token: argmax at temperature 0, else nucleus sampling."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float32) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p (always at least one token).
        keep = cumulative - sorted_probs < params.top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding everything."""

    def __init__(self, tokenizer: DeepSeekTokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Adds one id; returns the text it completes (may be empty)."""
        self.ids.append(token_id)
        before = self._tok.decode(self.ids[self._prefix : self._read])
        after = self._tok.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""


class StopMatcher:
    """Holds back text that might begin a stop string; cuts at the first stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Adds text; returns (text safe to emit now, whether a stop was hit)."""
        self.text += delta
        cut = min((i for s in self._stops if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self._take(len(self.text)), True
        return self._take(max(len(self.text) - self._hold, self._emitted)), False

    def flush(self) -> str:
        """Everything not emitted yet (at the end of generation)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self._emitted : end]
        self._emitted = max(end, self._emitted)
        return out


class SessionTracker:
    """Remembers each session's last cacheable prefix, for the session hit level.

    Bounded LRU: a session id is a client-chosen string and must not grow memory.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._blocks: LRUCache[str, int] = LRUCache(capacity)
        self._lock = threading.Lock()  # LRUCache is not thread safe

    def previous(self, session_id: str) -> int | None:
        """Cacheable blocks of the session's previous turn, if seen."""
        with self._lock:
            return self._blocks.get(session_id)

    def record(self, session_id: str, blocks: int) -> None:
        """Remembers this turn's cacheable blocks."""
        with self._lock:
            self._blocks[session_id] = blocks


class Generator:
    """Runs requests on the engine, with the prefix cache around them."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: DeepSeekTokenizer,
        cache: PrefixCache,
        metrics: ServerMetrics,
        sessions: SessionTracker | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.cache = cache
        self.metrics = metrics
        self.sessions = sessions or SessionTracker()

    def run(self, req: GenerationRequest, emit: Callable[[str], None]) -> GenerationResult:
        """Generates the completion of one request; ``emit`` gets text deltas."""
        engine, cache, m = self.engine, self.cache, self.metrics
        ids = req.token_ids
        seq = engine.new_sequence()
        restored = cache.restore(req.chain, ids, seq)
        try:
            hit_tokens = seq.restored_tokens
            self._count_hits(req, restored.admitted, hit_tokens, restored.hit_blocks)
            logits = engine.forward(seq, ids[hit_tokens:])
            cache.store_async(req.chain, ids, seq, restored.hit_blocks)
            tenant = req.tenant_label
            m.prompt_tokens.labels(source="reused", tenant=tenant).inc(hit_tokens)
            m.prompt_tokens.labels(source="recomputed", tenant=tenant).inc(len(ids) - hit_tokens)

            params = req.params
            generator = torch.Generator().manual_seed(
                params.seed if params.seed is not None else secrets.randbits(63)
            )
            detok = IncrementalDetokenizer(self.tokenizer)
            stops = StopMatcher(params.stop)
            finish = "length"
            ttft = 0.0
            eos = engine.eos_token_ids
            while True:
                token = sample(logits, params, generator)
                if not detok.ids:
                    ttft = time.perf_counter() - req.arrived
                    m.ttft.labels(cache="hit" if hit_tokens else "miss").observe(ttft)
                if token in eos:
                    finish = "stop"
                    break
                delta, stopped = stops.feed(detok.push(token))
                if delta:
                    emit(delta)
                if stopped:
                    finish = "stop"
                    break
                if len(detok.ids) >= params.max_tokens or seq.length + 1 >= engine.max_context:
                    break
                if req.cancelled.is_set():
                    finish = "cancelled"
                    break
                restored.guard_lease(seq, cache.lease_ttl_s)
                logits = engine.forward(seq, [token])
            tail = stops.flush()
            if tail:
                emit(tail)
            m.generated_tokens.inc(len(detok.ids))
            return GenerationResult(
                text=stops.text,
                finish_reason=finish,
                prompt_tokens=len(ids),
                cached_tokens=hit_tokens,
                completion_tokens=len(detok.ids),
                token_ids=list(detok.ids),
                ttft_s=ttft,
                fallback=restored.fallback,
            )
        finally:
            restored.release()

    def _count_hits(
        self, req: GenerationRequest, admitted: bool, hit_tokens: int, hit_blocks: int
    ) -> None:
        if not admitted:
            return
        m = self.metrics
        bt = self.cache.block_tokens
        usable = (len(req.token_ids) - 1) // bt
        m.cache_hits.labels(level="token").inc(hit_tokens)
        m.cache_misses.labels(level="token").inc(len(req.token_ids) - hit_tokens)
        m.cache_hits.labels(level="block").inc(hit_blocks)
        m.cache_misses.labels(level="block").inc(max(usable - hit_blocks, 0))
        if req.session_id is None:
            return
        previous = self.sessions.previous(req.session_id)
        if previous:
            expected = min(previous, usable)
            level = m.cache_hits if hit_blocks >= expected else m.cache_misses
            level.labels(level="session").inc()
        self.sessions.record(req.session_id, len(req.token_ids) // bt)
