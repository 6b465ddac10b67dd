"""Rollout analysis: PromQL over Prometheus' HTTP API, and the verdict (pure part separate).

Queries (``{sel}`` = namespace and revision label matchers, ``{w}`` = the step
interval as a range):

* hit rate: ``sum(rate(dscache_server_cache_hits_total{level="token",sel}[w]))
  / (hits + sum(rate(dscache_server_cache_misses_total{level="token",sel}[w])))``
* P99 TTFT: ``histogram_quantile(0.99, sum by (le)
  (rate(dscache_server_ttft_seconds_bucket{sel}[w])))``, for the canary and the
  stable revision.

Verdict rules (:func:`judge`): a missing or NaN canary figure is ``NoData``
(hold; never promote blind); an unreachable Prometheus is also ``NoData`` with
the error in the message; hit rate below ``minHitRate`` or canary P99 above
``stable P99 x maxTtftP99Ratio`` (or above ``maxTtftP99Seconds``) is ``Fail``;
otherwise ``Pass``. Without stable TTFT data the ratio check is skipped and
said so.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from dscache_operator.rollout import Verdict
from dscache_operator.spec import AnalysisSpec

log = logging.getLogger(__name__)


class PrometheusError(RuntimeError):
    """Prometheus could not answer a query."""


@dataclass(frozen=True)
class Figures:
    """The measured figures of one step (None = no data)."""

    hit_rate: float | None
    ttft_p99_seconds: float | None
    stable_ttft_p99_seconds: float | None


def _range(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def queries(
    spec: AnalysisSpec, *, namespace: str, canary: str, stable: str, window_s: float
) -> dict[str, str]:
    """The PromQL of each figure."""

    def sel(revision: str) -> str:
        return f'{spec.namespace_label}="{namespace}",{spec.revision_label}="{revision}"'

    w = _range(window_s)
    hits = f'sum(rate(dscache_server_cache_hits_total{{level="token",{sel(canary)}}}[{w}]))'
    misses = f'sum(rate(dscache_server_cache_misses_total{{level="token",{sel(canary)}}}[{w}]))'

    def p99(revision: str) -> str:
        return (
            "histogram_quantile(0.99, sum by (le) "
            f"(rate(dscache_server_ttft_seconds_bucket{{{sel(revision)}}}[{w}])))"
        )

    return {
        "hit_rate": f"{hits} / ({hits} + {misses})",
        "ttft_p99_seconds": p99(canary),
        "stable_ttft_p99_seconds": p99(stable),
    }


def judge(spec: AnalysisSpec, figures: Figures) -> Verdict:
    """The verdict on ``figures`` under ``spec``'s thresholds (pure)."""
    hr, p99, stable = figures.hit_rate, figures.ttft_p99_seconds, figures.stable_ttft_p99_seconds
    base = {"hit_rate": hr, "ttft_p99_seconds": p99, "stable_ttft_p99_seconds": stable}
    if hr is None or p99 is None:
        missing = [n for n, v in (("hit rate", hr), ("P99 TTFT", p99)) if v is None]
        return Verdict("NoData", f"no canary data for {', '.join(missing)}", **base)
    text = f"hit rate {hr:.3f} (min {spec.min_hit_rate}), P99 TTFT {p99:.3f}s"
    if hr < spec.min_hit_rate:
        return Verdict("Fail", f"{text}: hit rate below {spec.min_hit_rate}", **base)
    if spec.max_ttft_p99_seconds is not None and p99 > spec.max_ttft_p99_seconds:
        return Verdict("Fail", f"{text}: above {spec.max_ttft_p99_seconds}s", **base)
    if stable is None:
        return Verdict("Pass", f"{text}; no stable TTFT data, ratio not checked", **base)
    limit = stable * spec.max_ttft_p99_ratio
    if p99 > limit:
        return Verdict(
            "Fail",
            f"{text} > stable {stable:.3f}s x {spec.max_ttft_p99_ratio} = {limit:.3f}s",
            **base,
        )
    return Verdict("Pass", f"{text} <= {limit:.3f}s (stable {stable:.3f}s)", **base)


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
) -> Verdict:
    """Fetches the figures and judges them; no Prometheus -> NoData."""
    if not spec.enabled:
        return Verdict("Skipped", "analysis disabled (spec.rollout.analysis.enabled=false)")
    if client is None:
        return Verdict("NoData", "no Prometheus URL (spec.rollout.analysis.prometheusUrl)")
    q = queries(spec, namespace=namespace, canary=canary, stable=stable, window_s=window_s)
    try:
        figures = Figures(**{name: client.scalar(promql) for name, promql in q.items()})
    except PrometheusError as exc:
        log.warning("analysis of %s/%s: %s", namespace, canary, exc)
        return Verdict("NoData", f"Prometheus unavailable: {exc}")
    return judge(spec, figures)
