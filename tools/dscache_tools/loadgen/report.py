"""What a replay saw: per-request results, the run's figures, the servers' counters.

Contract:
    * Latency percentiles are numpy's linear interpolation over the successful
      requests; a figure with no sample is None (JSON null), never 0.
    * Cache figures are deltas of the model servers' Prometheus counters (names
      from :mod:`dscache.metricnames`) over the run, summed over servers; the
      client-side ``client_token_hit_ratio`` comes from each response's ``usage``.
    * ``LoadReport.to_dict`` is what ``--json`` writes: its keys are a contract
      (``docs/demo.md``); ``breakdown`` is where the time to first token went
      (:mod:`dscache_tools.loadgen.breakdown`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dscache import metricnames as names
from dscache_tools.loadgen.breakdown import breakdown, format_breakdown, phase_series

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
    timings: dict[str, float] = field(default_factory=dict)  # the server's, per phase
    #: :func:`conversation_digest` of the messages before this turn's question (the
    #: history it carried) and of its messages plus the answer it got (the history
    #: the pod that served it now holds): tells apart conversations whose text differs
    history_digest: str = ""
    left_digest: str = ""


def conversation_digest(messages: Sequence[Mapping[str, Any]]) -> str:
    """A short digest of ``messages``' roles and texts (other keys ignored): two
    conversations with the same digest sent a router the same history."""
    canon = json.dumps(
        [[str(m.get("role")), str(m.get("content"))] for m in messages], ensure_ascii=False
    )
    return hashlib.blake2b(canon.encode(), digest_size=12).hexdigest()


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
    breakdown: dict[str, Any] = field(default_factory=dict)
    results: list[RequestResult] = field(default_factory=list)

    def to_dict(self, *, with_results: bool = True) -> dict[str, Any]:
        """JSON-ready dict; ``with_results`` keeps the per-request list."""
        d = asdict(self)
        if not with_results:
            d.pop("results")
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None when empty.

    numpy's default ("linear", type 7 of Hyndman and Fan): rank ``(n-1) * q / 100``
    between the two nearest samples.
    """
    if not values:
        return None
    return float(np.percentile(values, q))


def parse_counters(text: str) -> dict[str, float]:
    """The server counters this module reads, from Prometheus text format.

    Keys look like ``dscache_server_prompt_tokens{source="reused"}``. Missing
    samples are absent (an old server, or the cache never ran).
    """
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {(f, lbl, v) for f, lbl, v in _SERVER_COUNTERS}
    phase_sums = {names.REQUEST_PHASE_SECONDS + "_sum", names.REQUEST_PHASE_SECONDS + "_count"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in phase_sums:
                suffix = sample.name.rsplit("_", 1)[1]
                key = phase_series(sample.labels.get(names.PHASE_LABEL, ""), suffix)
                out[key] = out.get(key, 0.0) + sample.value
                continue
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


def build_report(
    target: str,
    concurrency: int,
    results: list[RequestResult],
    elapsed: float,
    delta: dict[str, float],
) -> LoadReport:
    """The figures of a run from its results and the counter deltas."""
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
        target=target,
        concurrency=concurrency,
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
        breakdown=breakdown(
            [(r.ttft_s, r.timings) for r in ok if r.ttft_s is not None and r.timings], delta
        ),
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
    if r.breakdown.get("requests"):
        lines += ["", "where the time to first token went:"]
        lines.append(format_breakdown({"this run": r.breakdown}))
    return "\n".join(lines)


def write_json(report: LoadReport, path: Path) -> None:
    """Writes the report (with per-request results) as JSON."""
    path.write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n")
