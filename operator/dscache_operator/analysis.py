"""Rollout analysis: the PromQL of a step, and the verdict on its figures (pure).

The queries go out through a :class:`ScalarQuery` (in the operator,
:class:`dscache_operator.prometheus.PrometheusClient`), so this module does no
I/O of its own.

Queries (``{sel(rev)}`` = namespace and revision label matchers, ``{w}`` = the
step interval as a range, ``{d}`` = the time since the step began):

* token hit rate of a revision: ``sum(rate({CACHED}[w])) / sum(rate({PROMPT}[w]))``,
  the share of prompt tokens served from a cache (prompts the cache never
  looked up count as computed), for the canary and, over the same window, for
  the stable revision. Each selector names both engines' series, so one query
  reads a revision of either engine (and a rollout from one engine to the
  other compares like with like): ``{CACHED}`` is
  ``dscache_server_prompt_tokens_total{source="reused"}`` (the reference server)
  and ``vllm:prompt_tokens_by_source_total{source=~"local_cache_hit|
  external_kv_transfer"}`` (vLLM's own figures: its prefix cache and the KV
  connector, dscache); ``{PROMPT}`` is every prompt token,
  ``dscache_server_prompt_tokens_total`` or ``vllm:prompt_tokens_total``;
* P99 TTFT: ``histogram_quantile(0.99, sum by (le) (rate({TTFT}[w])))`` with
  ``{TTFT}`` ``dscache_server_ttft_seconds_bucket`` or vLLM's
  ``vllm:time_to_first_token_seconds_bucket``, for both revisions;
* the stable revision's two figures again with ``offset {d}``: over a window of
  the same length that ended when the step began. They stand in when the stable
  track had no traffic in the analysed window (blue-green, or a canary step of
  100%), so the canary is still compared with the stable track's own level
  under the same kind of traffic, just earlier.

Verdict rules (:func:`judge`), like against like: the canary's hit rate must be
at least ``minHitRateRatio x`` the stable track's hit rate (same window, else
the window before the step, said so in the message), and at least
``minHitRate`` when that optional floor is set; the canary's P99 TTFT at most
``stable P99 x maxTtftP99Ratio`` unless it is no more than
``minTtftP99IncreaseSeconds`` above stable's (a P99 over one step's window at low
latencies rests on a few requests and one histogram bucket; same fallback;
skipped, and said so, without any stable TTFT) and at most ``maxTtftP99Seconds``
when set. A missing or NaN
canary figure is ``NoData`` (hold; never promote blind), and so is a missing
stable hit rate when no ``minHitRate`` floor could judge the canary alone; an
unreachable Prometheus is also ``NoData`` with the error in the message.
Anything else failing is ``Fail``; otherwise ``Pass``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from dscache import metricnames as names
from dscache_operator.rollout_types import Verdict
from dscache_operator.spec import AnalysisSpec

log = logging.getLogger(__name__)


class PrometheusError(RuntimeError):
    """Prometheus could not answer a query."""


class ScalarQuery(Protocol):
    """Something that answers an instant PromQL query with one number."""

    def scalar(self, promql: str) -> float | None:
        """The single value of ``promql``; None for an empty result or NaN.

        Raises:
            PrometheusError: the query could not be answered.
        """
        ...


@dataclass(frozen=True)
class Step:
    """What one analysis compares: two revisions of a namespace over one window."""

    namespace: str
    canary: str
    stable: str
    window_s: float
    since_step_s: float


@dataclass(frozen=True)
class Figures:
    """The measured figures of one step (None = no data).

    ``stable_*_before`` are the stable revision's figures over a window of the
    same length that ended when the step began.
    """

    hit_rate: float | None
    ttft_p99_seconds: float | None
    stable_hit_rate: float | None = None
    stable_ttft_p99_seconds: float | None = None
    stable_hit_rate_before: float | None = None
    stable_ttft_p99_seconds_before: float | None = None


#: Prompt tokens by ``source`` (reused from the cache, recomputed): every prompt
#: token lands in one of the two, also for prompts the cache never looked up
#: (below minTokens, a failed sidecar), so a revision whose cache admits nothing
#: shows a hit rate of 0, not an absence of data.
PROMPT_TOKENS = names.PROMPT_TOKENS_SERIES


def _names(*series: str) -> str:
    """A matcher on the metric name: any of ``series`` (they hold no regex characters)."""
    return f'__name__=~"{"|".join(series)}"'


#: Prompt tokens some cache served, of either engine: the reference server's
#: ``reused`` ones; vLLM's prefix-cache and KV-connector (dscache) ones.
CACHED_TOKENS = ",".join(
    (
        _names(PROMPT_TOKENS, names.VLLM_PROMPT_TOKENS_BY_SOURCE_SERIES),
        f'{names.SOURCE_LABEL}=~"{"|".join((names.SOURCE_REUSED, *names.VLLM_CACHED_SOURCES))}"',
    )
)
#: Every prompt token, of either engine (the server counts each once, under one
#: ``source``; vLLM's total has no source label).
ALL_PROMPT_TOKENS = _names(PROMPT_TOKENS, names.VLLM_PROMPT_TOKENS_SERIES)
#: The TTFT histogram's buckets, of either engine.
TTFT_BUCKETS = _names(names.TTFT_BUCKET_SERIES, names.VLLM_TTFT_BUCKET_SERIES)


def _and(*matchers: str) -> str:
    """The non-empty matcher lists, comma separated."""
    return ",".join(m for m in matchers if m)


def _matchers(selector: str) -> str:
    """``{selector}``, or nothing for an empty selector."""
    return f"{{{selector}}}" if selector else ""


def sum_rate(series: str, selector: str, window: str, offset: str = "", by: str = "") -> str:
    """PromQL: ``sum [by (by)] (rate(series{selector}[window] offset))``."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}(rate({series}{_matchers(selector)}[{window}]{offset}))"


def token_hit_rate(selector: str, window: str, offset: str = "", by: str = "") -> str:
    """PromQL: the share of prompt tokens served from a cache, over ``window``.

    Reads the reference server's and vLLM's series alike (:data:`CACHED_TOKENS`,
    :data:`ALL_PROMPT_TOKENS`). ``by`` (label names, comma separated) keeps one
    rate per group, e.g. ``namespace, service`` for a cluster-wide rule; empty
    sums everything.
    """
    cached = sum_rate("", _and(CACHED_TOKENS, selector), window, offset, by)
    total = sum_rate("", _and(ALL_PROMPT_TOKENS, selector), window, offset, by)
    return f"{cached} / {total}"


def ttft_p99(selector: str, window: str, offset: str = "") -> str:
    """PromQL: the P99 seconds to the first token, of either engine, over ``window``."""
    buckets = f"{{{_and(TTFT_BUCKETS, selector)}}}"
    return f"histogram_quantile(0.99, sum by (le) (rate({buckets}[{window}]{offset})))"


def level_hit_rate(level: str, selector: str, window: str, by: str = "") -> str:
    """PromQL: hits / (hits + misses) at ``level`` (block or session), over ``window``."""
    sel = _and(f'{names.LEVEL_LABEL}="{level}"', selector)
    hits = sum_rate(names.CACHE_HITS + "_total", sel, window, by=by)
    misses = sum_rate(names.CACHE_MISSES + "_total", sel, window, by=by)
    return f"{hits} / ({hits} + {misses})"


def lookup_p99(selector: str, window: str, by: str = "") -> str:
    """PromQL: the P99 seconds of the model server's cache lookups, over ``window``."""
    sel = _and(f'{names.OP_LABEL}="{names.OP_LOOKUP}"', selector)
    series = f"{names.CACHE_OP_SECONDS}_bucket{_matchers(sel)}"
    return f"histogram_quantile(0.99, sum by ({_and('le', by)}) (rate({series}[{window}])))"


def fallback_ratio(selector: str, window: str, by: str = "") -> str:
    """PromQL: requests that recomputed because the cache failed, per request served."""
    fallbacks = sum_rate(names.CACHE_FALLBACKS + "_total", selector, window, by=by)
    return f"{fallbacks} / {sum_rate(names.REQUESTS + '_total', selector, window, by=by)}"


#: The sidecar's metrics port name: a ServiceMonitor target's ``endpoint`` label.
SIDECAR_ENDPOINT = "metrics"


def sidecar_up(selector: str) -> str:
    """PromQL: the scrape health (``up``) of every sidecar target ``selector`` matches."""
    endpoint = f'endpoint="{SIDECAR_ENDPOINT}"'
    return f"up{_matchers(_and(endpoint, selector))}"


def shared_tier_down(selector: str) -> str:
    """PromQL: sidecars (``selector``) that skip their shared tier after a failure
    (``dscache_sidecar_remote_up`` 0; the series exists only where a tier is set)."""
    return f"dscache_sidecar_remote_up{_matchers(selector)} == 0"


def _range(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def queries(spec: AnalysisSpec, step: Step) -> dict[str, str]:
    """The PromQL of each :class:`Figures` field.

    Args:
        spec: the analysis settings (label names).
        step: the namespace, the canary and stable revision hashes, the rate
            window (the step interval) and the seconds since the step began
            (the offset of the ``_before`` figures).
    """

    def sel(revision: str) -> str:
        return f'{spec.namespace_label}="{step.namespace}",{spec.revision_label}="{revision}"'

    w = _range(step.window_s)

    def hit_rate(revision: str, offset: str = "") -> str:
        return token_hit_rate(sel(revision), w, offset)

    def p99(revision: str, offset: str = "") -> str:
        return ttft_p99(sel(revision), w, offset)

    before = f" offset {_range(step.since_step_s)}"
    return {
        "hit_rate": hit_rate(step.canary),
        "ttft_p99_seconds": p99(step.canary),
        "stable_hit_rate": hit_rate(step.stable),
        "stable_ttft_p99_seconds": p99(step.stable),
        "stable_hit_rate_before": hit_rate(step.stable, before),
        "stable_ttft_p99_seconds_before": p99(step.stable, before),
    }


def _pick(now: float | None, before: float | None) -> tuple[float | None, str]:
    if now is not None:
        return now, ""
    if before is not None:
        return before, " (stable's figure from before the step: no stable traffic in the window)"
    return None, ""


def _judge_ttft(
    spec: AnalysisSpec,
    p99: float,
    stable_p99: float | None,
    when: str,
    *,
    parts: list[str],
    failures: list[str],
) -> None:
    """The latency half of :func:`judge`: adds what it read to ``parts`` and what
    failed to ``failures``."""
    parts.append(f"P99 TTFT {p99:.3f}s")
    if spec.max_ttft_p99_seconds is not None and p99 > spec.max_ttft_p99_seconds:
        failures.append(f"P99 TTFT above {spec.max_ttft_p99_seconds}s")
    if stable_p99 is None:
        parts.append("no stable TTFT data, ratio not checked")
        return
    limit = stable_p99 * spec.max_ttft_p99_ratio
    parts.append(f"stable {stable_p99:.3f}s x {spec.max_ttft_p99_ratio} = {limit:.3f}s{when}")
    if p99 <= limit:
        return
    slack = spec.min_ttft_p99_increase_seconds
    if p99 - stable_p99 > slack:
        failures.append(f"P99 TTFT > stable {stable_p99:.3f}s x {spec.max_ttft_p99_ratio}")
    else:
        parts.append(
            f"above it by ratio, but only {p99 - stable_p99:.3f}s over stable's "
            f"(<= {slack}s, minTtftP99IncreaseSeconds)"
        )


def judge(spec: AnalysisSpec, figures: Figures) -> Verdict:
    """The verdict on ``figures`` under ``spec``'s thresholds (pure)."""
    hr, p99 = figures.hit_rate, figures.ttft_p99_seconds
    stable_hr, hr_when = _pick(figures.stable_hit_rate, figures.stable_hit_rate_before)
    stable_p99, p99_when = _pick(
        figures.stable_ttft_p99_seconds, figures.stable_ttft_p99_seconds_before
    )
    base = {
        "hit_rate": hr,
        "stable_hit_rate": stable_hr,
        "ttft_p99_seconds": p99,
        "stable_ttft_p99_seconds": stable_p99,
    }
    if hr is None or p99 is None:
        missing = [n for n, v in (("hit rate", hr), ("P99 TTFT", p99)) if v is None]
        return Verdict("NoData", f"no canary data for {', '.join(missing)}", **base)
    floor = spec.min_hit_rate
    if stable_hr is None and floor is None:
        return Verdict(
            "NoData",
            f"canary hit rate {hr:.3f}, but no stable hit rate to compare it with "
            "(neither in the window nor before the step) and no minHitRate floor",
            **base,
        )
    parts = [f"hit rate {hr:.3f}"]
    failures: list[str] = []
    if stable_hr is not None:
        need = stable_hr * spec.min_hit_rate_ratio
        parts.append(f"stable {stable_hr:.3f} x {spec.min_hit_rate_ratio} = {need:.3f}{hr_when}")
        if hr < need:
            failures.append(f"hit rate below stable's {stable_hr:.3f} x {spec.min_hit_rate_ratio}")
    else:
        parts.append("no stable hit rate, ratio not checked")
    if floor is not None:
        parts.append(f"floor {floor}")
        if hr < floor:
            failures.append(f"hit rate below the floor {floor}")
    _judge_ttft(spec, p99, stable_p99, p99_when, parts=parts, failures=failures)
    text = "; ".join(parts)
    if failures:
        return Verdict("Fail", f"{text}: {', '.join(failures)}", **base)
    return Verdict("Pass", text, **base)


def analyse(client: ScalarQuery | None, spec: AnalysisSpec, step: Step) -> Verdict:
    """Fetches the figures and judges them; no Prometheus -> NoData."""
    if not spec.enabled:
        return Verdict("Skipped", "analysis disabled (spec.rollout.analysis.enabled=false)")
    if client is None:
        return Verdict("NoData", "no Prometheus URL (spec.rollout.analysis.prometheusUrl)")
    try:
        figures = Figures(
            **{name: client.scalar(promql) for name, promql in queries(spec, step).items()}
        )
    except PrometheusError as exc:
        log.warning("analysis of %s/%s: %s", step.namespace, step.canary, exc)
        return Verdict("NoData", f"Prometheus unavailable: {exc}")
    return judge(spec, figures)
