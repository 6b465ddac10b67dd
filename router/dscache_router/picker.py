"""The router's picker: which pod should take a request, from what the pods hold.

NGINX stays the data path. For each request its Lua asks the picker (an
internal subrequest carrying the body, with a short timeout) and sends the
request where the picker says, or places it by its own hash when the picker
fails or is slow. The picker decides, in this order:

1. ``pinned``: the router already keeps this session on a pod (its KV is there);
   the picker only records it.
2. ``prefix``: the pod holding the longest prefix of the request's block keys,
   among the pods under the router's load bound (ties: for a chat, the pod its
   messages' digest ranks highest, so alike conversations meet on one pod
   whichever replica places them; else the hash order). What a
   pod holds is its sidecar's published filter
   (:mod:`dscache_sidecar.holdings`, fetched every ``refresh_s``; a filter
   unchanged since the last fetch is a 304 without a body) joined with
   the blocks the picker itself sent there in the last ``memory_s`` seconds
   (a turn's follow-up often arrives before the next filter does). With
   ``events_port`` the exact keys the sidecar's KV events announced answer
   instead of the filter while that feed is in sync
   (:mod:`dscache_router.eventfeed`). With ``gpu_events_port`` a vLLM pod's GPU
   prefix cache counts too (vLLM's own KV events, keyed by tokens:
   :mod:`dscache_router.gputier`): the longest prefix in tokens over both wins, a
   tie going to the GPU.
3. ``similar``: no pod holds a block of it (a prompt shorter than a block, a
   filter not yet fetched), but a request seen recently is similar to it
   (MinHash LSH over word shingles of its messages, datasketch; estimated
   Jaccard >= ``similarity_threshold``; domain terms count ``weight`` times):
   the pod that request went to, if under the bound.
4. ``hash``: the first pod under the bound in the router's ring order (what the
   router would have chosen without a picker); ``overloaded`` when none is.

Contract:
    * ``POST /pick?pods=ADDR/INFLIGHT,...&cap=N&key=K&source=S&pinned=ADDR``,
      body = the client's request body. ``pods``: the track's live pods in the
      router's ring order from the key's point, each with its in-flight count;
      ``cap``: the router's load bound (0: none). Answer: 200, the chosen pod
      address as the body, ``X-Dscache-Pick-Reason`` and
      ``X-Dscache-Pick-Blocks`` headers. A body that is not a chat or completion
      request still gets an answer (by similarity on its text, else hash); a
      malformed ``pods`` is 400.
    * ``POST /holder?pods=ADDR,...&lead=N``, body = the client's request: which of
      ``pods`` (every live pod of every track) holds the request's conversation past
      its first ``N`` chat messages (:meth:`Picker.holder`): 200 with the address,
      404 when none does (a first turn, an opening alone, credentials, no chat),
      400 for a malformed query.
    * Keys are computed only where they are public: a pod's ``/dscache/keyinfo``
      gives the root for requests without credentials when tenancy is off; a
      request with ``Authorization`` or a tenant's pod gets no prefix match
      (similarity and hash still apply). Never a wrong answer, only a worse
      choice: the chosen pod recomputes what it lacks.
    * ``GET /metrics``, ``GET /health``; the state is bounded (``max_sessions``
      similarity entries, ``max_memory_keys`` remembered keys per pod, and pods: one
      no pick has named for ``forget_s`` is forgotten), and so is what it reads: a
      pick body over ``MAX_BODY`` is refused at its first byte past it (413), and
      a pod's key info or filter over its limit is dropped unread past it.
    * Fetches carry the internal token (``X-Dscache-Internal-Token``) when one is
      configured: servers and sidecars that have one serve key info and filters to
      it only.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import xxhash
from datasketch import MinHash, MinHashLSH
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer, PieceCache, TemplateError
from dscache_sidecar.holdings import (
    HOLDINGS_PATH,
    INTERNAL_TOKEN_HEADER,
    MAX_FILTER_BYTES,
    HoldingsFilter,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dscache import metricnames as names
from dscache.keys import block_keys
from dscache.routing import KEYINFO_PATH, conversation_key, previous_turn_keys
from dscache_router.gputier import GpuTier, root

log = logging.getLogger(__name__)

REASON_HEADER = "X-Dscache-Pick-Reason"
BLOCKS_HEADER = "X-Dscache-Pick-Blocks"
REASONS = ("pinned", "prefix", "similar", "hash", "overloaded")
_WORD = re.compile(r"[\w$%.-]+", re.UNICODE)


class PickError(ValueError):
    """A pick request the picker cannot read (400)."""


@dataclass(frozen=True)
class PickerSettings:
    """Knobs of the picker.

    Attributes:
        holdings: pod address -> its sidecar's holdings URL (explicit entries).
        holdings_port: for other pods, ``http://<pod host>:<port>/dscache/holdings``
            (None: only the explicit ones have filters).
        refresh_s: seconds between two fetches of each pod's filter.
        memory_s: how long the blocks the picker sent to a pod count as held there.
        max_memory_keys: remembered keys per pod (oldest dropped first).
        similarity_threshold: estimated Jaccard from which a request follows a
            similar one's pod (0 disables similarity).
        num_perm: MinHash permutations.
        shingle_words: words per shingle.
        domain_terms: word -> weight (a weight-w term counts as w shingles).
        max_sessions: similarity entries kept (oldest dropped first).
        min_blocks: blocks a pod must hold for a ``prefix`` choice.
        fetch_timeout_s: timeout of a keyinfo or holdings fetch.
        forget_s: a pod no pick has named for this long is forgotten (its filter,
            keys and placements dropped; a pick that names it again starts anew).
        internal_token: sent as ``X-Dscache-Internal-Token`` with every keyinfo and
            holdings fetch (servers and sidecars that have one ask for it).
        locate_timeout_s: how long a session lookup waits for the pods
            (:mod:`dscache_router.locate`); under the router's picker timeout.
        events_port: subscribe to each pod's sidecar KV events on this port
            (:mod:`dscache_router.eventfeed`; None: filters only).
        events_replay_port: the sidecars' replay port (needed with events_port).
        max_event_keys: keys kept per pod from its events; past it, its filter.
        gpu_events_port: subscribe to each pod's vLLM engine KV events (its GPU prefix
            cache, :mod:`dscache_router.gputier`) on this port (None: not followed).
        gpu_events_replay_port: the engines' replay port (needed with gpu_events_port).
        gpu_min_tokens: tokens a pod's GPU must hold of a request for a ``prefix``
            choice by it (vLLM's blocks are small: a chat template's opening is one).
    """

    holdings: Mapping[str, str] = field(default_factory=dict)
    holdings_port: int | None = None
    refresh_s: float = 1.0
    memory_s: float = 120.0
    max_memory_keys: int = 200_000
    similarity_threshold: float = 0.65
    num_perm: int = 64
    shingle_words: int = 4
    domain_terms: Mapping[str, int] = field(default_factory=dict)
    max_sessions: int = 20_000
    min_blocks: int = 1
    fetch_timeout_s: float = 2.0
    forget_s: float = 600.0
    internal_token: str = field(default="", repr=False)
    locate_timeout_s: float = 0.15
    events_port: int | None = None
    events_replay_port: int | None = None
    max_event_keys: int = 1_000_000
    gpu_events_port: int | None = None
    gpu_events_replay_port: int | None = None
    gpu_min_tokens: int = 256


@dataclass(frozen=True)
class Candidate:
    """A pod the router may send the request to, with its in-flight count."""

    address: str
    inflight: int


@dataclass(frozen=True)
class PickQuery:
    """One pick request, parsed."""

    pods: tuple[Candidate, ...]
    cap: int
    key: str
    source: str
    pinned: str | None
    body: bytes
    credentials: bool

    @classmethod
    def parse(cls, args: Mapping[str, str], body: bytes, credentials: bool) -> PickQuery:
        """Parses the query string; raises :class:`PickError` for a malformed one."""
        pods: list[Candidate] = []
        for item in filter(None, args.get("pods", "").split(",")):
            address, _, inflight = item.rpartition("/")
            if not address or not inflight.isdigit():
                raise PickError(f"pods entry {item!r} is not ADDRESS/INFLIGHT")
            pods.append(Candidate(address, int(inflight)))
        if not pods:
            raise PickError("pods must name at least one pod")
        cap_text = args.get("cap", "0") or "0"
        if not cap_text.isdigit():
            raise PickError(f"cap {cap_text!r} is not a whole number")
        pinned = args.get("pinned") or None
        return cls(
            pods=tuple(pods),
            cap=int(cap_text),
            key=args.get("key", ""),
            source=args.get("source", ""),
            pinned=pinned,
            body=body,
            credentials=credentials,
        )

    def eligible(self, pod: Candidate) -> bool:
        return self.cap <= 0 or pod.inflight < self.cap


@dataclass(frozen=True)
class HolderQuery:
    """Which pod holds a request's conversation (:meth:`Picker.holder`)."""

    pods: tuple[str, ...]
    lead_messages: int
    body: bytes
    credentials: bool
    #: what the pods' ledgers may take to answer, per pod (0: the picker's flag)
    budget_ms: int = 0

    @classmethod
    def parse(cls, args: Mapping[str, str], body: bytes, credentials: bool) -> HolderQuery:
        """Parses ``pods=ADDR,...&lead=N[&budget_ms=M]``; raises :class:`PickError` for a
        malformed one."""
        pods = tuple(filter(None, args.get("pods", "").split(",")))
        if not pods or len(pods) > MAX_HOLDER_PODS:
            raise PickError(f"pods must name 1 to {MAX_HOLDER_PODS} pods")
        lead = args.get("lead", "2")
        if not lead.isdigit() or not 1 <= int(lead) <= MAX_LEAD_MESSAGES:
            raise PickError(f"lead {lead!r} is not a message count from 1 to {MAX_LEAD_MESSAGES}")
        budget = args.get("budget_ms", "0")
        if not budget.isdigit() or int(budget) > 10_000:
            raise PickError(f"budget_ms {budget!r} is not a count of milliseconds up to 10000")
        return cls(
            pods=pods,
            lead_messages=int(lead),
            body=body,
            credentials=credentials,
            budget_ms=int(budget),
        )


#: Pods one holder query may name (every live pod of a deployment's tracks).
MAX_HOLDER_PODS = 256
#: The router's prompt key hashes at most this many leading messages.
MAX_LEAD_MESSAGES = 64


def _opening(body: Any, messages: int) -> dict[str, Any] | None:
    """The request cut to its opening (its first ``messages`` chat messages), None when
    it is no chat request or has nothing past its opening."""
    if not isinstance(body, dict):
        return None
    chat = body.get("messages")
    if not isinstance(chat, list) or len(chat) <= messages:
        return None
    return {"messages": chat[:messages]}


@dataclass(frozen=True)
class Pick:
    """The picker's answer."""

    pod: str
    reason: str
    blocks: int = 0
    #: Where the ``prefix`` match was: ``store`` (the pod's sidecar) or ``gpu``
    #: (its vLLM engine's prefix cache; ``blocks`` are then vLLM's blocks).
    tier: str = "store"
    #: The request's block keys as the chosen pod keys them (what the picker now
    #: counts as held there; :meth:`Picker.moved` moves them).
    keys: tuple[bytes, ...] = field(default=(), repr=False, compare=False)


@dataclass
class _Pod:
    """What the picker knows of one pod."""

    address: str
    root: bytes | None = None
    block_tokens: int = 0
    keyinfo_at: float = 0.0
    holdings: HoldingsFilter | None = None
    holdings_at: float = 0.0
    holdings_etag: str | None = None
    #: The keys its sidecar's KV events announced, while the feed is in sync
    #: (:mod:`dscache_router.eventfeed`); None: the filter answers.
    events: set[bytes] | None = None
    recent: OrderedDict[bytes, float] = field(default_factory=OrderedDict)
    #: How many requests the picker sent here whose prompt held each key of
    #: ``recent`` (kept as long as the key is): where conversations alike to a
    #: point went, which breaks the holder's ties.
    placed: dict[bytes, int] = field(default_factory=dict)
    seen_at: float = 0.0  # when a pick last named it


def _affinity(body: Any) -> str:
    """What breaks a tie between pods holding the same longest prefix of a chat: its
    messages' :func:`~dscache.routing.conversation_key`. Conversations alike so far
    (the same opening and question, often all a first turn is) then go to one pod
    whichever router replica places them, so that a later turn that lost its id finds
    them all in one place; different ones spread over the tied pods as a hash would
    spread them. "" (the ring order decides) for anything else."""
    key = conversation_key(body.get("messages")) if isinstance(body, dict) else None
    return key or ""


def _most_placed(tied: Sequence[tuple[_Pod, Sequence[bytes], int]]) -> str | None:
    """Of pods holding an equally long prefix (each with its held keys and the index
    of the first past the request's opening), the one the picker sent the most
    requests through the keys past the opening (their most-used one: every
    conversation alike to this one passed the first of them, only some the deeper
    ones), then through the opening's last key; the first on a tie."""
    best: tuple[tuple[int, int], str] | None = None
    for pod, keys, past in tied:
        placed = pod.placed
        count = (
            max((placed.get(k, 0) for k in keys[past:]), default=0),
            placed.get(keys[past - 1], 0) if past > 0 else 0,
        )
        if best is None or count > best[0]:
            best = (count, pod.address)
    return best[1] if best else None


class PickerMetrics:
    """The picker's Prometheus metrics, on their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "dscache_picker_decisions",
            "Pods chosen, by reason (pinned, prefix, similar, hash, overloaded).",
            ["reason"],
            registry=self.registry,
        )
        for reason in REASONS:
            self.decisions.labels(reason)
        self.seconds = Histogram(
            "dscache_picker_decision_seconds",
            "Time to choose a pod (tokenizing and matching; not the HTTP round trip).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        self.matched = Histogram(
            "dscache_picker_matched_blocks",
            "Blocks the chosen pod holds of the request (prefix choices).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=self.registry,
        )
        self.fetch_errors = Counter(
            "dscache_picker_fetch_errors",
            "Failed keyinfo or holdings fetches.",
            ["what"],
            registry=self.registry,
        )
        self.locates = Counter(
            "dscache_picker_locates",
            "Sessions its router replica did not know, looked up on the pods: found (a pod "
            "served it), unknown (none did) or failed (a bad query).",
            ["result"],
            registry=self.registry,
        )
        for result in ("found", "unknown", "failed"):
            self.locates.labels(result)
        self.holders = Counter(
            "dscache_picker_holders",
            "Requests its router replica could not place by session, looked up by what "
            "the pods hold: found (a pod holds the conversation past its opening), "
            "unknown (none does) or failed (a bad query).",
            ["result"],
            registry=self.registry,
        )
        for result in ("found", "unknown", "failed"):
            self.holders.labels(result)
        self.conversations = Counter(
            names.PICKER_CONVERSATIONS,
            "Holder lookups the blocks could not settle (nothing past the opening, or a "
            "tie), asked of the pods' conversation ledgers: found (a candidate pod served "
            "the conversation's previous turn) or unknown.",
            ["result"],
            registry=self.registry,
        )
        for result in ("found", "unknown"):
            self.conversations.labels(result)
        self.holder_seconds = Histogram(
            names.PICKER_HOLDER_SECONDS,
            "Time to answer a holder lookup (tokenizing, matching and asking the pods' "
            "conversation ledgers; not the HTTP round trip). The router waits its picker "
            "timeout at most: a slower answer places the request by the weights.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.tiers = Counter(
            "dscache_picker_prefix_tier",
            "Prefix choices by where the match was: store (the pod's sidecar: filter, "
            "events, placements) or gpu (its vLLM engine's own KV events).",
            ["tier"],
            registry=self.registry,
        )
        for tier in ("store", "gpu"):
            self.tiers.labels(tier)
        self.gpu_pods = Gauge(
            "dscache_picker_gpu_pods",
            "Pods whose vLLM engine's GPU-cached blocks the picker knows from its KV events.",
            registry=self.registry,
        )
        self.pods = Gauge("dscache_picker_pods", "Pods known.", registry=self.registry)
        self.filters = Gauge(
            "dscache_picker_filters",
            "Pods whose sidecar filter the picker holds.",
            registry=self.registry,
        )
        self.event_pods = Gauge(
            "dscache_picker_event_pods",
            "Pods whose holdings the picker takes from their sidecar's KV events (in sync).",
            registry=self.registry,
        )
        self.filter_age = Gauge(
            "dscache_picker_filter_age_seconds",
            "Age of the oldest pod filter in use.",
            registry=self.registry,
        )


#: Words of a request that similarity looks at: its opening, where a conversation
#: is told apart from another (each later turn repeats it), at bounded cost.
SHINGLED_WORDS = 768


def shingles(
    text: str, words: int, domain_terms: Mapping[str, int], limit: int = SHINGLED_WORDS
) -> set[bytes]:
    """Word shingles of ``text``'s first ``limit`` words (lower-cased), plus weighted
    copies of the domain terms among them."""
    tokens = [m.group().lower() for m in itertools.islice(_WORD.finditer(text), limit)]
    out = {" ".join(tokens[i : i + words]).encode() for i in range(max(len(tokens) - words + 1, 1))}
    for token in domain_terms.keys() & set(tokens):
        out.update(f"\x00{token}\x00{i}".encode() for i in range(domain_terms[token]))
    out.discard(b"")
    return out


def request_text(body: Any) -> str:
    """The content words of a chat or completion request (empty for anything else)."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [str(m.get("content", "")) for m in messages if isinstance(m, dict)]
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


class Picker:
    """The decision logic and its state (thread-safe; see the module contract)."""

    def __init__(
        self,
        settings: PickerSettings,
        tokenizer: DeepSeekTokenizer,
        metrics: PickerMetrics | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics or PickerMetrics()
        self.clock = clock
        self.pieces = PieceCache()
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}
        self._perms = MinHash(num_perm=settings.num_perm, scheme="affine32").permutations
        self._lsh = (
            MinHashLSH(threshold=settings.similarity_threshold, num_perm=settings.num_perm)
            if settings.similarity_threshold > 0
            else None
        )
        self._sessions: OrderedDict[str, tuple[MinHash, str]] = OrderedDict()
        #: vLLM pods' GPU prefix caches, fed by an EventFeed without baselines.
        self.gpu = GpuTier(self.pods, following=self.metrics.gpu_pods.set)

    # -- what the pods hold -------------------------------------------------------

    def pods(self) -> list[str]:
        with self._lock:
            return list(self._pods)

    def know(self, addresses: Iterable[str]) -> None:
        """Tracks these pods (their facts come with the next refresh), seen now."""
        with self._lock:
            now = self.clock()
            for address in addresses:
                pod = self._pods.get(address)
                if pod is None:
                    pod = self._pods[address] = _Pod(address)
                pod.seen_at = now
            self.metrics.pods.set(len(self._pods))

    def forget_gone(self) -> list[str]:
        """Drops the pods no pick has named for ``forget_s`` (deleted or moved pods:
        their filters, keys and placements); returns their addresses."""
        forget = self.settings.forget_s
        with self._lock:
            cutoff = self.clock() - forget
            gone = [a for a, pod in self._pods.items() if pod.seen_at < cutoff]
            for address in gone:
                del self._pods[address]
            self.metrics.pods.set(len(self._pods))
        for address in gone:
            log.info("picker: forgot %s (no pick named it for %.0fs)", address, forget)
        return gone

    def set_keyinfo(self, address: str, root: bytes | None, block_tokens: int) -> None:
        with self._lock:
            pod = self._pods.setdefault(address, _Pod(address))
            pod.root, pod.block_tokens, pod.keyinfo_at = root, block_tokens, self.clock()

    def set_holdings(self, address: str, holdings: HoldingsFilter, etag: str | None = None) -> None:
        with self._lock:
            pod = self._pods.setdefault(address, _Pod(address))
            pod.holdings, pod.holdings_at = holdings, self.clock()
            pod.holdings_etag = etag

    def events_applied(self, address: str, events: list[dict[str, Any]], baseline: bool) -> bool:
        """Applies a pod's KV events (a baseline starts a new set); False when the
        set would pass ``max_event_keys`` (the pod then leaves the feed)."""
        with self._lock:
            pod = self._pods.get(address)
            if pod is None:
                return True
            if baseline:
                pod.events = set()
            held = pod.events
            if held is None:
                return True
            for event in events:
                kind = event.get("type")
                hashes = event.get("block_hashes") or ()
                if kind == "AllBlocksCleared":
                    held.clear()
                elif kind == "BlockStored":
                    held.update(h for h in hashes if isinstance(h, bytes))
                elif kind == "BlockRemoved":
                    held.difference_update(h for h in hashes if isinstance(h, bytes))
            if len(held) > self.settings.max_event_keys:
                pod.events = None
                self._count_event_pods()
                return False
            if baseline:  # only a baseline or a loss changes who is in sync
                self._count_event_pods()
            return True

    def _count_event_pods(self) -> None:
        self.metrics.event_pods.set(sum(p.events is not None for p in self._pods.values()))

    def events_lost(self, address: str) -> None:
        """The pod's feed is out of sync: its filter answers until a new baseline."""
        with self._lock:
            pod = self._pods.get(address)
            if pod is not None:
                pod.events = None
            self._count_event_pods()

    def holdings_url(self, address: str) -> str | None:
        explicit = self.settings.holdings.get(address)
        if explicit:
            return explicit
        if self.settings.holdings_port is None:
            return None
        host = address.rsplit(":", 1)[0]
        return f"http://{host}:{self.settings.holdings_port}{HOLDINGS_PATH}"

    # -- the decision -------------------------------------------------------------

    def pick(self, q: PickQuery) -> Pick:
        """Chooses a pod for ``q`` and records the choice."""
        started = time.perf_counter()
        self.know(c.address for c in q.pods)
        try:
            body = json.loads(q.body) if q.body else None
        except (ValueError, UnicodeDecodeError):
            body = None
        text = request_text(body)
        ids = None if q.credentials else self._token_ids(body)
        minhash = self._minhash(text) if text else None
        gpu: dict[str, int] = {}
        # A pin counts only where _choose honours it: a pod among the candidates.
        if ids and not any(c.address == q.pinned for c in q.pods):
            model = body.get("model") if isinstance(body, dict) else None
            roots = [root(None)] + ([root(model)] if isinstance(model, str) and model else [])
            gpu = self.gpu.held_tokens(ids, roots, (c.address for c in q.pods if q.eligible(c)))
        with self._lock:
            now = self.clock()
            chains: dict[tuple[bytes, int], list[bytes]] = {}  # pods of a track share one
            keys = {c.address: self._keys(c.address, ids, chains) for c in q.pods}
            choice = self._choose(
                q, keys, gpu, minhash, now, affinity=_affinity(body) if ids else ""
            )
            chosen = keys.get(choice.pod, [])
            self._record(choice.pod, chosen, q.key, minhash, now)
            choice = Pick(choice.pod, choice.reason, choice.blocks, choice.tier, tuple(chosen))
        self.metrics.decisions.labels(choice.reason).inc()
        if choice.reason == "prefix":
            self.metrics.matched.observe(choice.blocks)
            self.metrics.tiers.labels(choice.tier).inc()
        self.metrics.seconds.observe(time.perf_counter() - started)
        return choice

    def holder(
        self, q: HolderQuery, last_served: Callable[[Sequence[str]], str | None] | None = None
    ) -> str | None:
        """The pod holding this request's conversation: the longest cached prefix over
        ``q.pods`` (every live pod of every track), if that prefix reaches past the
        request's opening (its first ``q.lead_messages`` messages, what a prompt key
        hashes). Past the opening the blocks are the conversation's own history (its
        answers and later turns), which only the pods that served it hold; an opening
        alone (a shared document, a first turn) names no holder, so new sessions keep
        following the track weights.

        Where the blocks cannot tell (no pod holds a block past the opening: a short
        answer and question fit in the last block, which is not stored whole; or
        several pods hold the same longest prefix: conversations alike up to a point),
        ``last_served`` is asked for the pod that served the conversation's previous
        turn (by its :func:`~dscache.routing.previous_turn_keys`, the surer first; the
        pods' conversation ledgers, :mod:`dscache_router.locate`), and that pod takes
        it when it is one
        of the tied (or, with none, of ``q.pods``). Otherwise ties go to the pod this
        picker sent more such conversations to past the opening (the likelier home
        of one nothing else tells apart), then the first in ``q.pods``. The prompt's
        keys count as held there from now on, as a pick's do."""
        with self.metrics.holder_seconds.time():
            return self._holder(q, last_served)

    def _holder(
        self, q: HolderQuery, last_served: Callable[[Sequence[str]], str | None] | None
    ) -> str | None:
        if q.credentials:
            return None
        try:
            body = json.loads(q.body) if q.body else None
        except (ValueError, UnicodeDecodeError):
            return None
        lead = _opening(body, q.lead_messages)
        if lead is None:
            return None
        ids, lead_ids = self._token_ids(body), self._token_ids(lead)
        if not ids or lead_ids is None or len(ids) <= len(lead_ids):
            return None
        self.know(q.pods)
        chains: dict[tuple[bytes, int], list[bytes]] = {}
        with self._lock:
            now = self.clock()
            tied: list[tuple[_Pod, list[bytes], int]] = []
            most = len(lead_ids)
            for address in q.pods:
                pod = self._pods.get(address)
                if pod is None:
                    continue
                keys = self._keys(address, ids, chains)
                held = self._held(pod, keys, now)
                tokens = held * pod.block_tokens
                if tokens > most:
                    most, tied = tokens, []
                if tokens == most and most > len(lead_ids):
                    tied.append((pod, keys[:held], len(lead_ids) // pod.block_tokens))
        best = tied[0][0].address if len(tied) == 1 else None
        if best is None and last_served is not None:
            best = self._last_served(body, last_served, [p.address for p, _, _ in tied] or q.pods)
        with self._lock:
            if best is None:
                best = _most_placed(tied)
            if best is not None and best in self._pods:
                self._record(best, self._keys(best, ids, chains), "", None, self.clock())
        self.metrics.holders.labels("found" if best else "unknown").inc()
        return best

    def _last_served(
        self, body: Any, last_served: Callable[[Sequence[str]], str | None], among: Sequence[str]
    ) -> str | None:
        """The pod of ``among`` that served this conversation's previous turn, by the
        pods' conversation ledgers (None: none of them, or no previous turn)."""
        keys = previous_turn_keys(body["messages"])
        if not keys:
            return None
        pod = last_served(keys)
        found = pod is not None and pod in among
        self.metrics.conversations.labels("found" if found else "unknown").inc()
        return pod if found else None

    def moved(self, key: str, picked: str, address: str, keys: Sequence[bytes]) -> None:
        """Another pod than the one picked served the request (a gateway's fallback):
        its blocks count as held at ``address``, no longer at ``picked``, and the
        session's similarity entry points there."""
        self.know([address])
        with self._lock:
            was = self._pods.get(picked)
            if was is not None:
                for k in keys:
                    was.recent.pop(k, None)
                    was.placed.pop(k, None)
            self._record(address, keys, "", None, self.clock())
            entry = self._sessions.get(key)
            if entry is not None:
                self._sessions[key] = (entry[0], address)

    def _token_ids(self, body: Any) -> list[int] | None:
        if not isinstance(body, dict):
            return None
        try:
            messages = body.get("messages")
            if isinstance(messages, list):
                chat = [ChatMessage(str(m["role"]), str(m.get("content", ""))) for m in messages]
                return self.tokenizer.apply_chat_template(chat, pieces=self.pieces)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
        except (TemplateError, KeyError, TypeError, ValueError):
            return None
        return None

    def _minhash(self, text: str) -> MinHash | None:
        if self._lsh is None:
            return None
        s = self.settings
        # xxh32 of each shingle (a C call; datasketch's default, SHA-1 through a Python
        # wrapper, was a third of a decision) and one set of permutations for all.
        m = MinHash(
            num_perm=s.num_perm,
            hashfunc=xxhash.xxh32_intdigest,
            permutations=self._perms,
            scheme="affine32",
        )
        m.update_batch(list(shingles(text, s.shingle_words, s.domain_terms)))
        return m

    def _keys(
        self,
        address: str,
        ids: list[int] | None,
        chains: dict[tuple[bytes, int], list[bytes]],
    ) -> list[bytes]:
        pod = self._pods.get(address)
        if ids is None or pod is None or pod.root is None or pod.block_tokens <= 0:
            return []
        chain = (pod.root, pod.block_tokens)
        if chain not in chains:
            chains[chain] = block_keys(pod.root, ids, pod.block_tokens)
        return chains[chain]

    def _held(self, pod: _Pod, keys: Sequence[bytes], now: float) -> int:
        n = 0
        for key in keys:
            expiry = pod.recent.get(key)
            if expiry is None or expiry < now:
                if pod.events is not None:
                    if key not in pod.events:
                        break
                elif pod.holdings is None or key not in pod.holdings:
                    break
            n += 1
        return n

    def _choose(
        self,
        q: PickQuery,
        keys: Mapping[str, list[bytes]],
        gpu: Mapping[str, int],
        minhash: MinHash | None,
        now: float,
        *,
        affinity: str = "",
    ) -> Pick:
        """Pinned, else the longest prefix in tokens over both tiers (a tie: the GPU,
        where a hit costs no load; then, with an ``affinity``, the pod it hashes
        highest with (:func:`_affinity`), else the ring order), else similar, else
        hash."""
        addresses = {c.address for c in q.pods}
        if q.pinned and q.pinned in addresses:
            return Pick(q.pinned, "pinned")
        eligible = [c for c in q.pods if q.eligible(c)]
        best: tuple[int, int] | None = None  # (tokens, 1 for the GPU tier)
        choice: Pick | None = None
        rank = -1  # the store tier's tied pods: the affinity's highest rank wins
        for c in eligible:
            pod = self._pods[c.address]
            held = self._held(pod, keys.get(c.address, []), now)
            if held >= self.settings.min_blocks:
                score = (held * max(pod.block_tokens, 1), 0)
                mine = xxhash.xxh64_intdigest(f"{affinity} {c.address}".encode()) if affinity else 0
                if best is None or score > best or (score == best and mine > rank):
                    best, choice, rank = score, Pick(c.address, "prefix", held), mine
            tokens = gpu.get(c.address, 0)
            if tokens >= self.settings.gpu_min_tokens and tokens > 0:
                score = (tokens, 1)
                if best is None or score > best:
                    size = self.gpu.block_size(c.address) or 1
                    best, choice = score, Pick(c.address, "prefix", tokens // size, "gpu")
        if choice is not None:
            return choice
        similar = self._similar(minhash, {c.address for c in eligible})
        if similar is not None:
            return Pick(similar, "similar")
        if eligible:
            return Pick(eligible[0].address, "hash")
        return Pick(q.pods[0].address, "overloaded")

    def _similar(self, minhash: MinHash | None, eligible: set[str]) -> str | None:
        if minhash is None or self._lsh is None or not eligible:
            return None
        best: tuple[float, str] | None = None
        for other in self._lsh.query(minhash):
            entry = self._sessions.get(other)
            if entry is None or entry[1] not in eligible:
                continue
            score = minhash.jaccard(entry[0])
            if score >= self.settings.similarity_threshold and (best is None or score > best[0]):
                best = (score, entry[1])
        return best[1] if best else None

    def _record(
        self, address: str, keys: Sequence[bytes], key: str, minhash: MinHash | None, now: float
    ) -> None:
        pod = self._pods.get(address)
        if pod is not None and keys:
            expiry = now + self.settings.memory_s
            placed = pod.placed
            for k in keys:
                pod.recent[k] = expiry
                pod.recent.move_to_end(k)
                placed[k] = placed.get(k, 0) + 1
            while len(pod.recent) > self.settings.max_memory_keys:
                placed.pop(pod.recent.popitem(last=False)[0], None)
        if minhash is None or self._lsh is None or not key:
            return
        if key in self._sessions:
            self._lsh.remove(key)
            del self._sessions[key]
        self._lsh.insert(key, minhash)
        self._sessions[key] = (minhash, address)
        while len(self._sessions) > self.settings.max_sessions:
            old, _ = self._sessions.popitem(last=False)
            self._lsh.remove(old)

    # -- refreshing the pods' facts -------------------------------------------------

    def refresh(self, client: httpx.Client) -> None:
        """Forgets the pods that are gone, then fetches each known pod's keyinfo
        (until known) and holdings filter once."""
        self.forget_gone()
        now = self.clock()
        for address in self.pods():
            with self._lock:
                pod = self._pods.get(address)
                if pod is None:
                    continue
                need_info = pod.root is None and now - pod.keyinfo_at > 5.0
            if need_info:
                self._fetch_keyinfo(client, address)
            url = self.holdings_url(address)
            if url is not None:
                self._fetch_holdings(client, address, url)
        with self._lock:
            done = self.clock()
            ages = [done - p.holdings_at for p in self._pods.values() if p.holdings is not None]
        self.metrics.filters.set(len(ages))
        self.metrics.filter_age.set(max(ages) if ages else 0.0)

    def _headers(self, etag: str | None = None) -> dict[str, str]:
        headers = {"If-None-Match": etag} if etag else {}
        if self.settings.internal_token:
            headers[INTERNAL_TOKEN_HEADER] = self.settings.internal_token
        return headers

    def _fetch_keyinfo(self, client: httpx.Client, address: str) -> None:
        try:
            status, body, _ = _bounded_get(
                client, f"http://{address}{KEYINFO_PATH}", self._headers(), MAX_KEYINFO_BYTES
            )
            if status != 200:
                raise ValueError(f"HTTP {status}")
            info = json.loads(body)
            root = bytes.fromhex(info["root"]) if info.get("root") else None
            self.set_keyinfo(address, root, int(info["block_tokens"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.metrics.fetch_errors.labels("keyinfo").inc()
            with self._lock:
                pod = self._pods.get(address)
                if pod is not None:
                    pod.keyinfo_at = self.clock()
            log.debug("picker: no keyinfo from %s: %s", address, exc)

    def _fetch_holdings(self, client: httpx.Client, address: str, url: str) -> None:
        with self._lock:
            pod = self._pods.get(address)
            if pod is None:
                return
            etag = pod.holdings_etag if pod.holdings is not None else None
        try:
            status, body, etag_now = _bounded_get(
                client, url, self._headers(etag), MAX_FILTER_BYTES
            )
            if status == 304:  # the filter held is the pod's current one
                with self._lock:
                    pod.holdings_at = self.clock()
                return
            if status != 200:
                raise ValueError(f"HTTP {status}")
            holdings = HoldingsFilter.from_bytes(body)
        except (httpx.HTTPError, ValueError) as exc:  # HoldingsFormatError included
            self.metrics.fetch_errors.labels("holdings").inc()
            log.debug("picker: no holdings from %s: %s", url, exc)
            return
        self.set_holdings(address, holdings, etag_now)


#: Largest key info the picker reads (it is a few hundred bytes).
MAX_KEYINFO_BYTES = 64 << 10


def _bounded_get(
    client: httpx.Client, url: str, headers: Mapping[str, str], limit: int
) -> tuple[int, bytes, str | None]:
    """GET ``url``: (status, body, ETag), reading at most ``limit`` bytes of the body;
    ValueError for a longer one (the rest is never read: the connection is closed)."""
    with client.stream("GET", url, headers=headers) as r:
        declared = r.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ValueError(f"a body of {declared} bytes is over the {limit}-byte limit")
        buf = bytearray()
        for chunk in r.iter_bytes():
            buf += chunk
            if len(buf) > limit:
                raise ValueError(f"a body over the {limit}-byte limit")
        return r.status_code, bytes(buf), r.headers.get("ETag")


class Refresher:
    """A daemon thread running :meth:`Picker.refresh` every ``refresh_s``."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="picker-refresh", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        timeout = self.picker.settings.fetch_timeout_s
        with httpx.Client(timeout=timeout) as client:
            while not self._stop.is_set():
                try:
                    self.picker.refresh(client)
                except Exception:  # a refresh must never end the thread
                    log.exception("picker: refresh failed")
                self._stop.wait(self.picker.settings.refresh_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
