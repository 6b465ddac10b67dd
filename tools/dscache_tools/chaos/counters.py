"""Counters that explain a chaos case: cache fallbacks and router retries.

Contract:
    * A counter is read from Prometheus text with prometheus_client's parser and
      summed over its labels; an endpoint that does not answer, or lacks the
      family, counts as absent (None), never as 0.
    * A delta over a restart (the new process counts from 0) is the new count.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from dscache import metricnames as names

log = logging.getLogger(__name__)

#: Families summed per endpoint kind (``_total`` samples of these counters).
FALLBACKS = names.CACHE_FALLBACKS
ROUTER_PREFIX = names.ROUTER_PREFIX
RETRIES_WORD = "retr"


def counter_total(text: str, match: str, *, prefix: bool = False) -> float | None:
    """Sum of the ``_total`` samples of family ``match`` (or every family it prefixes
    whose name says retries, with ``prefix``); None when there is none."""
    total: float | None = None
    for family in text_string_to_metric_families(text):
        if prefix:
            hit = family.name.startswith(match) and RETRIES_WORD in family.name
        else:
            hit = family.name in (match, match + "_total")  # typed or untyped
        if not hit:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                total = (total or 0.0) + sample.value
    return total


def read(url: str, match: str, *, prefix: bool = False) -> float | None:
    """The counter at ``url``; None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
            text = resp.read().decode()
    except OSError as exc:
        log.debug("cannot read %s: %s", url, exc)
        return None
    return counter_total(text, match, prefix=prefix)


def delta(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> float | None:
    """Summed growth per endpoint; a restarted endpoint (smaller count) adds its new count."""
    grown: float | None = None
    for url, now in after.items():
        if now is None:
            continue
        was = before.get(url)
        step = now if was is None or now < was else now - was
        grown = (grown or 0.0) + step
    return grown
