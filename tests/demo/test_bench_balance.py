"""``dscache bench balance``'s figures: pod shares, ratios, the table; and the stack's
router taking the factor it is given (rendered config, checked by ``nginx -t``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from dscache_tools.bench.balance import BalanceRun, busiest_share, ratios, table, workload
from dscache_tools.demo.parts import Router, render_router
from needs import need_nginx


def _run(factor: float, hit: float, p99: float, qps: float) -> BalanceRun:
    return BalanceRun(factor, 40, 0, qps, hit, p99 / 2, p99, 0.5, 0.0)


def test_busiest_share_counts_answered_requests_per_pod() -> None:
    assert busiest_share(["a", "a", "a", "b"]) == 0.75
    assert busiest_share(["a", None, "b"]) == 0.5  # a failed request names no pod
    assert busiest_share([]) == 0.0


def test_ratios_are_balanced_over_plain_and_none_without_a_base() -> None:
    rel = ratios(_run(0, 0.8, 4.0, 1.0), _run(1.25, 0.76, 2.0, 1.5))
    assert rel["token_hit_ratio"] == 0.95
    assert rel["ttft_p99_s"] == 0.5 and rel["qps"] == 1.5
    none = ratios(_run(0, 0.0, 4.0, 1.0), _run(1.25, 0.7, 2.0, 1.0))
    assert none["token_hit_ratio"] is None
    text = table([_run(0, 0.8, 4.0, 1.0), _run(1.25, 0.76, 2.0, 1.5)], rel)
    assert "token hit 0.950x" in text and "TTFT p99 0.50x" in text


def test_the_workload_routes_half_its_requests_by_prompt() -> None:
    reqs = workload(quick=True, seed=0, max_tokens=4)
    idless = sum(1 for r in reqs if r.session_id is None)
    assert 0.25 < idless / len(reqs) < 0.75
    assert workload(quick=True, seed=0, max_tokens=4) == reqs  # same requests every run


@pytest.mark.slow
def test_the_local_router_renders_the_factor_it_is_given(tmp_path: Path) -> None:
    nginx = need_nginx()
    for factor, marker in ((0.0, "hash $dscache_key consistent;"), (2.0, "balancer_by_lua")):
        workdir = tmp_path / f"f{factor}"
        workdir.mkdir()
        router = Router(
            port=18080,
            workdir=workdir,
            conf=workdir / "nginx.conf",
            child=None,  # type: ignore[arg-type]  # never started
            stable=("127.0.0.1:18001", "127.0.0.1:18002"),
            balance_factor=factor,
        )
        render_router(router)
        text = router.conf.read_text()
        assert marker in text
        done = subprocess.run(
            [nginx, "-t", "-p", str(workdir), "-c", str(router.conf), "-e", "stderr"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
