"""The load generator: replays a workload against an OpenAI-compatible endpoint.

Contract:
    * Turns of one session are sent in order, one at a time (turn ``t+1`` only after
      turn ``t``'s response ended); up to ``concurrency`` sessions run in parallel,
      taken in workload order.
    * A request carries ``X-Session-ID`` only when the workload gives it an id; the
      client never keeps or sends cookies, so a dropped id means neither header nor
      cookie (the seed's gateway fault).
    * Every request streams (SSE). TTFT is the time to the first chunk that carries
      generated text (the server's opening role-only chunk does not count); the
      end-to-end latency runs to ``[DONE]``. A non-200 status, a transport error, an
      error event in the stream or a stream without ``[DONE]`` is an error.
    * ``requests`` caps how many requests start; ``duration_s`` stops starting new
      ones after that many seconds. In-flight requests always finish (bounded by
      ``timeout_s``), so a run ends by itself.
    * Cache figures come from the model servers' ``/metrics`` (counter deltas over
      the run), and from ``usage.prompt_tokens_details.cached_tokens`` as a
      client-side cross-check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dscache import metricnames as names
from dscache_tools.workload import ChatRequest, sessions_of

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

#: Counters read from each model server's /metrics: (family, label, value).
_SERVER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (names.PROMPT_TOKENS, names.SOURCE_LABEL, names.SOURCE_REUSED),
    (names.PROMPT_TOKENS, names.SOURCE_LABEL, names.SOURCE_RECOMPUTED),
    *(
        (family, names.LEVEL_LABEL, level)
        for level in names.HIT_LEVELS
        for family in (names.CACHE_HITS, names.CACHE_MISSES)
    ),
)


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

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be > 0")
        if self.think_s < 0:
            raise ValueError("think time must be >= 0")


@dataclass
class RequestResult:
    """One request as the client saw it."""

    session: str
    turn: int
    session_id: str | None
    ok: bool
    status: int
    started_s: float  # since the run started
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    upstream: str | None = None
    set_cookie: bool = False
    error: str | None = None


@dataclass
class LoadReport:
    """Figures of one run (what ``--json`` writes)."""

    target: str
    concurrency: int
    requests: int
    ok: int
    errors: int
    duration_s: float
    qps: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    e2e_p99_s: float | None
    prompt_tokens: int
    cached_tokens: int
    client_token_hit_ratio: float | None
    token_hit_ratio: float | None
    block_hit_ratio: float | None
    session_hit_ratio: float | None
    recomputed_share: float | None
    server_counters: dict[str, float] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)
    results: list[RequestResult] = field(default_factory=list)

    def to_dict(self, *, with_results: bool = True) -> dict[str, Any]:
        """JSON-ready dict; ``with_results`` keeps the per-request list."""
        d = asdict(self)
        if not with_results:
            d.pop("results")
        return d


def think_times(session: str, turns: int, mean_s: float) -> list[float]:
    """Seconds to wait before each turn of ``session``: none before the first.

    Exponential with mean ``mean_s``, capped at 4x the mean, from a seed of the
    session's name, so a replay waits the same way every time.
    """
    if mean_s <= 0 or turns <= 1:
        return [0.0] * turns
    rng = random.Random(zlib.crc32(session.encode()))
    return [0.0] + [min(rng.expovariate(1.0 / mean_s), 4 * mean_s) for _ in range(turns - 1)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def parse_counters(text: str) -> dict[str, float]:
    """The server counters this module reads, from Prometheus text format.

    Keys look like ``dscache_server_prompt_tokens{source="reused"}``. Missing
    samples are absent (an old server, or the cache never ran).
    """
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {(f, lbl, v) for f, lbl, v in _SERVER_COUNTERS}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            base = sample.name[: -len("_total")]
            for label, value in sample.labels.items():
                if (base, label, value) in wanted:
                    key = f'{base}{{{label}="{value}"}}'
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _counter(c: Mapping[str, float], family: str, label: str, value: str) -> float:
    return c.get(f'{family}{{{label}="{value}"}}', 0.0)


def cache_figures(delta: Mapping[str, float]) -> dict[str, float | None]:
    """Hit ratios at three levels and the recomputed share, from counter deltas."""
    reused = _counter(delta, names.PROMPT_TOKENS, names.SOURCE_LABEL, names.SOURCE_REUSED)
    recomputed = _counter(delta, names.PROMPT_TOKENS, names.SOURCE_LABEL, names.SOURCE_RECOMPUTED)
    out: dict[str, float | None] = {
        "token_hit_ratio": _ratio(reused, reused + recomputed),
        "recomputed_share": _ratio(recomputed, reused + recomputed),
    }
    for level in ("block", "session"):
        hits = _counter(delta, names.CACHE_HITS, names.LEVEL_LABEL, level)
        misses = _counter(delta, names.CACHE_MISSES, names.LEVEL_LABEL, level)
        out[f"{level}_hit_ratio"] = _ratio(hits, hits + misses)
    return out


async def scrape(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float]:
    """Sums the counters of every server; an unreachable one counts as absent."""
    total: dict[str, float] = {}
    for url in urls:
        try:
            resp = await client.get(url, timeout=10.0)
            resp.raise_for_status()
        except Exception as exc:  # the run still reports its client-side figures
            log.warning("cannot scrape %s: %s", url, exc)
            continue
        for key, value in parse_counters(resp.text).items():
            total[key] = total.get(key, 0.0) + value
    return total


def _no_cookies() -> CookieJar:
    # A jar whose policy accepts no domain: Set-Cookie answers are ignored, so a
    # request without an id really carries neither header nor cookie.
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


async def _one(
    client: httpx.AsyncClient,
    cfg: LoadConfig,
    req: ChatRequest,
    t0: float,
) -> RequestResult:
    headers = {"Content-Type": "application/json"}
    if req.session_id is not None:
        headers[cfg.session_header] = req.session_id
    body: dict[str, Any] = {
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.model:
        body["model"] = cfg.model
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
    done = False
    try:
        payload = json.dumps(body, ensure_ascii=False).encode()
        async with client.stream(
            "POST", "/v1/chat/completions", content=payload, headers=headers
        ) as resp:
            res.status = resp.status_code
            res.upstream = resp.headers.get(cfg.upstream_header)
            res.set_cookie = "set-cookie" in resp.headers
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"http {resp.status_code}: {text[:200]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = f"stream error: {chunk['error'].get('message')}"
                        break
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
                        res.completion_tokens = int(usage.get("completion_tokens", 0))
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = int(details.get("cached_tokens") or 0)
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        text_ = delta.get("content")
                        if res.ttft_s is None and (text_ or choice.get("finish_reason")):
                            res.ttft_s = time.perf_counter() - started
                if not done and res.error is None:
                    res.error = "stream ended without [DONE]"
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e_s = time.perf_counter() - started
    res.ok = done and res.error is None
    return res


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
                for req, pause in zip(turns, pauses, strict=True):
                    # A user thinking is not a request in flight: a stop ends the wait.
                    until = time.perf_counter() + pause
                    while may_start() and (left := until - time.perf_counter()) > 0:
                        await asyncio.sleep(min(left, 0.5))
                    if not may_start():
                        return
                    started += 1
                    res = await _one(client, cfg, req, t0)
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
    return _report(cfg, results, elapsed, delta)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="load", dynamic_ncols=True, leave=False)


def _report(
    cfg: LoadConfig, results: list[RequestResult], elapsed: float, delta: dict[str, float]
) -> LoadReport:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = (r.error or "error").split(":", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    figures = cache_figures(delta)
    return LoadReport(
        target=cfg.target,
        concurrency=cfg.concurrency,
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        duration_s=elapsed,
        qps=len(ok) / elapsed if elapsed > 0 else 0.0,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p95_s=percentile(ttft, 95),
        ttft_p99_s=percentile(ttft, 99),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p95_s=percentile(e2e, 95),
        e2e_p99_s=percentile(e2e, 99),
        prompt_tokens=prompt,
        cached_tokens=cached,
        client_token_hit_ratio=_ratio(cached, prompt),
        token_hit_ratio=figures["token_hit_ratio"],
        block_hit_ratio=figures["block_hit_ratio"],
        session_hit_ratio=figures["session_hit_ratio"],
        recomputed_share=figures["recomputed_share"],
        server_counters=delta,
        error_kinds=kinds,
        results=results,
    )


def format_report(r: LoadReport) -> str:
    """A short human-readable summary."""

    def s(v: float | None, unit: str = "s") -> str:
        return "-" if v is None else (f"{v:.3f}{unit}" if unit == "s" else f"{v:.3f}")

    lines = [
        f"target {r.target}  concurrency {r.concurrency}  requests {r.requests}  "
        f"errors {r.errors}  {r.duration_s:.1f}s  {r.qps:.2f} req/s",
        f"TTFT p50 {s(r.ttft_p50_s)}  p95 {s(r.ttft_p95_s)}  p99 {s(r.ttft_p99_s)}",
        f"e2e  p50 {s(r.e2e_p50_s)}  p95 {s(r.e2e_p95_s)}  p99 {s(r.e2e_p99_s)}",
        f"hit ratio token {s(r.token_hit_ratio, '')}  block {s(r.block_hit_ratio, '')}  "
        f"session {s(r.session_hit_ratio, '')}  recomputed share {s(r.recomputed_share, '')}  "
        f"(client-side token {s(r.client_token_hit_ratio, '')})",
    ]
    if r.error_kinds:
        lines.append("errors: " + ", ".join(f"{k} x{n}" for k, n in sorted(r.error_kinds.items())))
    return "\n".join(lines)


def write_json(report: LoadReport, path: Path) -> None:
    """Writes the report (with per-request results) as JSON."""
    path.write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n")
