"""Where a session lives: each pod's ledger of the sessions and prompts it served,
and the lookup router replicas share through it.

Several router replicas each remember the sessions *they* placed. A session whose
next turn reaches a replica that never saw it would be placed anew, on a pod
without its KV. The pods are the one truth every replica can ask: a model server
records each session id the router sent it and the turn mark of each prompt it
serves (:func:`dscache.routing.prompt_mark`), and a replica's picker, on a request
its replica cannot place by memory, asks the pods which one served the session, or
else the latest earlier turn of the conversation (a turn whose id the gateway
dropped, a client that reconnected under a new id).

Contract:
    * ``SessionLedger.seen(session_id)`` records a session (the router's session
      header: the client's own id) as served here now; ``age(session_id)`` is the
      seconds since, or None. ``served(ids)`` records a prompt's turn mark;
      ``deepest(marks)`` is the latest of ``marks`` recorded here (index, age), or
      None. Bounded: ``max_sessions`` sessions and as many marks (least recent
      dropped first), each forgotten ``ttl_s`` after its last request.
    * ``POST /dscache/locate`` (the model server, internal token as for the key
      info), body ``{"session": id or null, "marks": [hex, ...]}`` (at most
      ``MAX_TURN_MARKS``), answers 200 ``{"session_age_s", "turn", "turn_age_s",
      "inflight"}``: the session's age here or null, the index in ``marks`` of the
      latest one served here and its age, or nulls; ``inflight`` is the pod's
      requests holding or waiting for a slot. ``GET /dscache/sessions/<id>`` (the
      lookup before turn marks, kept for pickers of that version) answers 200
      ``{"age_s", "inflight"}`` or 404 ``{"inflight"}``. Every completion answer
      carries the in-flight count as ``X-Dscache-Inflight``, so each router
      replica's load bound sees the requests the other replicas sent.
    * ``locate(client, pods, session_id, marks)`` (the picker) asks every pod at
      once and returns a :class:`Located`: the pod that served the session most
      recently; else the pod that served the latest of the turns (the deepest
      mark; of two, the more recent, and the answer says the turn is ``shared``);
      else no pod: none knows either, or none
      answered within the client's timeout. Never an exception for a pod that
      fails: that pod simply does not know. A pod without ``POST /dscache/locate``
      (an older version) is asked the session alone, on its ``GET`` route.
    * The ledger is per pod and in memory: a restarted pod knows no session, and
      neither does its cache (which is what the placement follows).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
from cachetools import TTLCache

from dscache.routing import (
    INFLIGHT_HEADER,
    LOCATE_PATH,
    MAX_TURN_MARKS,
    SESSIONS_PATH,
    TURN_MARK_BYTES,
    prompt_mark,
)

__all__ = [
    "INFLIGHT_HEADER",
    "LOCATE_PATH",
    "SESSIONS_PATH",
    "Located",
    "LocateQuery",
    "SessionLedger",
    "locate",
]

#: Longest session id the ledger records (the router's own limit is shorter).
MAX_SESSION_ID = 256
#: Largest answer the picker reads from a pod's session route.
MAX_ANSWER_BYTES = 4096


class SessionLedger:
    """The sessions a pod served (see the module contract)."""

    def __init__(
        self,
        max_sessions: int = 200_000,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._seen: TTLCache[str, float] = TTLCache(max_sessions, ttl_s, timer=clock)
        self._marks: TTLCache[bytes, float] = TTLCache(max_sessions, ttl_s, timer=clock)

    def seen(self, session_id: str | None) -> None:
        """Records ``session_id`` as served now (nothing for none or an overlong one)."""
        if session_id and len(session_id) <= MAX_SESSION_ID:
            self._seen[session_id] = self._clock()

    def age(self, session_id: str) -> float | None:
        """Seconds since the session's last request here, or None if unknown."""
        at = self._seen.get(session_id)
        return None if at is None else max(0.0, self._clock() - at)

    def served(self, ids: Sequence[int]) -> None:
        """Records the turn mark of a prompt served here now."""
        if ids:
            self._marks[prompt_mark(ids)] = self._clock()

    def deepest(self, marks: Sequence[bytes]) -> tuple[int, float] | None:
        """(index, age) of the last of ``marks`` served here, or None."""
        for index in range(len(marks) - 1, -1, -1):
            at = self._marks.get(marks[index])
            if at is not None:
                return index, max(0.0, self._clock() - at)
        return None

    def __len__(self) -> int:
        return len(self._seen)


@dataclass(frozen=True)
class LocateQuery:
    """One ``POST /dscache/locate`` body, checked."""

    session: str | None
    marks: tuple[bytes, ...]

    @classmethod
    def parse(cls, body: object) -> LocateQuery:
        """Reads the body; ValueError with the reason for a malformed one."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        session = body.get("session")
        if session is not None and (not isinstance(session, str) or len(session) > MAX_SESSION_ID):
            raise ValueError(f"session must be a string of at most {MAX_SESSION_ID} characters")
        marks = body.get("marks", [])
        if not isinstance(marks, list) or len(marks) > MAX_TURN_MARKS:
            raise ValueError(f"marks must be a list of at most {MAX_TURN_MARKS} hex strings")
        out: list[bytes] = []
        for mark in marks:
            raw = bytes.fromhex(mark) if isinstance(mark, str) else b""
            if len(raw) != TURN_MARK_BYTES:
                raise ValueError(f"each mark must be {TURN_MARK_BYTES} bytes in hex")
            out.append(raw)
        return cls(session or None, tuple(out))

    def json(self) -> dict[str, object]:
        return {"session": self.session, "marks": [m.hex() for m in self.marks]}


@dataclass(frozen=True)
class Located:
    """Where a lookup found a request's conversation.

    Attributes:
        pod: the pod, or None (no pod knows it).
        by: ``session`` (the pod served the session id), ``turn`` (it alone served
            the conversation's latest earlier turn, by its mark) or ``shared``
            (several pods served that turn, the same prompt from several
            conversations: this one most recently); empty when ``pod`` is None.
        inflight: each answering pod's in-flight count.
    """

    pod: str | None = None
    by: str = ""
    inflight: dict[str, int] = field(default_factory=dict)


async def locate(
    client: httpx.AsyncClient,
    pods: Sequence[str],
    session_id: str | None,
    marks: Sequence[bytes] = (),
    *,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> Located:
    """Which of ``pods`` served ``session_id``, else the latest of the turns ``marks``
    (see the module contract); ``timeout_s``: per pod (default: the client's)."""
    query = LocateQuery(session_id, tuple(marks[-MAX_TURN_MARKS:]))
    answers = await asyncio.gather(
        *(_ask(client, pod, query, dict(headers or {}), timeout_s) for pod in pods)
    )
    by_session: tuple[float, str] | None = None
    by_turn: tuple[int, float, str] | None = None
    depths: list[int] = []
    inflight: dict[str, int] = {}
    for pod, answer in zip(pods, answers, strict=True):
        if answer.inflight is not None:
            inflight[pod] = answer.inflight
        if answer.session_age is not None and (
            by_session is None or answer.session_age < by_session[0]
        ):
            by_session = (answer.session_age, pod)
        if answer.turn is not None:
            depths.append(answer.turn[0])
            turn = (answer.turn[0], -answer.turn[1], pod)
            if by_turn is None or turn[:2] > by_turn[:2]:
                by_turn = turn
    if by_session is not None:
        return Located(by_session[1], "session", inflight)
    if by_turn is not None:
        shared = depths.count(by_turn[0]) > 1
        return Located(by_turn[2], "shared" if shared else "turn", inflight)
    return Located(inflight=inflight)


@dataclass(frozen=True)
class _Answer:
    session_age: float | None = None
    turn: tuple[int, float] | None = None  # (index, age)
    inflight: int | None = None


async def _ask(
    client: httpx.AsyncClient,
    pod: str,
    query: LocateQuery,
    headers: dict[str, str],
    timeout_s: float | None,
) -> _Answer:
    """One pod's answer; an empty one for no usable answer."""
    timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
    try:
        url = f"http://{pod}{LOCATE_PATH}"
        r = await client.post(url, json=query.json(), headers=headers, timeout=timeout)
        body = _small_json(r)
        if r.status_code in (404, 405) and "inflight" not in body and query.session:
            # An older pod: it knows sessions only, on its GET route.
            path = SESSIONS_PATH + quote(query.session, safe="")
            r = await client.get(f"http://{pod}{path}", headers=headers, timeout=timeout)
            body = _small_json(r)
            if r.status_code not in (200, 404):
                return _Answer()
            age = body.get("age_s") if r.status_code == 200 else None
            return _Answer(session_age=_seconds(age), inflight=_count(body.get("inflight")))
        if r.status_code != 200:
            return _Answer()
        turn, turn_age = body.get("turn"), _seconds(body.get("turn_age_s"))
        found = (
            (turn, turn_age)
            if isinstance(turn, int) and 0 <= turn < len(query.marks) and turn_age is not None
            else None
        )
        return _Answer(
            session_age=_seconds(body.get("session_age_s")) if query.session else None,
            turn=found,
            inflight=_count(body.get("inflight")),
        )
    except (httpx.HTTPError, ValueError, AttributeError):
        return _Answer()


def _small_json(r: httpx.Response) -> dict[str, object]:
    if len(r.content) > MAX_ANSWER_BYTES:
        raise ValueError("an oversized answer")
    try:
        body = json.loads(r.content)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _seconds(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and value >= 0 else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and value >= 0 else None
