"""Rollout analysis: the verdict rules, and the PromQL against a real Prometheus."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dscache_operator.analysis import Figures, Step, analyse, judge, queries
from dscache_operator.prometheus import PrometheusClient
from dscache_operator.spec import AnalysisSpec
from dscache_tools.devcluster import wait_until
from fakes.server_metrics import FakeServerMetrics
from fakes.server_metrics import Figures as Served
from operator_harness import PrometheusProcess

SPEC = AnalysisSpec()


def F(
    hit: float | None,
    stable_hit: float | None,
    p99: float | None = 0.30,
    stable_p99: float | None = 0.30,
    *,
    stable_hit_before: float | None = None,
    stable_p99_before: float | None = None,
) -> Figures:
    return Figures(
        hit_rate=hit,
        ttft_p99_seconds=p99,
        stable_hit_rate=stable_hit,
        stable_ttft_p99_seconds=stable_p99,
        stable_hit_rate_before=stable_hit_before,
        stable_ttft_p99_seconds_before=stable_p99_before,
    )


FLOOR = AnalysisSpec(min_hit_rate=0.5)


@pytest.mark.parametrize(
    ("spec", "figures", "result", "words", "stable_used"),
    [
        # Like with like: a naturally low hit rate passes when stable's is as low.
        (SPEC, F(0.40, 0.41), "Pass", "stable 0.410 x 0.95 = 0.389", 0.41),
        (SPEC, F(0.90, 0.92), "Pass", "P99 TTFT 0.300s", 0.92),
        (SPEC, F(0.84, 0.92), "Fail", "hit rate below stable's 0.920 x 0.95", 0.92),
        (SPEC, F(0.30, 0.41), "Fail", "hit rate below stable's 0.410", 0.41),
        # The old absolute default (0.85) no longer blocks low-hit-rate traffic.
        (SPEC, F(0.60, 0.62), "Pass", "hit rate 0.600", 0.62),
        # An optional floor is checked as well.
        (FLOOR, F(0.45, 0.46), "Fail", "hit rate below the floor 0.5", 0.46),
        (FLOOR, F(0.55, 0.56), "Pass", "floor 0.5", 0.56),
        # Stable had no traffic in the window (blue-green at 100%): the window
        # before the step stands in, and the message says so.
        (SPEC, F(0.80, None, stable_hit_before=0.82), "Pass", "from before the step", 0.82),
        (SPEC, F(0.60, None, stable_hit_before=0.82), "Fail", "from before the step", 0.82),
        # The window's own figure wins over the earlier one.
        (SPEC, F(0.80, 0.81, stable_hit_before=0.99), "Pass", "stable 0.810", 0.81),
        # No stable figure at all: NoData (never promote blind) ...
        (SPEC, F(0.99, None), "NoData", "no stable hit rate to compare", None),
        # ... unless a floor can judge the canary alone.
        (FLOOR, F(0.99, None), "Pass", "no stable hit rate, ratio not checked", None),
        (FLOOR, F(0.40, None), "Fail", "below the floor 0.5", None),
        # No canary figure: NoData.
        (SPEC, F(None, 0.90), "NoData", "no canary data for hit rate", 0.90),
        (SPEC, F(0.90, 0.90, p99=None), "NoData", "P99 TTFT", 0.90),
        # TTFT: ratio to stable's P99, the same fallback, and the optional ceiling.
        (SPEC, F(0.90, 0.90, 0.50, 0.30), "Fail", "P99 TTFT > stable 0.300s x 1.2", 0.90),
        (SPEC, F(0.90, 0.90, 0.35, 0.30), "Pass", "stable 0.300s x 1.2 = 0.360s", 0.90),
        (SPEC, F(0.90, 0.90, 0.50, None), "Pass", "no stable TTFT data, ratio not checked", 0.90),
        # At low latencies an increase within the tolerance (0.15 s) is no failure,
        # whatever the ratio (seen in the demo: stable 0.096 s, canary 0.232 s, both
        # P99s of a few requests in one 40 s window); past it the ratio decides.
        (SPEC, F(0.90, 0.90, 0.232, 0.096), "Pass", "only 0.136s over stable's", 0.90),
        (SPEC, F(0.90, 0.90, 0.26, 0.096), "Fail", "P99 TTFT > stable 0.096s x 1.2", 0.90),
        (
            AnalysisSpec(min_ttft_p99_increase_seconds=0.0),
            F(0.90, 0.90, 0.232, 0.096),
            "Fail",
            "P99 TTFT > stable 0.096s x 1.2",
            0.90,
        ),
        (
            SPEC,
            F(0.90, None, 0.50, None, stable_hit_before=0.9, stable_p99_before=0.3),
            "Fail",
            "P99 TTFT > stable 0.300s",
            0.90,
        ),
    ],
)
def test_verdicts(
    spec: AnalysisSpec, figures: Figures, result: str, words: str, stable_used: float | None
) -> None:
    v = judge(spec, figures)
    assert v.result == result, v.message
    assert words in v.message, v.message
    assert v.hit_rate == figures.hit_rate
    assert v.stable_hit_rate == stable_used


def test_absolute_ttft_ceiling() -> None:
    v = judge(AnalysisSpec(max_ttft_p99_seconds=0.25), F(0.9, 0.9, 0.3, 0.3))
    assert v.result == "Fail" and "above 0.25s" in v.message


def test_queries_compare_the_same_window_and_the_window_before_the_step() -> None:
    q = queries(SPEC, Step("prod", canary="bbb", stable="aaa", window_s=120, since_step_s=150))
    assert 'namespace="prod",dscache_io_revision="bbb"' in q["hit_rate"]
    assert "[120s]))" in q["hit_rate"] and 'source=~"reused|' in q["hit_rate"]
    assert 'dscache_io_revision="aaa"' in q["stable_hit_rate"]
    assert "[120s]))" in q["stable_hit_rate"] and "offset" not in q["stable_hit_rate"]
    assert 'dscache_io_revision="aaa"' in q["stable_ttft_p99_seconds"]
    # Same length, ending when the step began.
    assert "[120s] offset 150s))" in q["stable_hit_rate_before"]
    assert "[120s] offset 150s)))" in q["stable_ttft_p99_seconds_before"]
    assert "offset" not in q["hit_rate"] + q["ttft_p99_seconds"]


def test_queries_read_vllms_own_figures_as_well_as_the_servers() -> None:
    """One query per figure serves either engine: vLLM's prefix cache and its KV connector
    (dscache) count as cached, everything vLLM prefilled as prompt tokens."""
    q = queries(SPEC, Step("prod", canary="bbb", stable="aaa", window_s=60, since_step_s=60))
    cached, total = q["hit_rate"].split(" / ")
    assert "vllm:prompt_tokens_by_source_total" in cached
    assert "local_cache_hit|external_kv_transfer" in cached and "local_compute" not in cached
    assert "vllm:prompt_tokens_total" in total and "source" not in total
    assert "vllm:time_to_first_token_seconds_bucket" in q["ttft_p99_seconds"]
    assert "dscache_server_ttft_seconds_bucket" in q["ttft_p99_seconds"]


def test_no_prometheus_or_a_dead_one_is_no_data() -> None:
    step = Step("n", canary="b", stable="a", window_s=5, since_step_s=5)
    assert analyse(None, SPEC, step).result == "NoData"
    dead = PrometheusClient("http://127.0.0.1:9", timeout_s=1)
    v = analyse(dead, SPEC, step)
    assert v.result == "NoData" and "unavailable" in v.message
    assert analyse(None, AnalysisSpec(enabled=False), step).result == "Skipped"


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusProcess]:
    metrics = FakeServerMetrics()
    p = PrometheusProcess(Path(tmp_path_factory.mktemp("prom")), metrics)
    yield p
    p.close()
    metrics.close()


@pytest.mark.slow
def test_real_prometheus_figures_and_verdicts(prom: PrometheusProcess) -> None:
    prom.metrics.set("ns1", "stable1", Served(hit_rate=0.9, ttft_s=0.2))
    prom.metrics.set("ns1", "good", Served(hit_rate=0.95, ttft_s=0.2))
    prom.metrics.set("ns1", "slow", Served(hit_rate=0.95, ttft_s=2.0))
    prom.metrics.set("ns1", "cold", Served(hit_rate=0.40, ttft_s=0.2))
    client = PrometheusClient(prom.url)
    time.sleep(4.5)  # a few scrapes at 1 s

    def verdict(canary: str, namespace: str = "ns1") -> tuple[str, str]:
        v = analyse(client, SPEC, Step(namespace, canary, "stable1", window_s=4, since_step_s=4))
        return v.result, v.message

    result, message = verdict("good")
    assert result == "Pass", message
    v = analyse(client, SPEC, Step("ns1", "good", "stable1", window_s=4, since_step_s=4))
    assert v.hit_rate == pytest.approx(0.95, abs=0.01)
    assert v.ttft_p99_seconds is not None and 0.1 < v.ttft_p99_seconds <= 0.25
    assert verdict("slow")[0] == "Fail"
    assert verdict("cold")[0] == "Fail"
    assert verdict("absent")[0] == "NoData"
    assert verdict("good", namespace="other")[0] == "NoData"


@pytest.mark.slow
def test_real_prometheus_gates_vllm_revisions_on_vllms_own_figures(
    prom: PrometheusProcess,
) -> None:
    """vLLM tracks (``spec.engine: vllm``): the gate reads vLLM's series, a warm canary
    passes, a cold or slow one fails, and a rollout from the reference engine to vLLM
    compares the two engines' figures like with like."""
    prom.metrics.set("ns3", "vstable", Served(hit_rate=0.9, ttft_s=0.2, engine="vllm"))
    prom.metrics.set("ns3", "vgood", Served(hit_rate=0.93, ttft_s=0.2, engine="vllm"))
    prom.metrics.set("ns3", "vcold", Served(hit_rate=0.0, ttft_s=0.2, engine="vllm"))
    prom.metrics.set("ns3", "vslow", Served(hit_rate=0.93, ttft_s=2.0, engine="vllm"))
    prom.metrics.set("ns3", "ref", Served(hit_rate=0.9, ttft_s=0.2))
    client = PrometheusClient(prom.url)
    wait_until("vLLM figures scraped", lambda: _scalar(client, "ns3", "vcold", 4) is not None, 30)
    time.sleep(2)

    def verdict(canary: str, stable: str = "vstable") -> Any:
        return analyse(client, SPEC, Step("ns3", canary, stable, window_s=4, since_step_s=4))

    good = verdict("vgood")
    assert good.result == "Pass", good.message
    assert good.hit_rate == pytest.approx(0.93, abs=0.01)
    assert good.stable_hit_rate == pytest.approx(0.9, abs=0.01)
    assert good.ttft_p99_seconds is not None and 0.1 < good.ttft_p99_seconds <= 0.25
    cold = verdict("vcold")
    assert cold.result == "Fail" and cold.hit_rate == pytest.approx(0.0, abs=1e-9), cold.message
    assert verdict("vslow").result == "Fail"
    # From the reference engine to vLLM: the same gate, each side from its own series.
    across = verdict("vgood", stable="ref")
    assert across.result == "Pass", across.message
    assert across.stable_hit_rate == pytest.approx(0.9, abs=0.01)
    assert verdict("vcold", stable="ref").result == "Fail"


@pytest.mark.slow
def test_real_prometheus_blue_green_compares_with_stable_before_the_step(
    prom: PrometheusProcess,
) -> None:
    """Stable idle in the window (all sessions on the canary): its figure from before counts."""
    client = PrometheusClient(prom.url)
    prom.metrics.set("ns2", "blue", Served(hit_rate=0.60, ttft_s=0.2))
    wait_until("stable has a hit rate", lambda: _scalar(client, "ns2", "blue", 4), 30)
    time.sleep(4)  # a whole window of stable traffic before the switch
    prom.metrics.set("ns2", "blue", Served(hit_rate=0.60, ttft_s=0.2, traffic=0.0))
    step_began = time.monotonic()
    prom.metrics.set("ns2", "warm", Served(hit_rate=0.58, ttft_s=0.2))
    prom.metrics.set("ns2", "cold", Served(hit_rate=0.30, ttft_s=0.2))
    wait_until(
        "stable idle for a whole window",
        lambda: _scalar(client, "ns2", "blue", 4) is None and _scalar(client, "ns2", "warm", 4),
        30,
    )

    def verdict(canary: str) -> Any:
        since = time.monotonic() - step_began
        return analyse(client, SPEC, Step("ns2", canary, "blue", window_s=4, since_step_s=since))

    warm = verdict("warm")
    # 0.58 would fail the old absolute 0.85 floor; against stable's own 0.60 it passes.
    assert warm.result == "Pass", warm.message
    assert warm.stable_hit_rate == pytest.approx(0.60, abs=0.02)
    assert "from before the step" in warm.message
    cold = verdict("cold")
    assert cold.result == "Fail" and "below stable's 0.6" in cold.message, cold.message


def _scalar(client: PrometheusClient, ns: str, revision: str, window_s: float) -> float | None:
    q = queries(SPEC, Step(ns, revision, revision, window_s=window_s, since_step_s=window_s))
    return client.scalar(q["hit_rate"])
