"""Where a session lives: each pod's ledger of the sessions it served, and the lookup
router replicas share through it.

Several router replicas each remember the sessions *they* placed. A session whose
next turn reaches a replica that never saw it would be placed anew, on a pod
without its KV. The pods are the one truth every replica can ask: a model server
records each session id the router sent it, and a replica's picker, on a session
its replica does not know, asks the track's pods which one served it last.

Contract:
    * The model server's ``dscache.routing.SessionLedger`` (``AppState.sessions``)
      records each session id the router sent it (its session header: the client's
      own id); vLLM pods keep the same ledger (``dscache_vllm.ledger``).
    * ``GET /dscache/sessions/<id>`` (the model server, internal token as for the
      key info) answers 200 ``{"age_s", "inflight"}`` for a session in the
      ledger, 404 ``{"inflight"}`` for one it is not; ``inflight`` is the pod's
      requests holding or waiting for a slot. Every completion answer carries the
      same count as ``X-Dscache-Inflight``, so each router replica's load bound
      sees the requests the other replicas sent.
    * ``locate(client, pods, session_id)`` (the picker) asks every pod at once and
      returns the one that served the session most recently, or None: no pod
      knows it, or none answered within the client's timeout. Never an exception
      for a pod that fails: that pod simply does not know. With ``path=
      CONVERSATIONS_PATH`` it asks the same of the pods' conversation ledgers (the
      id is a ``dscache.routing.conversation_key``): which pod served a turn
      without its session id's previous turn. ``previous_pod`` asks it from a
      worker thread (where the picker's holder runs) on the event loop that owns
      the client, for each of the previous turn's keys at once (the surer first:
      ``dscache.routing.previous_turn_keys``), and gives up a second after the
      per-pod timeout.
    * The ledger is per pod and in memory: a restarted pod knows no session, and
      neither does its cache (which is what the placement follows).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import Mapping, Sequence
from urllib.parse import quote

import httpx

from dscache.routing import CONVERSATIONS_PATH, SESSIONS_PATH

#: Largest answer the picker reads from a pod's session route.
MAX_ANSWER_BYTES = 4096


async def locate(
    client: httpx.AsyncClient,
    pods: Sequence[str],
    session_id: str,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    *,
    path: str = SESSIONS_PATH,
) -> tuple[str | None, dict[str, int]]:
    """Which of ``pods`` served ``session_id`` most recently, and each answering pod's
    in-flight count (see the module contract); ``timeout_s``: per pod (default: the
    client's); ``path``: which ledger."""
    route = path + quote(session_id, safe="")
    answers = await asyncio.gather(
        *(_ask(client, f"http://{pod}{route}", headers or {}, timeout_s) for pod in pods)
    )
    best: tuple[float, str] | None = None
    inflight: dict[str, int] = {}
    for pod, (age, load) in zip(pods, answers, strict=True):
        if load is not None:
            inflight[pod] = load
        if age is not None and (best is None or age < best[0]):
            best = (age, pod)
    return (best[1] if best else None), inflight


def previous_pod(
    loop: asyncio.AbstractEventLoop,
    client: httpx.AsyncClient,
    pods: Sequence[str],
    keys: Sequence[str],
    *,
    headers: Mapping[str, str],
    timeout_s: float,
) -> str | None:
    """From a worker thread: which of ``pods`` served the chat request recorded under
    the first of ``keys`` (each a ``conversation_key``, the surer first) that any pod
    knows, most recently (their conversation ledgers, every key asked at once on
    ``loop``, ``timeout_s`` per pod); None when none did or none answered in time."""

    async def asked() -> str | None:
        ask = functools.partial(locate, client, pods, headers=headers, timeout_s=timeout_s)
        found = await asyncio.gather(*(ask(key, path=CONVERSATIONS_PATH) for key in keys))
        return next((pod for pod, _ in found if pod is not None), None)

    future = asyncio.run_coroutine_threadsafe(asked(), loop)
    try:
        return future.result(timeout=timeout_s + 1.0)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return None


async def _ask(
    client: httpx.AsyncClient, url: str, headers: Mapping[str, str], timeout_s: float | None
) -> tuple[float | None, int | None]:
    """(age, in-flight) from one pod; (None, None) for no usable answer."""
    try:
        if timeout_s is None:
            r = await client.get(url, headers=dict(headers))
        else:
            r = await client.get(url, headers=dict(headers), timeout=timeout_s)
        if r.status_code not in (200, 404) or len(r.content) > MAX_ANSWER_BYTES:
            return None, None
        body = json.loads(r.content)
        load = body.get("inflight")
        load = load if isinstance(load, int) and load >= 0 else None
        age = body.get("age_s") if r.status_code == 200 else None
        return (float(age) if isinstance(age, int | float) else None), load
    except (httpx.HTTPError, ValueError, AttributeError):
        return None, None
