"""Prometheus' instant-query HTTP API (``/api/v1/query``), over httpx, bounded.

The operator's one reader of Prometheus: :func:`dscache_operator.analysis.analyse`
asks it for one number per query. Every failure (unreachable, an HTTP error,
a body that is not Prometheus' JSON, an error status, the budget spent, a body
over the cap) is a :class:`~dscache_operator.analysis.PrometheusError`, which
the analysis turns into ``NoData``: a rollout holds rather than promotes blind.

Bounds (a Prometheus URL is only fetched when the admin allows it, see
:mod:`dscache_operator.policy`, but an allowed server can still be slow or
broken):

* a query has a total timeout, and a client optionally a budget for all of
  its queries (the reconciler makes one client per analysis): connecting and
  each read wait at most for what was left when the query started, and the
  body is read in chunks with the deadline checked after each, so a server
  that drips one byte at a time is cut off when the time is up, not when it
  stops sending (a timeout per read, as before, never ended it);
* a body larger than ``max_body_bytes`` is not read past the cap;
* an error's message names the URL, the HTTP status and Prometheus'
  ``errorType`` (a short enum), never the body's text: messages end up in the
  resource's conditions and events, which every reader of the resource sees.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time

import httpx

from dscache_operator.analysis import PrometheusError

log = logging.getLogger(__name__)
_ERROR_TYPE = re.compile(r"^[a-z_]{1,32}$")


class PrometheusClient:
    """Instant queries against one Prometheus (a :class:`~.analysis.ScalarQuery`).

    Args:
        base_url: Prometheus' base URL.
        timeout_s: seconds one query may take in all (connection, headers, body).
        max_body_bytes: largest answer read.
        budget_s: seconds every query of this client may take together (None: no
            limit beyond ``timeout_s`` each); the reconciler makes one client per
            analysis with a budget, so one analysis never holds a handler longer.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 10.0,
        max_body_bytes: int = 1 << 20,
        budget_s: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.budget_s = budget_s
        self._budget_end = None if budget_s is None else time.monotonic() + budget_s

    def _deadline(self) -> float:
        end = time.monotonic() + self.timeout_s
        return end if self._budget_end is None else min(end, self._budget_end)

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError(f"{self.base_url}: {self._late()}")
        return left

    def _late(self) -> str:
        budget = f" (analysis budget {self.budget_s:g}s)" if self.budget_s is not None else ""
        return f"no whole answer within {self.timeout_s:g}s{budget}"

    def _get(self, promql: str) -> tuple[int, bytes]:
        deadline = self._deadline()
        left = self._left(deadline)
        body = bytearray()
        with httpx.stream(
            "GET",
            f"{self.base_url}/api/v1/query",
            params={"query": promql},
            timeout=httpx.Timeout(left),
            follow_redirects=False,
        ) as resp:
            for chunk in resp.iter_bytes():  # as it arrives (a size would wait to fill it)
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise PrometheusError(
                        f"{self.base_url}: answer larger than {self.max_body_bytes} bytes"
                    )
                self._left(deadline)
            return resp.status_code, bytes(body)

    def scalar(self, promql: str) -> float | None:
        """The single value of ``promql``; None for an empty result, NaN or infinity.

        Raises:
            PrometheusError: unreachable, HTTP error, an error status, the budget
                spent or a body over the cap; the message has no body text.
        """
        try:
            code, raw = self._get(promql)
        except httpx.TimeoutException as exc:
            raise PrometheusError(f"{self.base_url}: {self._late()}") from exc
        except httpx.HTTPError as exc:
            raise PrometheusError(f"{self.base_url}: {type(exc).__name__}") from exc
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise PrometheusError(f"{self.base_url}: HTTP {code}, not Prometheus' JSON") from exc
        if not isinstance(body, dict) or body.get("status") != "success":
            kind = body.get("errorType") if isinstance(body, dict) else None
            kind = kind if isinstance(kind, str) and _ERROR_TYPE.match(kind) else "unknown"
            # The error text stays in the operator's log (admins only), cut short.
            detail = body.get("error") if isinstance(body, dict) else None
            log.info("Prometheus %s: HTTP %d %s: %.200r", self.base_url, code, kind, detail)
            raise PrometheusError(f"{self.base_url}: HTTP {code}, error type {kind}")
        try:
            result = body["data"]["result"]
            if not result:
                return None
            value = float(result[0]["value"][1])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrometheusError(f"{self.base_url}: HTTP {code}, not a vector answer") from exc
        return None if math.isnan(value) or math.isinf(value) else value
