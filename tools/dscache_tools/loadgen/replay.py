"""The replay: sends a workload's sessions to an OpenAI-compatible endpoint.

Contract:
    * Turns of one session are sent in order, one at a time (turn ``t+1`` only after
      turn ``t``'s response ended); up to ``concurrency`` sessions run in parallel,
      taken in workload order.
    * A request carries ``X-Session-ID`` only when the workload gives it an id; the
      client never keeps or sends cookies, so a dropped id means neither header nor
      cookie (the seed's gateway fault).
    * By default every request streams (SSE). TTFT is the time to the first chunk
      that carries generated text (the server's opening role-only chunk does not
      count); the end-to-end latency runs to ``[DONE]``. A non-200 status, a
      transport error, an error event in the stream or a stream without ``[DONE]``
      is an error.
    * With ``stream=False`` a request asks for one JSON answer (OpenAI's default),
      which a router can retry on another pod until its first byte; TTFT is then
      the time to the whole answer (the same as the end-to-end latency). An answer
      without ``choices`` is an error.
    * ``answers="served"`` sends back what the server answered, as a chat client
      does: each earlier turn's assistant message in the history is replaced by the
      text that turn received (when it succeeded); ``"workload"`` (the default) sends
      the workload's canned answers unchanged.
    * ``temperature`` 0 (the default) asks for greedy answers: the same messages get
      the same answer from any pod, so two sessions that open alike stay alike.
      Above 0 each request also sends a ``seed`` drawn from its session and turn:
      answers differ from one session to the next as a chat client's do, and a
      replay samples the same way every time.
    * ``requests`` caps how many requests start; ``duration_s`` stops starting new
      ones after that many seconds. In-flight requests always finish (bounded by
      ``timeout_s``), so a run ends by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING, Any, Literal

from dscache_tools.loadgen.report import (
    LoadReport,
    RequestResult,
    build_report,
    conversation_digest,
    scrape,
)
from dscache_tools.workload import ChatRequest, sessions_of

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadConfig:
    """How to replay a workload.

    Attributes:
        target: base URL of the router or a server, e.g. ``http://127.0.0.1:8080``.
        concurrency: sessions in flight at once.
        requests: stop starting requests after this many (None: the whole workload).
        duration_s: stop starting requests after this many seconds (None: no limit).
        timeout_s: per-request limit, seconds.
        metrics_urls: model servers' ``/metrics`` URLs for the cache figures.
        model: the ``model`` field sent (None: omitted, the server's own).
        session_header: header carrying the session id.
        upstream_header: response header naming the pod (router debug header), if any.
        progress: show a progress bar on stderr.
        think_s: mean seconds a user takes between the end of one answer and the
            next question of the same session (exponential, drawn from a seed of
            the session's name, at most 4x the mean); 0: the next turn at once.
            With think time, ``concurrency`` is the number of live sessions.
        stream: stream the answers (SSE); False: one JSON answer per request,
            TTFT then being the time to the whole answer.
        answers: the history's assistant messages: the workload's canned answers
            (``"workload"``) or the ones the server gave (``"served"``).
        spread: more base URLs of the same service (say, each router replica's):
            every request goes to one of ``target`` and these, drawn from a seed of
            its session and turn, as a Service spreads new connections; the
            ``/metrics`` scrape still goes to ``metrics_urls``.
        temperature: sampling temperature sent (0: greedy; above 0 with a seed
            per session and turn).
    """

    target: str
    concurrency: int = 4
    requests: int | None = None
    duration_s: float | None = None
    timeout_s: float = 300.0
    metrics_urls: tuple[str, ...] = ()
    model: str | None = None
    session_header: str = "X-Session-ID"
    upstream_header: str = "X-Dscache-Upstream"
    progress: bool = True
    think_s: float = 0.0
    stream: bool = True
    answers: Literal["workload", "served"] = "workload"
    spread: tuple[str, ...] = ()
    temperature: float = 0.0

    def url_for(self, session: str, turn: int) -> str:
        """The chat URL of one turn (``spread``: one of the replicas, seeded)."""
        bases = (self.target, *self.spread)
        base = bases[zlib.crc32(f"{session}/{turn}".encode()) % len(bases)]
        return base.rstrip("/") + "/v1/chat/completions"

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be > 0")
        if self.think_s < 0:
            raise ValueError("think time must be >= 0")
        if self.answers not in ("workload", "served"):
            raise ValueError("answers must be 'workload' or 'served'")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")


def think_times(session: str, turns: int, mean_s: float) -> list[float]:
    """Seconds to wait before each turn of ``session``: none before the first.

    Exponential with mean ``mean_s``, capped at 4x the mean, from a seed of the
    session's name, so a replay waits the same way every time.
    """
    if mean_s <= 0 or turns <= 1:
        return [0.0] * turns
    rng = random.Random(zlib.crc32(session.encode()))
    return [0.0] + [min(rng.expovariate(1.0 / mean_s), 4 * mean_s) for _ in range(turns - 1)]


def _no_cookies() -> CookieJar:
    # A jar whose policy accepts no domain: Set-Cookie answers are ignored, so a
    # request without an id really carries neither header nor cookie.
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def with_answers(messages: list[dict[str, str]], served: dict[int, str]) -> list[dict[str, str]]:
    """``messages`` with the assistant message at each index of ``served`` replaced
    by the answer served there."""
    out = list(messages)
    for i, text in served.items():
        if i < len(out) and out[i].get("role") == "assistant":
            out[i] = {**out[i], "content": text}
    return out


def _body(cfg: LoadConfig, req: ChatRequest, messages: list[dict[str, str]]) -> bytes:
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": req.max_tokens,
        "temperature": cfg.temperature,
        "stream": cfg.stream,
    }
    if cfg.temperature > 0:
        body["seed"] = zlib.crc32(f"{req.session}/{req.turn}".encode())
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.model:
        body["model"] = cfg.model
    # As the OpenAI Python SDK (httpx) sends it: the router keys an id-less request by
    # these bytes, and `dscache prewarm` places prompts by the same serialization.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _usage(res: RequestResult, usage: dict[str, Any] | None) -> None:
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
        res.completion_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0)


def _timings(res: RequestResult, timings: object) -> None:
    """Keeps the server's per-phase seconds (its ``timings`` extension), if any."""
    if isinstance(timings, dict):
        res.timings = {str(k): float(v) for k, v in timings.items() if isinstance(v, int | float)}


def _absorb(res: RequestResult, chunk: dict[str, Any], started: float, answer: list[str]) -> None:
    """Takes usage, timings, the first token's time and the text from one streamed
    chunk."""
    _usage(res, chunk.get("usage"))
    _timings(res, chunk.get("timings"))
    for choice in chunk.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:
            answer.append(text)
        if res.ttft_s is None and (text or choice.get("finish_reason")):
            res.ttft_s = time.perf_counter() - started


async def _read_stream(
    resp: httpx.Response, res: RequestResult, started: float, answer: list[str]
) -> bool:
    """Reads the SSE stream into ``res`` and its text into ``answer``; whether it
    ended with ``[DONE]``."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            res.error = f"stream error: {chunk['error'].get('message')}"
            return False
        _absorb(res, chunk, started, answer)
    res.error = "stream ended without [DONE]"
    return False


async def _read_whole(
    resp: httpx.Response, res: RequestResult, started: float, answer: list[str]
) -> bool:
    """Reads a non-streamed answer into ``res`` and its text into ``answer``; whether
    it has choices."""
    body = json.loads(await resp.aread())
    res.ttft_s = time.perf_counter() - started
    _usage(res, body.get("usage"))
    _timings(res, body.get("timings"))
    choices = body.get("choices")
    if not choices:
        res.error = "answer without choices"
        return False
    answer.append(str((choices[0].get("message") or {}).get("content") or ""))
    return True


async def _one(
    client: httpx.AsyncClient,
    cfg: LoadConfig,
    req: ChatRequest,
    t0: float,
    served: dict[int, str],
) -> tuple[RequestResult, str]:
    """Sends one turn (its history's answers replaced by ``served``); returns the
    result and the answer's text."""
    headers = {"Content-Type": "application/json"}
    if req.session_id is not None:
        headers[cfg.session_header] = req.session_id
    started = time.perf_counter()
    res = RequestResult(
        session=req.session,
        turn=req.turn,
        session_id=req.session_id,
        ok=False,
        status=0,
        started_s=started - t0,
        ttft_s=None,
        e2e_s=0.0,
    )
    messages = with_answers(req.messages, served) if served else req.messages
    res.history_digest = conversation_digest(messages[:-1])
    done = False
    answer: list[str] = []
    try:
        async with client.stream(
            "POST",
            cfg.url_for(req.session, req.turn),
            content=_body(cfg, req, messages),
            headers=headers,
        ) as resp:
            res.status = resp.status_code
            res.upstream = resp.headers.get(cfg.upstream_header)
            res.set_cookie = "set-cookie" in resp.headers
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"http {resp.status_code}: {text[:200]}"
            elif cfg.stream:
                done = await _read_stream(resp, res, started, answer)
            else:
                done = await _read_whole(resp, res, started, answer)
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e_s = time.perf_counter() - started
    res.ok = done and res.error is None
    text = "".join(answer)
    if res.ok:
        res.left_digest = conversation_digest([*messages, {"role": "assistant", "content": text}])
    return res, text


async def run_load(
    cfg: LoadConfig,
    workload: Sequence[ChatRequest],
    *,
    on_result: Callable[[RequestResult], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> LoadReport:
    """Replays ``workload`` as ``cfg`` says and returns the report.

    Args:
        cfg: Target, concurrency and limits.
        workload: Requests, grouped into sessions by :func:`sessions_of`.
        on_result: Called with each finished request (from the event loop).
        should_stop: Polled before each request starts; once it returns True
            no request starts (in-flight ones finish), like ``duration_s``.
    """
    import httpx

    # httpx logs every request at INFO; a replay would drown the progress bar.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    sessions = list(sessions_of(workload).values())
    planned = sum(len(s) for s in sessions)
    if cfg.requests is not None:
        planned = min(planned, cfg.requests)
    limits = httpx.Limits(max_connections=cfg.concurrency * 2 + 4)
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    results: list[RequestResult] = []
    bar = _progress(planned, cfg.progress)
    async with httpx.AsyncClient(
        base_url=cfg.target, timeout=timeout, limits=limits, cookies=_no_cookies()
    ) as client:
        before = await scrape(client, cfg.metrics_urls)
        t0 = time.perf_counter()
        next_session = 0
        started = 0

        def may_start() -> bool:
            if cfg.requests is not None and started >= cfg.requests:
                return False
            if should_stop is not None and should_stop():
                return False
            return cfg.duration_s is None or time.perf_counter() - t0 < cfg.duration_s

        async def worker() -> None:
            nonlocal next_session, started
            while next_session < len(sessions):
                turns = sessions[next_session]
                next_session += 1
                pauses = think_times(turns[0].session, len(turns), cfg.think_s)
                served: dict[int, str] = {}  # message index -> the answer served there
                for req, pause in zip(turns, pauses, strict=True):
                    # A user thinking is not a request in flight: a stop ends the wait.
                    until = time.perf_counter() + pause
                    while may_start() and (left := until - time.perf_counter()) > 0:
                        await asyncio.sleep(min(left, 0.5))
                    if not may_start():
                        return
                    started += 1
                    res, text = await _one(client, cfg, req, t0, served)
                    if cfg.answers == "served" and res.ok:
                        # The next turns carry this answer right after this history.
                        served[len(req.messages)] = text
                    results.append(res)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(errors=sum(not r.ok for r in results), refresh=False)
                    if on_result is not None:
                        on_result(res)
            return

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        elapsed = time.perf_counter() - t0
        after = await scrape(client, cfg.metrics_urls)
    if bar is not None:
        bar.close()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return build_report(cfg.target, cfg.concurrency, results, elapsed, delta)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="load", dynamic_ncols=True, leave=False)
