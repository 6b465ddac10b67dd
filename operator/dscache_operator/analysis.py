"""Rollout analysis: PromQL over Prometheus' HTTP API, and the verdict (pure part separate).

Queries (``{sel(rev)}`` = namespace and revision label matchers, ``{w}`` = the
step interval as a range, ``{d}`` = the time since the step began):

* token hit rate of a revision: ``sum(rate(dscache_server_prompt_tokens_total
  {source="reused",sel(rev)}[w])) / sum(rate(dscache_server_prompt_tokens_total
  {sel(rev)}[w]))``, the share of prompt tokens served from the cache (prompts
  the cache never looked up count as recomputed), for the canary and, over the
  same window, for the stable revision;
* P99 TTFT: ``histogram_quantile(0.99, sum by (le)
  (rate(dscache_server_ttft_seconds_bucket{sel(rev)}[w])))``, for both revisions;
* the stable revision's two figures again with ``offset {d}``: over a window of
  the same length that ended when the step began. They stand in when the stable
  track had no traffic in the analysed window (blue-green, or a canary step of
  100%), so the canary is still compared with the stable track's own level
  under the same kind of traffic, just earlier.

Verdict rules (:func:`judge`), like against like: the canary's hit rate must be
at least ``minHitRateRatio x`` the stable track's hit rate (same window, else
the window before the step, said so in the message), and at least
``minHitRate`` when that optional floor is set; the canary's P99 TTFT at most
``stable P99 x maxTtftP99Ratio`` (same fallback; skipped, and said so, without
any stable TTFT) and at most ``maxTtftP99Seconds`` when set. A missing or NaN
canary figure is ``NoData`` (hold; never promote blind), and so is a missing
stable hit rate when no ``minHitRate`` floor could judge the canary alone; an
unreachable Prometheus is also ``NoData`` with the error in the message.
Anything else failing is ``Fail``; otherwise ``Pass``.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from dscache import metricnames as names
from dscache_operator.rollout_types import Verdict
from dscache_operator.spec import AnalysisSpec

log = logging.getLogger(__name__)


class PrometheusError(RuntimeError):
    """Prometheus could not answer a query."""


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


def token_hit_rate(selector: str, window: str, offset: str = "") -> str:
    """PromQL: the share of prompt tokens reused from the cache, over ``window``."""
    reused_sel = f'{names.SOURCE_LABEL}="{names.SOURCE_REUSED}",{selector}'
    reused = f"sum(rate({PROMPT_TOKENS}{{{reused_sel}}}[{window}]{offset}))"
    total = f"sum(rate({PROMPT_TOKENS}{{{selector}}}[{window}]{offset}))"
    return f"{reused} / {total}"


def _range(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def queries(
    spec: AnalysisSpec,
    *,
    namespace: str,
    canary: str,
    stable: str,
    window_s: float,
    since_step_s: float,
) -> dict[str, str]:
    """The PromQL of each :class:`Figures` field.

    Args:
        spec: the analysis settings (label names).
        namespace: the resource's namespace.
        canary: the canary revision hash.
        stable: the stable revision hash.
        window_s: the rate window (the step interval).
        since_step_s: seconds since the step began (the offset of the ``_before`` figures).
    """

    def sel(revision: str) -> str:
        return f'{spec.namespace_label}="{namespace}",{spec.revision_label}="{revision}"'

    w = _range(window_s)

    def hit_rate(revision: str, offset: str = "") -> str:
        return token_hit_rate(sel(revision), w, offset)

    def p99(revision: str, offset: str = "") -> str:
        return (
            "histogram_quantile(0.99, sum by (le) "
            f"(rate({names.TTFT_BUCKET_SERIES}{{{sel(revision)}}}[{w}]{offset})))"
        )

    before = f" offset {_range(since_step_s)}"
    return {
        "hit_rate": hit_rate(canary),
        "ttft_p99_seconds": p99(canary),
        "stable_hit_rate": hit_rate(stable),
        "stable_ttft_p99_seconds": p99(stable),
        "stable_hit_rate_before": hit_rate(stable, before),
        "stable_ttft_p99_seconds_before": p99(stable, before),
    }


def _pick(now: float | None, before: float | None) -> tuple[float | None, str]:
    if now is not None:
        return now, ""
    if before is not None:
        return before, " (stable's figure from before the step: no stable traffic in the window)"
    return None, ""


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
    parts.append(f"P99 TTFT {p99:.3f}s")
    if spec.max_ttft_p99_seconds is not None and p99 > spec.max_ttft_p99_seconds:
        failures.append(f"P99 TTFT above {spec.max_ttft_p99_seconds}s")
    if stable_p99 is None:
        parts.append("no stable TTFT data, ratio not checked")
    else:
        limit = stable_p99 * spec.max_ttft_p99_ratio
        parts.append(
            f"stable {stable_p99:.3f}s x {spec.max_ttft_p99_ratio} = {limit:.3f}s{p99_when}"
        )
        if p99 > limit:
            failures.append(f"P99 TTFT > stable {stable_p99:.3f}s x {spec.max_ttft_p99_ratio}")
    text = "; ".join(parts)
    if failures:
        return Verdict("Fail", f"{text}: {', '.join(failures)}", **base)
    return Verdict("Pass", text, **base)


class PrometheusClient:
    """Instant queries over ``/api/v1/query`` (stdlib HTTP, no extra dependency)."""

    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def scalar(self, promql: str) -> float | None:
        """The single value of ``promql``; None for an empty result or NaN.

        Raises:
            PrometheusError: unreachable, HTTP error, or an error status.
        """
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:  # noqa: S310
                body = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(f"{self.base_url}: {exc}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{self.base_url}: {body.get('error', body)}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) or math.isinf(value) else value


def analyse(
    client: PrometheusClient | None,
    spec: AnalysisSpec,
    *,
    namespace: str,
    canary: str,
    stable: str,
    window_s: float,
    since_step_s: float,
) -> Verdict:
    """Fetches the figures and judges them; no Prometheus -> NoData."""
    if not spec.enabled:
        return Verdict("Skipped", "analysis disabled (spec.rollout.analysis.enabled=false)")
    if client is None:
        return Verdict("NoData", "no Prometheus URL (spec.rollout.analysis.prometheusUrl)")
    q = queries(
        spec,
        namespace=namespace,
        canary=canary,
        stable=stable,
        window_s=window_s,
        since_step_s=since_step_s,
    )
    try:
        figures = Figures(**{name: client.scalar(promql) for name, promql in q.items()})
    except PrometheusError as exc:
        log.warning("analysis of %s/%s: %s", namespace, canary, exc)
        return Verdict("NoData", f"Prometheus unavailable: {exc}")
    return judge(spec, figures)
