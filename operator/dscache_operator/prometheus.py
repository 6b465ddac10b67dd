"""Prometheus' instant-query HTTP API (``/api/v1/query``), over httpx.

The operator's one reader of Prometheus: :func:`dscache_operator.analysis.analyse`
asks it for one number per query. Every failure (unreachable, an HTTP error,
a body that is not Prometheus' JSON, an error status) is a
:class:`~dscache_operator.analysis.PrometheusError`, which the analysis turns
into ``NoData``: a rollout holds rather than promotes blind.
"""

from __future__ import annotations

import math

import httpx

from dscache_operator.analysis import PrometheusError


class PrometheusClient:
    """Instant queries against one Prometheus (a :class:`~.analysis.ScalarQuery`)."""

    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def scalar(self, promql: str) -> float | None:
        """The single value of ``promql``; None for an empty result, NaN or infinity.

        Raises:
            PrometheusError: unreachable, HTTP error, or an error status.
        """
        try:
            resp = httpx.get(
                f"{self.base_url}/api/v1/query", params={"query": promql}, timeout=self.timeout_s
            )
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusError(f"{self.base_url}: {exc}") from exc
        if body.get("status") != "success":
            # Prometheus answers a bad query with 400 and a JSON error: say what it said.
            raise PrometheusError(f"{self.base_url}: {body.get('error', body)}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) or math.isinf(value) else value
