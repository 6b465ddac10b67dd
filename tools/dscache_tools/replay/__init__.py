"""``dscache replay``: replays a request trace against the eviction policies.

The package, by responsibility:

* :mod:`~dscache_tools.replay.trace`: reading Mooncake and dscache JSONL traces.
* :mod:`~dscache_tools.replay.simulate`: the policies' replay, the ideal and the
  Belady bound (the contract of the simulation is there).
* :mod:`~dscache_tools.replay.report`: the table and the plot.
* :mod:`~dscache_tools.replay.cli`: ``dscache replay``'s arguments and exit codes.
"""

from __future__ import annotations

from dscache_tools.replay.cli import run_cli
from dscache_tools.replay.report import format_table, write_png
from dscache_tools.replay.simulate import (
    BeladyResult,
    HitRatios,
    PolicyResult,
    ReplayReport,
    replay,
    simulate,
    simulate_belady,
    simulate_ideal,
)
from dscache_tools.replay.trace import (
    MOONCAKE_BLOCK_TOKENS,
    Request,
    Trace,
    TraceError,
    build_trace,
    load_trace,
    parse_trace,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "BeladyResult",
    "HitRatios",
    "PolicyResult",
    "ReplayReport",
    "Request",
    "Trace",
    "TraceError",
    "build_trace",
    "format_table",
    "load_trace",
    "parse_trace",
    "replay",
    "run_cli",
    "simulate",
    "simulate_belady",
    "simulate_ideal",
    "write_png",
]
