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
      teardown, seconds), CPU time and outcome, for ``scripts/test.sh --timings``.
    * ``--cpu-durations N`` lists the N tests that used the most CPU: the pytest
      process's own plus that of every child process it waited for (a server a
      test starts and stops, and the children that server waited for). On a
      machine whose cores are all busy this, not wall time, says what a test
      costs the run. A session fixture's processes count where they are
      stopped (the last test's teardown).
    * Both work under pytest-xdist (the controller keeps the table).
"""

from __future__ import annotations

import json
import resource
from collections import defaultdict
from collections.abc import Iterator
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
        help="write every test's wall and CPU seconds (setup + call + teardown) to this JSON file",
    )
    group.addoption(
        "--cpu-durations",
        type=int,
        default=0,
        metavar="N",
        help="list the N tests that used the most CPU (with the child processes they waited for)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the controller sees every worker's reports: it keeps the table.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Timings(config), "dscache-timings")


def _cpu_seconds() -> float:
    """User + system CPU of this process and of every child it has waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _measured(item: pytest.Item, when: str) -> Iterator[None]:
    """Wraps one phase of a test: its CPU goes into the item's user properties, which
    the phase's report carries (to the controller under pytest-xdist too)."""
    start = _cpu_seconds()
    yield
    item.user_properties.append((f"cpu_seconds_{when}", _cpu_seconds() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _measured(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _measured(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield from _measured(item, "teardown")


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
        self.cpu_top: int = config.getoption("--cpu-durations")
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.outcomes: dict[str, str] = {}
        self.slow: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        key = f"cpu_seconds_{report.when}"
        self.cpu[report.nodeid] += sum(
            float(v)
            for k, v in report.user_properties
            if k == key  # type: ignore[arg-type]
        )
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
                    "cpu_seconds": round(self.cpu.get(n, 0.0), 3),
                    "outcome": self.outcomes.get(n, "passed"),
                    "slow": n in self.slow,
                }
                for n, s in sorted(self.seconds.items(), key=lambda x: -x[1])
            ]
            Path(self.out).write_text(json.dumps(rows, indent=1) + "\n")
        if self.too_slow() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.cpu_top > 0 and self.cpu:
            top = sorted(self.cpu.items(), key=lambda x: -x[1])[: self.cpu_top]
            total = sum(self.cpu.values())
            terminalreporter.section(
                f"most CPU: {len(top)} tests ({total:.0f} CPU-s for all, with their children)"
            )
            for nodeid, cpu in top:
                wall = self.seconds.get(nodeid, 0.0)
                terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {nodeid}")
        late = self.too_slow()
        if not late:
            return
        terminalreporter.section("tests not marked slow that took longer than the fast tier allows")
        for nodeid, seconds in late:
            terminalreporter.write_line(f"{seconds:7.2f} s  {nodeid}")
        terminalreporter.write_line(
            f"each took over {self.limit:g} s: mark it @pytest.mark.slow (or make it fast)"
        )
