"""The load generator: replays a workload against an OpenAI-compatible endpoint.

:mod:`.replay` sends the requests (sessions in parallel, turns in order, streamed or not)
and :mod:`.report` turns what came back, and the model servers' ``/metrics``
counter deltas, into the figures ``dscache load`` prints and ``--json`` writes.
"""

from dscache_tools.loadgen.replay import LoadConfig, run_load, think_times
from dscache_tools.loadgen.report import (
    LoadReport,
    RequestResult,
    build_report,
    cache_figures,
    format_report,
    parse_counters,
    percentile,
    scrape,
    write_json,
)

__all__ = [
    "LoadConfig",
    "LoadReport",
    "RequestResult",
    "build_report",
    "cache_figures",
    "format_report",
    "parse_counters",
    "percentile",
    "run_load",
    "scrape",
    "think_times",
    "write_json",
]
