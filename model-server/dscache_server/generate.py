"""What a request is and what it reports, and the pieces that turn logits into text.

A tokenized ``GenerationRequest`` goes to the engine thread (``batcher.Batcher``),
which answers with a ``GenerationResult``. Here: sampling, incremental
detokenization, stop strings and the session hit tracker.

Contract:
    * Stop strings are never emitted, not even partly: text that could be the start
      of a stop string is held back until it is known not to be.
    * The detokenizer emits text only once it is complete (no half UTF-8 character).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from cachetools import LRUCache

from dscache.keys import KeyChain
from dscache_server.tokenizer import DeepSeekTokenizer

log = logging.getLogger(__name__)


#: Finish reasons of an answer that ran to its end (not cancelled): its generated
#: blocks are stored and its ids remembered for the next turn.
COMPLETED = frozenset({"stop", "length"})


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
    #: What the client said of its session's next turn: "ended", "expected" or "".
    next_turn: str = ""
    #: Where the answer is remembered with the generated ids (the tenant): a chat's in
    #: ``PieceCache.remember_answer``, a text completion's with its prompt in
    #: ``Continuations``; None: not remembered (a prompt of token ids).
    answer_scope: str | None = None
    #: A text completion's prompt as the client sent it; None for chats and id prompts.
    prompt_text: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: Seconds per phase (``dscache.metricnames.PHASES``); the HTTP layer fills in
    #: ``tokenize`` and ``queue``, the engine thread the rest.
    timings: dict[str, float] = field(default_factory=dict)


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
    timings: dict[str, float] = field(default_factory=dict)


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
