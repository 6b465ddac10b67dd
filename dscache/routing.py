"""What the router and the model pods say to each other (the routing protocol).

The router pod (:mod:`dscache_router`) and both engines (the model server and
vLLM with dscache's connector) agree on these headers and paths; the ring and the
prompt key, which only the router and the prewarm compute, are
:mod:`dscache_router.ring`.

Contract:
    * Every answer of a pod carries its in-flight requests in
      :data:`INFLIGHT_HEADER`, and ``SESSIONS_PATH + id`` tells whether the pod
      served a session (and ``KEYINFO_PATH`` how it keys blocks): 200
      ``{"age_s", "inflight"}`` for a session in its :class:`SessionLedger`, 404
      ``{"inflight"}`` otherwise. Both engines keep one (the model server,
      ``AppState.sessions``; vLLM, ``dscache_vllm.ledger``); the router's picker
      asks them (``dscache_router.locate``).
    * :class:`SessionLedger` ``seen(id)`` records a session as served now;
      ``age(id)`` is the seconds since, or None. Bounded: ``max_sessions`` entries
      (least recent dropped first), each forgotten ``ttl_s`` after its last request;
      an id over :data:`MAX_SESSION_ID` characters is not recorded.
    * A turn that reaches the router without its session id can still be placed
      where its conversation's previous turn went: a pod also records the
      :func:`conversation_key` of each chat request it serves without credentials
      (the public tenant's; a second ledger), answered at ``CONVERSATIONS_PATH +
      key`` as the session route answers, and the picker asks for
      :func:`previous_turn_keys` of the turn it places. A pod records two keys of
      a turn: its request's messages, when it has parsed them, and those messages
      followed by the answer it gave (:func:`answered_key`), once the answer ran to
      its end, before its last byte is sent; a chat client sends the answer back
      as it was given, so the next turn's messages up to and including their last
      assistant message make the second key. That one tells apart conversations
      alike up to their last question (two users' same opening question, answered
      differently), the first does not; it serves where the client changed the
      answer. The key is a digest of each message's role and content (as JSON,
      canonical), nothing else: the same conversation from any client.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachetools import TTLCache

#: The header in which a model pod reports its in-flight requests to the router.
INFLIGHT_HEADER = "X-Dscache-Inflight"
#: Where a model pod answers whether it served a session (followed by the id).
SESSIONS_PATH = "/dscache/sessions/"
#: Where a model pod answers the key facts the picker keys a request with (its
#: block size and chain root), to route it to the pod holding its longest prefix.
KEYINFO_PATH = "/dscache/keyinfo"
#: Where a model pod answers whether it served a chat request with these messages
#: (followed by their :func:`conversation_key`).
CONVERSATIONS_PATH = "/dscache/conversations/"
#: Longest session id a ledger records (the router's own limit is shorter).
MAX_SESSION_ID = 256


def conversation_key(messages: Any) -> str | None:
    """The hex digest of a chat request's messages (each one's role and content), or
    None when they are not a list of JSON objects (a request's ``messages`` as parsed,
    whatever it holds)."""
    if not isinstance(messages, list):
        return None
    h = hashlib.blake2b(digest_size=16, person=b"dscache-conv")
    for m in messages:
        if not isinstance(m, dict):
            return None
        item = json.dumps(
            [m.get("role"), m.get("content")],
            ensure_ascii=False,
            separators=(",", ":"),
            sort_keys=True,
        ).encode("utf-8", "surrogatepass")
        h.update(len(item).to_bytes(8, "little") + item)
    return h.hexdigest()


def answered_key(messages: Any, answer: str) -> str | None:
    """The :func:`conversation_key` of a chat request's messages followed by the
    assistant's ``answer`` to them: the key its next turn finds it by first (None for
    messages that are not a list of JSON objects)."""
    if not isinstance(messages, list):
        return None
    return conversation_key([*messages, {"role": "assistant", "content": answer}])


def previous_turn_keys(messages: Sequence[Any]) -> tuple[str, ...]:
    """The keys a pod recorded the turn before this one under, the surer first: its
    messages with the answer it got (up to and including this request's last
    assistant message: :func:`answered_key` as the pod computed it), then its
    messages alone (up to the last assistant message). Empty when there was none."""
    last = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
        default=0,
    )
    if last == 0:
        return ()
    keys = (conversation_key(list(messages[: last + 1])), conversation_key(list(messages[:last])))
    return tuple(k for k in keys if k is not None)


class SessionLedger:
    """The sessions a pod served (see the module contract)."""

    def __init__(
        self,
        max_sessions: int = 200_000,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Imported here: the core's other users (the router's renderer) need no
        # cachetools; both engines that keep a ledger have it (the server extra
        # pins it, vLLM depends on it).
        from cachetools import TTLCache

        self._clock = clock
        self._seen: TTLCache[str, float] = TTLCache(max_sessions, ttl_s, timer=clock)

    def seen(self, session_id: str | None) -> None:
        """Records ``session_id`` as served now (nothing for none or an overlong one)."""
        if session_id and len(session_id) <= MAX_SESSION_ID:
            self._seen[session_id] = self._clock()

    def age(self, session_id: str) -> float | None:
        """Seconds since the session's last request here, or None if unknown."""
        at = self._seen.get(session_id)
        return None if at is None else max(0.0, self._clock() - at)

    def __len__(self) -> int:
        return len(self._seen)
