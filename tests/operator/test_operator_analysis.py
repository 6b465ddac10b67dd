"""Rollout analysis: the verdict rules, and the PromQL against a real Prometheus."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dscache_operator.analysis import Figures, PrometheusClient, analyse, judge, queries
from dscache_operator.spec import AnalysisSpec
from fakes.server_metrics import FakeServerMetrics
from fakes.server_metrics import Figures as Served
from operator_harness import PrometheusProcess

SPEC = AnalysisSpec()


@pytest.mark.parametrize(
    ("figures", "result", "words"),
    [
        (Figures(0.90, 0.30, 0.30), "Pass", "<= 0.360s"),
        (Figures(0.84, 0.30, 0.30), "Fail", "hit rate below 0.85"),
        (Figures(0.90, 0.50, 0.30), "Fail", "> stable 0.300s x 1.2"),
        (Figures(0.90, 0.50, None), "Pass", "ratio not checked"),
        (Figures(None, 0.30, 0.30), "NoData", "hit rate"),
        (Figures(0.90, None, 0.30), "NoData", "P99 TTFT"),
    ],
)
def test_verdicts(figures: Figures, result: str, words: str) -> None:
    v = judge(SPEC, figures)
    assert v.result == result and words in v.message
    assert v.hit_rate == figures.hit_rate


def test_absolute_ttft_ceiling() -> None:
    v = judge(AnalysisSpec(max_ttft_p99_seconds=0.25), Figures(0.9, 0.3, 0.3))
    assert v.result == "Fail" and "above 0.25s" in v.message


def test_queries_select_namespace_and_revision() -> None:
    q = queries(SPEC, namespace="prod", canary="bbb", stable="aaa", window_s=120)
    assert 'namespace="prod",dscache_io_revision="bbb"' in q["hit_rate"]
    assert "[120s]" in q["hit_rate"] and 'level="token"' in q["hit_rate"]
    assert 'dscache_io_revision="aaa"' in q["stable_ttft_p99_seconds"]


def test_no_prometheus_or_a_dead_one_is_no_data() -> None:
    assert analyse(None, SPEC, namespace="n", canary="b", stable="a", window_s=5).result == "NoData"
    dead = PrometheusClient("http://127.0.0.1:9", timeout_s=1)
    v = analyse(dead, SPEC, namespace="n", canary="b", stable="a", window_s=5)
    assert v.result == "NoData" and "unavailable" in v.message
    off = AnalysisSpec(enabled=False)
    assert analyse(None, off, namespace="n", canary="b", stable="a", window_s=5).result == "Skipped"


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusProcess]:
    metrics = FakeServerMetrics()
    p = PrometheusProcess(Path(tmp_path_factory.mktemp("prom")), metrics)
    yield p
    p.close()
    metrics.close()


def test_real_prometheus_figures_and_verdicts(prom: PrometheusProcess) -> None:
    prom.metrics.set("ns1", "stable1", Served(hit_rate=0.9, ttft_s=0.2))
    prom.metrics.set("ns1", "good", Served(hit_rate=0.95, ttft_s=0.2))
    prom.metrics.set("ns1", "slow", Served(hit_rate=0.95, ttft_s=2.0))
    prom.metrics.set("ns1", "cold", Served(hit_rate=0.40, ttft_s=0.2))
    client = PrometheusClient(prom.url)
    time.sleep(4.5)  # a few scrapes at 1 s

    def verdict(canary: str) -> tuple[str, str]:
        v = analyse(client, SPEC, namespace="ns1", canary=canary, stable="stable1", window_s=4)
        return v.result, v.message

    result, message = verdict("good")
    assert result == "Pass", message
    v = analyse(client, SPEC, namespace="ns1", canary="good", stable="stable1", window_s=4)
    assert v.hit_rate == pytest.approx(0.95, abs=0.01)
    assert v.ttft_p99_seconds is not None and 0.1 < v.ttft_p99_seconds <= 0.25
    assert verdict("slow")[0] == "Fail"
    assert verdict("cold")[0] == "Fail"
    assert verdict("absent")[0] == "NoData"
    assert (
        analyse(client, SPEC, namespace="other", canary="good", stable="stable1", window_s=4).result
        == "NoData"
    )
