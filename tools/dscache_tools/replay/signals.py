"""The serving-path signals of a replay, derived from the trace.

A trace has no session ids and no "session ended" events, so a replay that
tests what signals are worth has to say what the model server would have known.
This module derives it, and the assumptions are the contract:

* ``ended`` / ``expected``: sent after a request is served, by a client that
  knows whether its conversation goes on (an application that closes its
  session, or an agent that will call again). Request ``u`` *continues* ``t``
  when ``u``'s longest prefix seen before ends exactly at ``t``'s last full
  block (the next turn of a conversation resends the whole previous prompt);
  ``t`` then gets ``expected``, else ``ended``. This is hindsight: the share
  of clients that send it is ``coverage`` (drawn per request, seeded), and a
  coverage of 1 is an upper bound on what these signals can give.
* ``queued``: a request that arrives within ``queue_s`` seconds after the one
  being served is waiting in the server's queue, and the server tells the
  sidecar about its prefix then, kept until it is served (its window plus a
  second at most; the router and the server know their queue: no hindsight).

:func:`derive` returns, per request, the signals to deliver before it is
served (queued) and after (ended/expected); the simulation applies them to
policies that take signals (:class:`~dscache_sidecar.eviction.Signalled`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from dscache_tools.replay.trace import Trace

#: Signals a replay can derive.
KINDS = ("ended", "expected", "queued")


@dataclass(frozen=True, slots=True)
class SignalPlan:
    """Signals per request index: ``before[t]`` lists the requests whose prefix is
    queued when ``t`` is served; ``after[t]`` is ``ended``, ``expected`` or ``""``."""

    kinds: tuple[str, ...]
    before: list[list[int]] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    queue_s: float = 2.0

    @property
    def label(self) -> str:
        return ",".join(self.kinds)


def continues(trace: Trace) -> list[bool]:
    """For each request, whether a later request continues its conversation."""
    seen: set[int] = set()
    tail_of: dict[int, int] = {}  # last full block -> the request that ended there
    out = [False] * len(trace.requests)
    for t, req in enumerate(trace.requests):
        ids = req.blocks
        h = 0
        while h < len(ids) and ids[h] in seen:
            h += 1
        if h:
            prev = tail_of.get(ids[h - 1])
            if prev is not None:
                out[prev] = True
        seen.update(ids)
        if req.last_full >= 0:
            tail_of[ids[req.last_full]] = t
    return out


def derive(
    trace: Trace,
    kinds: Sequence[str],
    *,
    coverage: float = 1.0,
    queue_s: float = 2.0,
    seed: int = 0,
) -> SignalPlan:
    """The signals of ``kinds`` a serving path would send while ``trace`` is served.

    Raises:
        ValueError: on an unknown kind, a coverage outside [0, 1] or a negative
            ``queue_s``.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown signal {', '.join(unknown)}; known: {', '.join(KINDS)}")
    if not 0.0 <= coverage <= 1.0:
        raise ValueError(f"signal coverage must be in [0, 1], got {coverage}")
    if queue_s < 0:
        raise ValueError(f"queue window must be >= 0 s, got {queue_s}")
    reqs = trace.requests
    n = len(reqs)
    before: list[list[int]] = [[] for _ in range(n)]
    after = [""] * n
    session_kinds = [k for k in kinds if k in ("ended", "expected")]
    if session_kinds:
        rng = random.Random(f"signals/{seed}")
        goes_on = continues(trace)
        for t in range(n):
            if rng.random() >= coverage:
                continue
            kind = "expected" if goes_on[t] else "ended"
            if kind in session_kinds:
                after[t] = kind
    if "queued" in kinds and queue_s > 0:
        nxt = 1
        for t in range(n):
            nxt = max(nxt, t + 1)
            while nxt < n and reqs[nxt].time_s <= reqs[t].time_s + queue_s:
                before[t].append(nxt)
                nxt += 1
    return SignalPlan(tuple(dict.fromkeys(kinds)), before, after, queue_s)
