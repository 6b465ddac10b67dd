"""``dscache chaos --quick`` as a user runs it: every fault under load, no request fails.

The real CLI in a subprocess against the real local stack (NGINX, two model
servers, two sidecars; as root the full disk is a real tmpfs). The report's
own parts (ratio, counters over a restart, the table) are checked without a
stack below it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dscache_tools.chaos import CASES, CaseResult, ChaosReport, format_table
from dscache_tools.chaos.counters import counter_total, delta
from dscache_tools.demo.stack import child_env
from needs import need_nginx


def _chaos(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dscache.cli", "chaos", *args],
        env={**os.environ, **child_env()},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _mounts_under(path: Path) -> list[str]:
    text = Path("/proc/mounts").read_text()
    return [line for line in text.splitlines() if str(path) in line.split()[1]]


@pytest.mark.slow
def test_quick_matrix_loses_no_request(tmp_path: Path) -> None:
    need_nginx()
    out, workdir = tmp_path / "chaos.json", tmp_path / "wd"
    proc = _chaos("--quick", "--json", str(out), "--workdir", str(workdir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| case | requests | failed | p99 TTFT s |" in proc.stdout
    report = json.loads(out.read_text())
    assert "whole answer" in report["ttft_kind"]
    cases = {c["name"]: c for c in report["cases"]}
    assert list(cases) == [c.name for c in CASES]
    for name, case in cases.items():
        assert case["requests"] > 0, name
        assert case["failed"] == 0, (name, case["error_kinds"])
        assert 0 < case["ttft_p99_s"] < 120, name
    assert cases["baseline"]["ttft_p99_ratio"] == 1.0
    # The fault really happened mid-load and its part came back.
    assert any("back in" in n for n in cases["sidecar_killed"]["notes"])
    assert any("ready again" in n for n in cases["server_killed"]["notes"])
    expected = "tmpfs" if os.geteuid() == 0 else "enospc-fault"
    assert cases["cache_disk_full"]["method"] == expected
    assert _mounts_under(workdir) == []  # every tmpfs unmounted


@pytest.mark.slow  # a CLI run: a process, or a real tokenizer loaded twice
def test_bad_flag_is_a_clear_error_before_anything_starts() -> None:
    proc = _chaos("--requests", "0", timeout=60)
    assert proc.returncode != 0
    assert "--requests must be >= 1" in proc.stderr + proc.stdout


def _case(name: str, p99: float | None, failed: int = 0) -> CaseResult:
    return CaseResult(name, "f", 8, failed, p99, p99, 1.0)


def test_ratio_to_baseline_and_failed_total_in_the_table() -> None:
    report = ChaosReport("tiny-gqa", 4, 8, "time to the whole answer")
    report.add(_case("baseline", 2.0))
    report.add(_case("server_killed", 5.0, failed=1))
    report.add(_case("sidecar_slow", None))
    ratios = [c.ttft_p99_ratio for c in report.cases]
    assert ratios == [1.0, 2.5, None]
    assert report.failed == 1 and report.to_dict()["failed"] == 1
    table = format_table(report)
    assert "| server_killed | 8 | 1 | 5.00 | 2.50 |" in table
    assert "| sidecar_slow | 8 | 0 | - | - |" in table


def test_counter_deltas_survive_a_restart_and_absent_is_not_zero() -> None:
    text = (
        "# HELP dscache_server_cache_fallbacks_total Requests that skipped the cache.\n"
        "# TYPE dscache_server_cache_fallbacks_total counter\n"
        'dscache_server_cache_fallbacks_total{reason="timeout"} 3\n'
        'dscache_server_cache_fallbacks_total{reason="unavailable"} 2\n'
    )
    assert counter_total(text, "dscache_server_cache_fallbacks") == 5
    assert counter_total(text, "dscache_router_", prefix=True) is None
    # a: grew by 4; b: restarted (counts from 0 again), its new count is 1.
    assert delta({"a": 1.0, "b": 7.0}, {"a": 5.0, "b": 1.0}) == 5.0
    assert delta({"a": None}, {"a": None}) is None
