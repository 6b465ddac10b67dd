"""The test loop's rules, as a pytest plugin: what is slow, and a check that says so.

The suite has two tiers. The fast tier (``scripts/test.sh --fast``: ``-m "not
slow"``) is every test that starts no process, builds no model and needs no
cluster; it runs in a couple of minutes. Everything else is ``slow``.

Contract:
    * ``slow`` is a marker, never a hand-kept list of tests. A test is slow when it
      says so (``@pytest.mark.slow``, a module's ``pytestmark``), when it carries
      one of the markers that need more than the repository (``cluster``, ``vllm``,
      ``images``), or when it uses a fixture that starts a process
      (:data:`PROCESS_FIXTURES`, a list of fixtures, not of tests).
    * ``--max-unmarked-seconds S`` makes the marker checked: a test not marked
      slow whose setup, call and teardown took more than ``S`` seconds of wall
      time fails the run (listed at the end, with the marker to add). The fast
      tier runs with ``S = 2``.
    * ``--durations-json FILE`` writes every test's wall time (setup + call +
      teardown, seconds) and outcome, for ``scripts/test.sh --timings``.
    * Both work under pytest-xdist (the controller keeps the table).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

#: Markers whose tests need more than the repository; each implies ``slow``.
HEAVY_MARKERS = ("cluster", "vllm", "images")
#: Fixtures that start a process (a server, a daemon, a cluster) or build a model, as
#: ``<folder of the conftest that defines it>::<name>``; every test that uses one,
#: directly or through another fixture, is ``slow``.
PROCESS_FIXTURES = frozenset(
    {
        "tests::dev_cluster",  # the control plane and its nodes
        "tests/sidecar::daemon_factory",  # a sidecar daemon as its own process
        "tests/sidecar::cluster",  # a real Redis Cluster (the shared tier)
        "tests/server::sidecar",  # a sidecar daemon process beside the model server
        "tests/server::live_server",  # a model server process
        "tests/server::live_server_module",
        "tests/router::nginx",  # real NGINX
        "tests/router::pods",  # stand-in pods behind it
        "tests/operator::prometheus",  # Debian's Prometheus
        "tests/operator::operator",  # the operator process
        "tests/vllm::vllm_model",  # a checkpoint for a real vLLM
        "tests/vllm/test_worker.py::daemon",  # a sidecar daemon process
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dscache test loop")
    group.addoption(
        "--max-unmarked-seconds",
        type=float,
        default=None,
        help="fail the run when a test not marked slow takes longer than this (wall seconds)",
    )
    group.addoption(
        "--durations-json",
        default=None,
        help="write every test's wall seconds (setup + call + teardown) to this JSON file",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the controller sees every worker's reports: it keeps the table.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Timings(config), "dscache-timings")


def is_slow(item: pytest.Item) -> bool:
    """Whether the rules above make ``item`` slow (before it is marked)."""
    if any(item.get_closest_marker(m) is not None for m in ("slow", *HEAVY_MARKERS)):
        return True
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in item.fixturenames:  # type: ignore[attr-defined]
        defs = info.name2fixturedefs.get(name)
        if defs and f"{defs[-1].baseid}::{name}" in PROCESS_FIXTURES:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and is_slow(item):
            item.add_marker(pytest.mark.slow)


class _Timings:
    """Each test's wall time and outcome (on the controller under pytest-xdist too)."""

    def __init__(self, config: pytest.Config) -> None:
        self.limit: float | None = config.getoption("--max-unmarked-seconds")
        self.out: str | None = config.getoption("--durations-json")
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.outcomes: dict[str, str] = {}
        self.slow: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcomes.setdefault(report.nodeid, report.outcome)
        if "slow" in report.keywords:
            self.slow.add(report.nodeid)

    def too_slow(self) -> list[tuple[str, float]]:
        """Tests not marked slow over the limit, slowest first."""
        if self.limit is None:
            return []
        late = [(n, s) for n, s in self.seconds.items() if n not in self.slow and s > self.limit]
        return sorted(late, key=lambda x: -x[1])

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.out:
            rows = [
                {
                    "test": n,
                    "seconds": round(s, 3),
                    "outcome": self.outcomes.get(n, "passed"),
                    "slow": n in self.slow,
                }
                for n, s in sorted(self.seconds.items(), key=lambda x: -x[1])
            ]
            Path(self.out).write_text(json.dumps(rows, indent=1) + "\n")
        if self.too_slow() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        late = self.too_slow()
        if not late:
            return
        terminalreporter.section("tests not marked slow that took longer than the fast tier allows")
        for nodeid, seconds in late:
            terminalreporter.write_line(f"{seconds:7.2f} s  {nodeid}")
        terminalreporter.write_line(
            f"each took over {self.limit:g} s: mark it @pytest.mark.slow (or make it fast)"
        )
