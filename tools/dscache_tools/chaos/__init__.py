"""``dscache chaos``: failures under load against the local stack, zero failed requests.

One stack (NGINX, two model servers, each with its own sidecar; see
:mod:`dscache_tools.demo.stack`) serves the finance workload through the router
while one part fails. :mod:`.cases` is the matrix (what each fault does, what a
user sees, what recovers it), :mod:`.faults` does each fault to the running
stack, :mod:`.runner` drives the load and times each fault, :mod:`.counters`
reads the counters that explain a case (the servers' cache fallbacks, the
router's retries), and :mod:`.report` prints the table and writes the JSON.

Contract (``docs/chaos.md``):
    * ``dscache chaos [--quick] --json OUT`` writes ``cases``: one
      ``{name, requests, failed, ttft_p99_s, ...}`` per fault plus a ``baseline``
      without one; the command exits non-zero when any case failed a request.
    * Requests are not streamed (``stream: false``): a router can retry a request
      on another pod until the first byte, never after, so ``ttft_p99_s`` is the
      time to the whole answer (``ttft_kind`` says so).
    * Each fault starts after a third of its case's requests have finished and is
      undone after two thirds; every case starts from the healthy 2 + 2 stack.
"""

from dscache_tools.chaos.cases import CASES, Case
from dscache_tools.chaos.report import CaseResult, ChaosReport, format_table, write_json
from dscache_tools.chaos.runner import ChaosOptions, run_chaos

__all__ = [
    "CASES",
    "Case",
    "CaseResult",
    "ChaosOptions",
    "ChaosReport",
    "format_table",
    "run_chaos",
    "write_json",
]
