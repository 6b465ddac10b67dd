"""Iteration-level scheduling: one engine thread interleaves every running request.

A request that arrives while others generate does not wait for them to finish (as it
would with one request per slot): it waits for the current iteration at most. Each
iteration of the engine thread does, in order:

1. prefill work in arrival order, up to ``prefill_chunk`` tokens per iteration (a
   long prompt is prefilled in chunks, so it never stalls the decodes of the others
   for longer than one chunk; requests that arrive meanwhile join at once); a
   request's first prefill restores its cached prefix (``PrefixCache.restore``), its
   last one waits for the restored blocks' checksums (``PrefixCache.confirm``) and
   samples its first token;
2. one decode step for every request that was past its first token when the
   iteration began, batched into one forward (``Engine.decode``: the weights are
   read once for the whole batch).

Prefill goes first because a new request's first token waits for it, while a
running request only waits one chunk longer for its next token.

Contract:
    * ``submit`` never blocks; its future gets the ``GenerationResult``, or the
      exception a bug raised (the request's stream then ends with an error); other
      requests go on. ``emit`` gets the request's text deltas in order, on the engine
      thread, and must not block.
    * The cached prefix never changes the output: the request restores what the
      cache has, prefills the rest and generates as a full recompute would (batched
      decoding equals one-by-one decoding to float rounding).
    * A restored block that fails its checksum is caught before the first token is
      sampled; the request then recomputes its whole prompt (counted as ``corrupt``).
    * The restored prefix's lease is extended while the request runs; before each
      prefill chunk and decode step the lease is checked (``Restored.guard_lease``):
      one that lapsed during the prefill restarts it uncached (``lease_lapsed``), one
      that lapsed during decoding fails the request rather than answer from bytes
      that may have been reused.
    * New full prompt blocks are queued for storing right after the prefill, before
      the first token is emitted, on the cache's background thread. When a request
      ends (``stop`` or ``length``), the blocks its decoding completed (prompt and
      generated tokens together) are queued the same way, so the next turn of a
      conversation that sends back the answer finds it cached. The client's
      next-turn signal follows that store and covers both.
    * A cancelled request (client gone) stops at its next iteration.
    * ``timings`` of every request sum to its wall time until the first token:
      ``queue`` is everything spent waiting (for a slot, for the engine thread, and
      while other requests' work ran between its prefill chunks); ``prefill`` is the
      compute of its own chunks only.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from dscache.metricnames import PHASES
from dscache_server.cache import PrefixCache, Restored
from dscache_server.engine import Engine
from dscache_server.generate import (
    COMPLETED,
    GenerationRequest,
    GenerationResult,
    IncrementalDetokenizer,
    SessionTracker,
    StopMatcher,
    sample,
)
from dscache_server.kv import SequenceKV
from dscache_server.metrics import ServerMetrics
from dscache_server.tokenizer import DeepSeekTokenizer

log = logging.getLogger(__name__)

#: Prompt tokens prefilled per iteration at most (all requests together).
DEFAULT_PREFILL_CHUNK = 512


@dataclass(eq=False)
class _Active:
    """One request inside the batcher, from submission to its last token."""

    req: GenerationRequest
    emit: Callable[[str], None]
    future: Future[GenerationResult]
    submitted: float
    detok: IncrementalDetokenizer
    stops: StopMatcher
    rng: torch.Generator
    seq: SequenceKV | None = None
    restored: Restored | None = None
    done: int = 0  # prompt tokens whose KV is in ``seq``
    compute_s: float = 0.0  # own prefill compute
    logits: torch.Tensor | None = None
    hit_tokens: int = 0
    ttft: float = 0.0
    finish: str = "length"

    @property
    def prefilling(self) -> bool:
        return self.logits is None


class Batcher:
    """Runs every request on one engine thread, iteration by iteration.

    Args:
        engine: the model.
        tokenizer: for the text deltas.
        cache: restore, confirm and background store.
        metrics: where requests are counted.
        prefill_chunk: prompt tokens prefilled per iteration at most.
        sessions: the session hit tracker (one per server).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: DeepSeekTokenizer,
        cache: PrefixCache,
        metrics: ServerMetrics,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        sessions: SessionTracker | None = None,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.engine = engine
        self.tokenizer = tokenizer
        self.cache = cache
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.sessions = sessions or SessionTracker()
        self._incoming: queue.SimpleQueue[_Active | None] = queue.SimpleQueue()
        self._active: deque[_Active] = deque()
        self._closed = False  # no more submissions
        self._stopping = False  # the engine thread saw the close marker
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API

    def submit(
        self, req: GenerationRequest, emit: Callable[[str], None] = lambda _d: None
    ) -> Future[GenerationResult]:
        """Queues ``req``; never blocks. The future gets its result."""
        future: Future[GenerationResult] = Future()
        if self._closed:
            future.set_exception(RuntimeError("the engine is shutting down"))
            return future
        seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
        self._incoming.put(
            _Active(
                req=req,
                emit=emit,
                future=future,
                submitted=time.perf_counter(),
                detok=IncrementalDetokenizer(self.tokenizer),
                stops=StopMatcher(req.params.stop),
                rng=torch.Generator().manual_seed(seed),
            )
        )
        return future

    def run(
        self, req: GenerationRequest, emit: Callable[[str], None] = lambda _d: None
    ) -> GenerationResult:
        """Submits ``req`` and waits for its result (tests, tools)."""
        return self.submit(req, emit).result()

    def close(self, timeout_s: float = 30.0) -> None:
        """Lets running requests finish, then stops the engine thread."""
        self._closed = True
        self._incoming.put(None)
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            if not self._stopping:
                self._take_new(block=not self._active)
            if not self._active:
                if self._stopping:
                    break
                continue
            try:
                self._iterate()
            except Exception:  # a bug in the loop itself: fail what runs, keep serving
                log.exception("engine iteration failed")
                while self._active:
                    self._fail(self._active.popleft(), RuntimeError("engine iteration failed"))
        # Anything submitted while closing is refused, never left hanging.
        while True:
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._fail(item, RuntimeError("the engine is shutting down"))

    def _take_new(self, *, block: bool) -> None:
        """Moves submitted requests into the active set (the close marker stops it)."""
        if self._stopping:
            return
        try:
            item = self._incoming.get(block=block)
        except queue.Empty:
            return
        while True:
            if item is None:
                self._stopping = True
                return
            self._active.append(item)
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return

    def _iterate(self) -> None:
        for a in [a for a in self._active if a.req.cancelled.is_set()]:
            a.finish = "cancelled"
            self._finish(a)
        decoding = [a for a in self._active if not a.prefilling]
        budget = self.prefill_chunk
        while budget > 0:
            # Arrivals join at once: a request that came in during the last chunk is
            # prefilled in this iteration, not after another decode step.
            self._take_new(block=False)
            head = next((a for a in self._active if a.prefilling), None)
            if head is None:
                break
            try:
                done = self._prefill(head, budget)
            except Exception as exc:
                log.exception("prefill failed")
                self._active.remove(head)
                self._fail(head, exc)
                continue
            if done <= 0:
                break
            budget -= done
        decoding = [a for a in decoding if a in self._active]
        if decoding:
            self._decode_step(decoding)

    # ------------------------------------------------------------------ prefill

    def _prefill(self, a: _Active, budget: int) -> int:
        """Up to ``budget`` prompt tokens of ``a``; returns how many it computed."""
        ids = a.req.token_ids
        if a.seq is None:
            a.seq = self.engine.new_sequence()
            a.restored = self.cache.restore(a.req.chain, ids, a.seq)
            a.done = a.seq.restored_tokens
        seq, restored = a.seq, a.restored
        assert restored is not None
        if not restored.guard_lease(seq, self.cache.lease_ttl_s):
            # The restored blocks' lease ran out while this prefill read them: what was
            # computed from them may be another block's bytes; start over, uncached.
            self.cache.lapsed(restored)
            a.seq = seq = self.engine.new_sequence()
            a.done = 0
        take = min(len(ids) - a.done, budget)
        last = a.done + take == len(ids)
        chunk = ids[a.done : a.done + take]
        t0 = time.perf_counter()
        if last:
            logits = self.engine.forward(seq, chunk)
        else:  # no logits for a chunk that is not the prompt's last
            self.engine.extend(seq, chunk)
        a.compute_s += time.perf_counter() - t0
        a.done += take
        if not last:
            return take
        if not self.cache.confirm(restored):
            # A restored block failed its checksum while the prefill ran: nothing
            # computed from it may reach a token, so the whole prompt is recomputed.
            a.seq = self.engine.new_sequence()
            a.done = 0
            return take
        self._first_token(a, logits)
        return take

    def _first_token(self, a: _Active, logits: torch.Tensor) -> None:
        req, restored, seq = a.req, a.restored, a.seq
        assert restored is not None and seq is not None
        now = time.perf_counter()
        t = req.timings
        t.update(
            lookup=restored.lookup_s,
            lease=restored.lease_s,
            map_verify=restored.map_verify_s,
            prefill=a.compute_s,
        )
        # Everything between submission and now that was not this request's own work
        # was waiting: for the engine thread, or while others ran between its chunks.
        own = restored.lookup_s + restored.lease_s + restored.map_verify_s + a.compute_s
        t["queue"] = t.get("queue", 0.0) + max(now - a.submitted - own, 0.0)
        a.hit_tokens = seq.restored_tokens
        self._count_hits(req, restored.admitted, a.hit_tokens, restored.hit_blocks)
        self.cache.observe(len(req.token_ids), restored, a.compute_s)
        self.cache.store_async(req.chain, req.token_ids, seq, restored.hit_blocks)
        m = self.metrics
        m.prompt_tokens.labels(source="reused", tenant=req.tenant_label).inc(a.hit_tokens)
        m.prompt_tokens.labels(source="recomputed", tenant=req.tenant_label).inc(
            len(req.token_ids) - a.hit_tokens
        )
        a.logits = logits
        self._take_token(a, first=True)

    # ------------------------------------------------------------------ decode

    def _decode_step(self, batch: list[_Active]) -> None:
        for a in list(batch):
            assert a.restored is not None and a.seq is not None
            if not a.restored.guard_lease(a.seq, self.cache.lease_ttl_s):
                # Tokens were already sent; the next ones could come from another
                # block's bytes. A wrong answer is worse than an error.
                self.cache.lapsed(a.restored)
                batch.remove(a)
                self._active.remove(a)
                self._fail(a, RuntimeError("the cached prefix's lease ran out during decoding"))
        if not batch:
            return
        seqs = [a.seq for a in batch]
        tokens = [a.detok.ids[-1] for a in batch]
        t0 = time.perf_counter()
        try:
            logits = self.engine.decode(seqs, tokens)  # type: ignore[arg-type]
        except Exception as exc:  # a bug: the batch's states may be half-appended
            log.exception("decode step failed")
            for a in batch:
                self._active.remove(a)
                self._fail(a, exc)
            return
        elapsed = time.perf_counter() - t0
        self.metrics.decode_batch.observe(len(batch))
        for i, a in enumerate(batch):
            a.req.timings.setdefault("first_decode", elapsed)
            a.logits = logits[i]
            self._take_token(a, first=False)

    def _take_token(self, a: _Active, *, first: bool) -> None:
        """Samples the next token of ``a`` from its logits; emits text; finishes it
        when it is done."""
        assert a.logits is not None and a.seq is not None
        req, params = a.req, a.req.params
        token = sample(a.logits, params, a.rng)
        if first:
            a.ttft = time.perf_counter() - req.arrived
            self.metrics.ttft.labels(cache="hit" if a.hit_tokens else "miss").observe(a.ttft)
        if token in self.engine.eos_token_ids:
            a.finish = "stop"
            self._finish(a)
            return
        delta, stopped = a.stops.feed(a.detok.push(token))
        if delta:
            if "first_text" not in req.timings:
                req.timings["first_text"] = time.perf_counter() - req.arrived
            a.emit(delta)
        if stopped:
            a.finish = "stop"
            self._finish(a)
            return
        if len(a.detok.ids) >= params.max_tokens or a.seq.length + 1 >= self.engine.max_context:
            self._finish(a)

    # ------------------------------------------------------------------ the end

    def _finish(self, a: _Active) -> None:
        """Ends ``a`` normally (a finish reason is set): flushes, records, resolves."""
        self._active.remove(a)
        try:
            self._store_generated(a)
            tail = a.stops.flush()
            if tail:
                a.emit(tail)
            self.metrics.generated_tokens.inc(len(a.detok.ids))
            self._observe(a.req.timings)
            restored = a.restored
            result = GenerationResult(
                text=a.stops.text,
                finish_reason=a.finish,
                prompt_tokens=len(a.req.token_ids),
                cached_tokens=a.hit_tokens,
                completion_tokens=len(a.detok.ids),
                token_ids=list(a.detok.ids),
                ttft_s=a.ttft,
                fallback=restored.fallback if restored is not None else None,
                timings={**a.req.timings, "ttft": a.ttft},
            )
        except Exception as exc:
            self._fail(a, exc)
            return
        self._release(a)
        a.future.set_result(result)

    def _store_generated(self, a: _Active) -> None:
        """Queues the blocks decoding completed, then the client's next-turn signal.

        ``seq`` holds the prompt and every generated token fed back to the model (the
        last sampled one never is); the blocks from the prompt's last partial block on
        are new. A cancelled request stores nothing more: its client is gone.
        """
        req, seq = a.req, a.seq
        if seq is None or a.prefilling:
            return
        ids = req.token_ids
        if a.finish in COMPLETED and a.detok.ids:
            ids = [*req.token_ids, *a.detok.ids]
            first = len(req.token_ids) // self.cache.block_tokens
            self.cache.store_async(req.chain, ids, seq, first)
        if req.next_turn:
            self.cache.signal_async(req.chain, ids[: seq.length], req.next_turn)

    def _fail(self, a: _Active, exc: BaseException) -> None:
        self._release(a)
        if not a.future.done():
            a.future.set_exception(exc)

    @staticmethod
    def _release(a: _Active) -> None:
        if a.restored is not None:
            a.restored.release()

    def _observe(self, timings: dict[str, float]) -> None:
        """Each phase of a finished request into its histogram (``store`` is the writer's)."""
        phases = self.metrics.phase_seconds
        for phase in PHASES:
            if phase in timings:
                phases.labels(phase=phase).observe(timings[phase])

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
