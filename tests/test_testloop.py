"""The test loop's own rules (``tests/testloop.py``), run on a throwaway suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent

SUITE = """
import subprocess, sys, time
import pytest

def test_a_child_burns_cpu():
    # Half a second of CPU in a child process the test waits for.
    subprocess.run([sys.executable, "-c",
        "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"],
        check=True)

def test_sleeps():
    time.sleep(0.3)

@pytest.mark.slow
def test_marked_and_sleeps():
    time.sleep(0.3)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    slow: slow\n"
    )
    pytester.makepyfile(test_suite=SUITE)
    return pytester


@pytest.mark.slow
def test_cpu_durations_count_the_children_a_test_waited_for(suite: pytest.Pytester) -> None:
    out = suite.path / "durations.json"
    result = suite.runpytest_subprocess(
        "-p", "testloop", "--cpu-durations", "2", "--durations-json", str(out)
    )
    result.assert_outcomes(passed=3)
    rows = {r["test"].split("::")[-1]: r for r in json.loads(out.read_text())}
    assert rows["test_a_child_burns_cpu"]["cpu_seconds"] >= 0.45
    assert rows["test_sleeps"]["cpu_seconds"] < 0.2 <= rows["test_sleeps"]["seconds"]
    # The report lists the child's test first.
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "most CPU: 2 tests" in line)
    listed = [line for line in lines[start + 1 :] if line.strip()]
    assert "test_a_child_burns_cpu" in listed[0]


@pytest.mark.slow
def test_an_unmarked_test_over_the_limit_fails_the_run(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-p", "testloop", "--max-unmarked-seconds", "0.2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*tests not marked slow that took longer*", "*test_sleeps*"])
    assert "test_marked_and_sleeps" not in result.stdout.str()
