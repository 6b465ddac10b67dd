"""``chain``: eviction that knows prefix chains and conversations.

Why: a cached block is worth something only while every block before it is
cached (a lookup counts leading blocks), and in multi-turn chat a block is
reused when its conversation's next turn arrives, a think time later, or never.
Recency policies treat blocks as independent and keep whatever was touched
last; at a small store that is mostly tails of conversations that will not
come back. This policy keeps chains whole and ranks them by how likely, and
how soon, their conversation returns.

Contract (beyond :mod:`dscache_sidecar.eviction`'s, which it honours):

* Structure: ``admit(key, size, parent)`` records the chain. Only *leaves* (held
  blocks with no held child) are ever victims, so a parent never leaves before
  its children and the policy itself never strands a child (callers still
  cascade on deletes). Blocks may be admitted deepest first (the store and the
  replayer do) or root first.
* Prediction (analytic, learned online): every block has a *class*: the
  conversation turn that wrote it (1 to 5, 6+: a new segment under a block
  with at most two held children continues that block's conversation; under a
  busier block, a template, it starts one; a hit walk up the chain raises its
  blocks to the turn), the conversation's last gap between turns (none,
  < 30 s, < 2 min, < 10 min, longer), and the last serving signal (none,
  ``ended``, ``expected``) or *passed over* (its parent was used since,
  without it: a branch its conversation left, expected or not). Per class the policy learns how
  long after its last use a block is used again, or that it is not: a
  histogram over log-spaced ages of the reuses it sees (hits, and
  re-admissions of keys it evicted, remembered in a bounded ghost list), and
  every eviction counted as "not reused" until the key comes back. From it,
  the *hit density* of a block of age ``a``: the best, over how much longer it
  is kept, of expected hits over expected block-seconds held (Beckmann et
  al.'s LHD, NSDI 2018, here over wall time and with the ghost list, so that
  reuses longer than the cache's own lifetime are seen). Victims come from
  ``samples`` leaves drawn at random (seeded), or from all leaves when there
  are no more than that.
* Signals from the serving path (:meth:`ChainPolicy.signal`, optional): ``ended``
  and ``expected`` mark a conversation's own blocks (its chain up to the first
  block with three or more held children, a shared template): ``ended`` blocks
  are the first victims (oldest first), ``expected`` ones are a class of their
  own (the density ranking learns what they are worth; the recency ranking
  takes them last); ``queued`` keeps a chain out of eviction until it is used
  or ``ttl_s`` pass. A block's next use clears its signal. Without signals the
  policy works on structure and time alone.
* Two rankings, one victim: the sampled leaf of lowest density, and the least
  recently used leaf of all (a lazy heap); when they differ, the density one
  wins with a share set by comparing the policy's own hits with those of a
  shadow LRU (keys only, as many as the capacity hint), judged every 2,048
  hits (sooner at first): up while it does better than LRU by more than 3%
  (leaf order alone can beat plain LRU by a little), down when it does worse
  by more than 1%, so a recency-friendly workload
  ends up ranked mostly by recency (LRU's order among leaves).
* Time comes from the injected ``clock`` (seconds, monotonic; the store's clock,
  or the trace's timestamps in the replayer).
* Cost: ``admit`` and ``remove`` are O(1), ``access`` O(log n) for a leaf (the
  heap); ``victim`` looks at ``samples`` leaves; the density tables are
  recomputed (numpy, classes x age bins squared, for the classes that saw
  anything) every ``max(1024, capacity_hint // 2)`` learning events. Memory:
  the ghost list holds ``max(8 x capacity_hint, 65,536)`` keys, at most 2**20;
  the shadow LRU as many as the capacity hint, at most 2**18 (a hashed sample
  of the keys beyond that).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Literal, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)

#: Serving-path signals the policy understands.
SignalKind = Literal["ended", "expected", "queued"]
SIGNAL_KINDS: tuple[str, ...] = ("ended", "expected", "queued")

_TURNS = 6
_GAP_EDGES_S = (30.0, 120.0, 600.0)  # gap classes: none, <30 s, <2 min, <10 min, longer
_GAPS = len(_GAP_EDGES_S) + 2
_SIGNALS = 4  # none, ended, expected, passed over (its parent was used without it)
_CLASSES = _TURNS * _GAPS * _SIGNALS
_ENDED, _EXPECTED, _PASSED = 1, 2, 3

#: Age bins: three per doubling of ``_UNIT_S`` (0.05 s to 4 days); the last one is "older".
_BINS = 64
_UNIT_S = 0.05
_PER_OCTAVE = 3.0
#: At most this many keys in the ghost list, and in the shadow LRU (sampled beyond).
_MAX_HISTORY = 2**20
_MAX_SHADOW = 2**18
#: A branch point with this many held children is shared (a template), not a conversation.
_SHARED_FANOUT = 3
#: Hits (the policy's plus the shadow LRU's) between two judgements of the share.
_JUDGE_EVERY = 2048
#: Two touches closer than this are one request (the store's lease, then its commit).
_SAME_REQUEST_S = 1.0


def _age_bin(age_s: float) -> int:
    if age_s <= 0.0:
        return 0
    b = int(math.log2(1.0 + age_s / _UNIT_S) * _PER_OCTAVE)
    return b if b < _BINS else _BINS - 1


def _gap_class(gap_s: float) -> int:
    for i, edge in enumerate(_GAP_EDGES_S):
        if gap_s < edge:
            return 1 + i
    return _GAPS - 1


class _Block:
    __slots__ = (
        "gap",
        "gapc",
        "kids",
        "last",
        "leaf",
        "orphan",
        "parent",
        "signal",
        "turn",
        "until",
    )

    def __init__(self, parent: Any, now: float) -> None:
        self.parent = parent
        self.kids = 0
        self.leaf = -1  # index in the leaf list, -1 when not a leaf
        self.last = now
        self.turn = 1
        self.gapc = 0
        self.gap = 0.0
        self.signal = 0
        self.until = 0.0  # queued: kept out of eviction until then
        self.orphan = False  # admitted while its parent was not held

    def cls(self, passed: bool = False) -> int:
        signal = _PASSED if passed and self.signal != _ENDED else self.signal
        return ((min(self.turn, _TURNS) - 1) * _GAPS + self.gapc) * _SIGNALS + signal


_PRIOR_TABLES: dict[tuple[int, int], list[list[float]]] = {}


class ReuseModel:
    """Per-class reuse-age histograms and the hit-density tables derived from them.

    ``observe(cls, age_s)`` counts a reuse ``age_s`` after the last use;
    ``never(cls)`` a block that was not reused within the ghost list's memory.
    ``density(cls, age_s)`` reads the table of the last :meth:`refresh`.
    """

    def __init__(self, classes: int = _CLASSES, bins: int = _BINS) -> None:
        self._bins = bins
        edges = np.array([_UNIT_S * (2.0 ** (j / _PER_OCTAVE) - 1.0) for j in range(bins + 1)])
        edges[-1] = edges[-2] * 2.0  # the "older" bin
        self._edges = edges
        self._mid = (edges[:-1] + edges[1:]) / 2.0
        # Prior: one pseudo-reuse spread evenly over the log bins (a reuse rate
        # falling with age, so an unknown class ranks like LRU) and one never.
        self._prior = np.full(bins, 1.0 / bins)
        self._upto = np.triu(np.ones((bins, bins), dtype=bool))[None, :, :]  # j >= i
        self.hist = np.zeros((classes, bins))
        self.unused = np.zeros(classes)
        key = (classes, bins)
        prior = _PRIOR_TABLES.get(key)
        self._table: list[list[float]] = []
        if prior is None:  # the same for every new model: computed once
            self.refresh()
            prior = _PRIOR_TABLES[key] = self._table
        self._table = [list(row) for row in prior]

    def observe(self, cls: int, age_s: float) -> None:
        self.hist[cls, _age_bin(age_s)] += 1.0

    def never(self, cls: int, count: float = 1.0) -> None:
        self.unused[cls] = max(0.0, self.unused[cls] + count)

    def density(self, cls: int, age_s: float) -> float:
        return self._table[cls][_age_bin(age_s)]

    @property
    def table(self) -> list[list[float]]:
        """Density per class and age bin (read-only by contract; rebuilt on refresh)."""
        return self._table

    def decay(self, factor: float) -> None:
        self.hist *= factor
        self.unused *= factor

    def refresh(self) -> None:
        """Recomputes every class's hit density per age bin from the histograms."""
        edges, mid = self._edges, self._mid
        start = edges[:-1]  # age at the start of each bin
        # Only classes that saw anything: the others keep the prior's table.
        active = np.flatnonzero((self.hist.sum(axis=1) + self.unused) > 0)
        if not self._table or len(self._table) != self.hist.shape[0]:
            active = np.arange(self.hist.shape[0])
        if active.size == 0:
            return
        p = self.hist[active] + self._prior  # (classes, bins)
        never = self.unused[active] + 1.0
        zero = np.zeros((p.shape[0], 1))
        c = np.concatenate((zero, np.cumsum(p, axis=1)), axis=1)
        cm = np.concatenate((zero, np.cumsum(p * mid, axis=1)), axis=1)
        # [class, i, j]: reuses in bins i..j, and the expected block-seconds from
        # age start[i] until the reuse or the end of bin j.
        hits = c[:, None, 1:] - c[:, :-1, None]
        reuse_time = (cm[:, None, 1:] - cm[:, :-1, None]) - start[None, :, None] * hits
        alive = (c[:, -1] + never)[:, None, None] - c[:, :-1, None] - hits
        held = reuse_time + alive * (edges[None, None, 1:] - start[None, :, None])
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(self._upto & (held > 0), hits / held, 0.0)
        rows = ratio.max(axis=2).tolist()
        if len(self._table) != self.hist.shape[0]:
            self._table = rows
            return
        for cls, row in zip(active.tolist(), rows, strict=True):
            self._table[cls] = row


class ChainPolicy(Generic[K]):
    """Leaf-first eviction ranked by learned hit density per conversation class."""

    name: str = "chain"
    #: The store skips its "touch ancestors after a commit" habit for this policy:
    #: order comes from the chain, and a second touch would count as a reuse.
    chain_aware: bool = True

    def __init__(
        self,
        capacity_hint: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
        samples: int = 32,
        seed: int = 29,
        decay: float = 0.9,
        ghost_factor: int = 8,
    ) -> None:
        if capacity_hint < 0:
            raise ValueError(f"capacity_hint must be >= 0 blocks, got {capacity_hint}")
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self._clock = clock
        self._samples = samples
        self._rng = random.Random(seed)
        self._blocks: dict[K, _Block] = {}
        self._leaves: list[K] = []
        self._waiting: dict[object, int] = {}  # absent parent -> children held
        self._pending: list[_Block] = []  # a run admitted deepest first, parent not yet held
        self._pending_parent: object = None
        self._run_key: object = None  # the key the current chain walk touches next
        self._run_turn = 1
        # key -> (class, last use)
        self._ghost: OrderedDict[K, tuple[int, float]] = OrderedDict()
        self._share = 1.0
        self._judged = 0
        self._shadow: OrderedDict[K, None] = OrderedDict()
        self._by_age: list[tuple[float, int, K]] = []  # leaves by last use (lazy heap)
        self._seq = itertools.count()
        self._hits = [0.0, 0.0]  # this policy's, the shadow LRU's (decayed)
        self.model = ReuseModel()
        self._events = 0
        self._decay = decay
        self._ghost_factor = ghost_factor
        self._set_sizes(capacity_hint)

    def _set_sizes(self, capacity_hint: int) -> None:
        hint = max(1, capacity_hint)
        self._ghost_max = min(_MAX_HISTORY, max(self._ghost_factor * hint, 65536))
        self._refresh_every = max(1024, hint // 2)
        # A big store's shadow LRU follows a sample of the keys (1 in ``_sample``,
        # by hash) in a proportionally smaller LRU, as SHARDS does (Waldspurger et
        # al., ATC 2017), and compares its hits with this policy's on the same keys.
        self._sample = max(1, hint // _MAX_SHADOW)
        self._shadow_max = max(1, hint // self._sample)

    def resize(self, capacity_hint: int) -> None:
        """Follows the store's capacity estimate (ghost size, refresh period)."""
        if capacity_hint < 0:
            raise ValueError(f"capacity_hint must be >= 0 blocks, got {capacity_hint}")
        self._set_sizes(capacity_hint)
        while len(self._ghost) > self._ghost_max:
            self._ghost.popitem(last=False)
        while len(self._shadow) > self._shadow_max:
            self._shadow.popitem(last=False)

    # ------------------------------------------------------------------ membership

    def admit(self, key: K, size: int = 1, parent: K | None = None) -> None:
        if key in self._blocks:
            self.access(key)
            return
        now = self._clock()
        ghost = self._ghost.pop(key, None)
        if ghost is not None:  # it came back after all
            cls, last = ghost
            self.model.never(cls, -1.0)
            self._learn(cls, now - last)
        if self._sample == 1 or hash(key) % self._sample == 0:
            self._shadow_touch(key, parent)
        rec = _Block(parent, now)
        rec.kids = self._waiting.pop(key, 0)
        self._blocks[key] = rec
        if rec.kids == 0:
            self._add_leaf(key, rec)
        pending = self._pending
        if pending and self._pending_parent != key:
            self._resolve(None)  # the run above did not continue here
        if parent is None:
            pending.append(rec)
            self._resolve(None)
            return
        prec = self._blocks.get(parent)
        if prec is None:
            rec.orphan = True
            self._waiting[parent] = self._waiting.get(parent, 0) + 1
            pending.append(rec)
            self._pending_parent = parent
            return
        prec.kids += 1
        if prec.leaf >= 0:
            self._drop_leaf(prec)
        pending.append(rec)
        self._resolve(prec, parent)

    def _resolve(self, parent: _Block | None, parent_key: object = None) -> None:
        """Gives the pending run its turn and gap: it continues ``parent``'s
        conversation, or starts one (no parent, or a shared one)."""
        turn, gapc, gap = 1, 0, 0.0
        if parent is not None and parent.kids < _SHARED_FANOUT:
            now = self._clock()
            turn = parent.turn + 1
            # The parent was touched in this request already (the store leases
            # before it commits): its gap is the one it recorded then.
            gap = parent.gap if now - parent.last < _SAME_REQUEST_S else now - parent.last
            gapc = _gap_class(gap) if gap > 0 else 0
        for rec in self._pending:
            rec.turn, rec.gapc, rec.gap = turn, gapc, gap
        self._pending = []
        self._pending_parent = None
        # The blocks above take the conversation's new turn as they are touched.
        self._run_key = parent_key
        self._run_turn = turn

    def access(self, key: K) -> None:
        rec = self._blocks.get(key)
        if rec is None:
            return
        now = self._clock()
        age = now - rec.last
        if self._sample == 1 or hash(key) % self._sample == 0:
            self._hits[0] += 1.0
            self._shadow_touch(key, rec.parent)
        self._judge()
        if age >= _SAME_REQUEST_S:
            self._learn(self._cls(rec), age)
            rec.gap = age
            rec.gapc = _gap_class(age)
        if key == self._run_key:  # the chain of the request just admitted or touched
            rec.turn = max(rec.turn, self._run_turn)
        else:
            self._run_turn = rec.turn
        self._run_key = rec.parent
        rec.signal = 0
        rec.until = 0.0
        rec.last = now
        if rec.leaf >= 0:
            heapq.heappush(self._by_age, (now, next(self._seq), key))

    def remove(self, key: K) -> None:
        rec = self._blocks.pop(key, None)
        if rec is not None:
            self._gone(rec)

    def victim(self) -> K | None:
        leaves = self._leaves
        n = len(leaves)
        if n == 0:
            if self._blocks:  # unreachable while the bookkeeping holds; never strand keys
                key = next(iter(self._blocks))
                self._gone(self._blocks.pop(key))
                return key
            return None
        now = self._clock()
        if n <= self._samples:
            sample = leaves
        else:
            rnd = self._rng.random
            sample = [leaves[int(rnd() * n)] for _ in range(self._samples)]
        by_density, by_recency = self._rank(sample, now)
        assert by_density is not None and by_recency is not None
        if self._blocks[by_recency].signal != _ENDED:  # else an ended leaf goes first
            oldest = self._oldest_leaf()
            if oldest is not None and self._blocks[oldest].until <= now:
                by_recency = oldest
        if by_density == by_recency or self._rng.random() < self.density_share():
            best = by_density
        else:
            best = by_recency
        rec = self._blocks.pop(best)
        self._remember(best, rec)
        self._gone(rec)
        return best

    def _rank(self, sample: list[K], now: float) -> tuple[K | None, K | None]:
        """The sampled leaf of lowest density, and the least recent one.

        The class and age bin are computed inline (as ``_cls`` and ``_age_bin``):
        this loop is most of the policy's cost.
        """
        blocks, table = self._blocks, self.model.table
        by_density: K | None = None
        by_recency: K | None = None
        best_d = best_r = (math.inf, math.inf)
        log2, unit, per_octave, last_bin = math.log2, _UNIT_S, _PER_OCTAVE, _BINS - 1
        for key in sample:
            rec = blocks[key]
            last = rec.last
            signal = rec.signal
            if rec.until > now:  # queued: kept
                d = r = math.inf
            elif signal == _ENDED:  # the client closed it: first to go
                d = r = -1.0
            else:
                if rec.parent is not None:
                    # Passed over: its conversation went on without it (an expected
                    # turn came, took another branch): no longer expected either.
                    parent = blocks.get(rec.parent)
                    if parent is not None and parent.last > last + _SAME_REQUEST_S:
                        signal = _PASSED
                r = 2.0 if signal == _EXPECTED else 1.0
                turn = rec.turn if rec.turn < _TURNS else _TURNS
                cls = ((turn - 1) * _GAPS + rec.gapc) * _SIGNALS + signal
                age = now - last
                b = int(log2(1.0 + age / unit) * per_octave) if age > 0.0 else 0
                d = table[cls][b if b < last_bin else last_bin]
            if (d, last) < best_d:
                by_density, best_d = key, (d, last)
            if (r, last) < best_r:
                by_recency, best_r = key, (r, last)
        return by_density, by_recency

    def density_share(self) -> float:
        """How often the density ranking decides when the two rankings disagree.

        Starts at 1. A shadow LRU (keys only, as many as the capacity hint)
        counts the hits plain LRU would have had, and :meth:`_judge` moves the
        share towards whichever does better, so a workload where the learned
        model does not pay (short chats, recency-friendly) ends up ranked by
        recency among leaves, which is LRU's order.
        """
        return self._share

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    # ------------------------------------------------------------------ signals

    def signal(self, keys: Sequence[K], kind: str, ttl_s: float = 60.0) -> int:
        """Applies a serving-path signal to a chain (root first); returns blocks marked.

        ``ended``/``expected``: the conversation's own blocks, from the deepest
        held key of ``keys`` up to the first shared block; ``queued``: every
        held key of ``keys``, kept for ``ttl_s`` or until used.

        Raises:
            ValueError: on an unknown kind or a negative ``ttl_s``.
        """
        if kind not in SIGNAL_KINDS:
            raise ValueError(f"unknown signal {kind!r}; known: {', '.join(SIGNAL_KINDS)}")
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        blocks = self._blocks
        if kind == "queued":
            until = self._clock() + ttl_s
            marked = 0
            for key in keys:
                rec = blocks.get(key)
                if rec is None:
                    break
                rec.until = until
                marked += 1
            return marked
        code = _ENDED if kind == "ended" else _EXPECTED
        marked = 0
        for key in reversed(keys):
            rec = blocks.get(key)
            if rec is None:
                if marked:
                    break
                continue
            if rec.kids >= _SHARED_FANOUT:
                break
            rec.signal = code
            marked += 1
        return marked

    # ------------------------------------------------------------------ internals

    def _shadow_touch(self, key: K, parent: Any) -> None:
        """The shadow LRU sees every admit and hit; counts the hits it would have had
        (a key whose parent it no longer holds would not have hit: prefix rule)."""
        shadow = self._shadow
        if key in shadow:
            sampled_parent = self._sample == 1 or hash(parent) % self._sample == 0
            if parent is None or parent in shadow or not sampled_parent:
                self._hits[1] += 1.0
            shadow.move_to_end(key)
            return
        shadow[key] = None
        if len(shadow) > self._shadow_max:
            shadow.popitem(last=False)

    def _cls(self, rec: _Block) -> int:
        parent = self._blocks.get(rec.parent) if rec.parent is not None else None
        return rec.cls(parent is not None and parent.last > rec.last + _SAME_REQUEST_S)

    def _learn(self, cls: int, age_s: float) -> None:
        self.model.observe(cls, age_s)
        self._events += 1
        if self._events >= self._refresh_every:
            self._events = 0
            self.model.refresh()
            self.model.decay(self._decay)

    def _judge(self) -> None:
        """Every ``_JUDGE_EVERY`` hits (own or the shadow's; 256, 512, ... at
        first): the share moves a quarter towards density when the policy's hits
        beat the shadow LRU's by more than 3%, a quarter towards recency when
        they fall behind by more than 1%."""
        own, lru = self._hits
        if own + lru < min(_JUDGE_EVERY, 256 << self._judged):
            return
        self._judged += 1
        if own > 1.03 * lru:
            self._share = min(1.0, self._share + 0.25)
        elif own < 0.99 * lru:
            self._share = max(0.0, self._share - 0.25)
        self._hits = [own * 0.5, lru * 0.5]

    def _remember(self, key: K, rec: _Block) -> None:
        ghost = self._ghost
        cls = self._cls(rec)
        ghost[key] = (cls, rec.last)
        # Counted as unused now, taken back if it returns: waiting for the ghost
        # list to forget it would leave the first minutes without any "never".
        self.model.never(cls)
        if len(ghost) > self._ghost_max:
            ghost.popitem(last=False)

    def _add_leaf(self, key: K, rec: _Block) -> None:
        rec.leaf = len(self._leaves)
        self._leaves.append(key)
        heapq.heappush(self._by_age, (rec.last, next(self._seq), key))

    def _oldest_leaf(self) -> K | None:
        """The least recently used leaf (exact: a heap of leaves by last use, stale
        entries dropped as they surface and the heap rebuilt when mostly stale)."""
        heap, blocks = self._by_age, self._blocks
        if len(heap) > 4 * len(self._leaves) + 1024:
            self._by_age = heap = [(blocks[k].last, next(self._seq), k) for k in self._leaves]
            heapq.heapify(heap)
        while heap:
            last, _, key = heap[0]
            rec = blocks.get(key)
            if rec is not None and rec.leaf >= 0 and rec.last == last:
                return key
            heapq.heappop(heap)
        return None

    def _drop_leaf(self, rec: _Block) -> None:
        leaves, i = self._leaves, rec.leaf
        last = leaves.pop()
        if i < len(leaves):
            leaves[i] = last
            self._blocks[last].leaf = i
        rec.leaf = -1

    def _gone(self, rec: _Block) -> None:
        """Bookkeeping after ``rec`` left: its leaf slot, its parent's child count."""
        if rec.leaf >= 0:
            self._drop_leaf(rec)
        if rec in self._pending:
            self._pending.remove(rec)
        parent = rec.parent
        if parent is None:
            return
        prec = self._blocks.get(parent)
        if prec is not None:
            prec.kids -= 1
            if prec.kids == 0:
                self._add_leaf(parent, prec)
        elif rec.orphan:
            left = self._waiting.get(parent, 0) - 1
            if left > 0:
                self._waiting[parent] = left
            else:
                self._waiting.pop(parent, None)
