"""The rollout gate's figures from a real vLLM engine (marker ``vllm``).

``dscache vllm serve`` (vLLM's CPU build with the dscache connector, a real
sidecar) scraped by a real Prometheus, its target labelled as the dev cluster's
pod discovery labels a vLLM pod: the operator's own analysis queries read vLLM's
series under the names vLLM really exports, and the hit rate the gate sees is the
one vLLM's clients saw in their answers' ``usage``. vLLM's own prefix cache is off
here, so every reused token came from dscache (``external_kv_transfer``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dscache_operator.analysis import Step, analyse, queries
from dscache_operator.prometheus import PrometheusClient
from dscache_operator.spec import AnalysisSpec
from dscache_sidecar.client import SidecarClient
from dscache_tools.polling import wait_until
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmServer, vllm_python
from needs import missing
from operator_harness import PrometheusProcess
from prometheus_client.parser import text_string_to_metric_families

from dscache import metricnames as names

pytestmark = pytest.mark.vllm

NAMESPACE, REVISION = "prod", "v1"
#: Two long documents (several 256-token blocks each), asked about twice each.
DOCUMENTS = [f"Filing {n}: revenue, margins and cash flow by quarter. " * 90 for n in (1, 2)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, SidecarProcess]]:
    try:
        vllm_python()
    except FileNotFoundError as exc:
        missing(str(exc))
    from dscache_vllm.models import cached_checkpoint

    base = tmp_path_factory.mktemp("vllm-analysis")
    sidecar = SidecarProcess(base / "store", "--capacity", "256MiB", "--segment-size", "32MiB")
    sidecar.start()
    try:
        server = VllmServer(
            cached_checkpoint("tiny"),
            base / "serve.log",
            socket=sidecar.socket,
            data_dir=str(sidecar.data_dir),
            vllm_args=("--max-model-len", "4096", "--no-enable-prefix-caching"),
        )
        with server:
            yield server, sidecar
    finally:
        sidecar.stop()


def _chat(server: VllmServer, document: str, question: str) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": document},
        {"role": "user", "content": question},
    ]
    body = {"model": server.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    usage: dict[str, Any] = resp.json()["usage"]
    return usage


def test_the_gate_reads_vllms_own_figures_as_its_clients_saw_them(
    served: tuple[VllmServer, SidecarProcess], tmp_path: Path
) -> None:
    server, sidecar = served
    exposed = {
        family.name: {tuple(sorted(s.labels.items())) for s in family.samples}
        for family in text_string_to_metric_families(
            httpx.get(f"{server.url}/metrics", timeout=10).text
        )
    }
    # The names the gate reads, as this vLLM exports them (families drop _total/_bucket).
    assert names.VLLM_PROMPT_TOKENS_SERIES.removesuffix("_total") in exposed
    by_source = names.VLLM_PROMPT_TOKENS_BY_SOURCE_SERIES.removesuffix("_total")
    sources = {dict(labels).get("source") for labels in exposed[by_source]}
    assert {*names.VLLM_CACHED_SOURCES, names.VLLM_SOURCE_COMPUTED} <= sources
    assert names.VLLM_TTFT_BUCKET_SERIES.removesuffix("_bucket") in exposed

    prom = PrometheusProcess(
        tmp_path,
        server,  # type: ignore[arg-type]  # any /metrics on 127.0.0.1:port
        labels={"namespace": NAMESPACE, "dscache_io_revision": REVISION},
    )
    try:
        client = PrometheusClient(prom.url)
        spec = AnalysisSpec(min_hit_rate=0.2)
        step = Step(NAMESPACE, REVISION, "none", window_s=300, since_step_s=300)
        q = queries(spec, step)
        # The gate's two sums, as the counters' last scraped values (no rate, so no
        # extrapolation): what Prometheus has seen so far.
        numerator, denominator = (
            part.replace("rate(", "").replace("[300s])", "") for part in q["hit_rate"].split(" / ")
        )
        # A first scrape before any request: the window's rates then see every token.
        wait_until("Prometheus's first scrape", lambda: client.scalar(denominator) == 0, 60, 0.5)
        usages = [_chat(server, document, "What was the margin?") for document in DOCUMENTS]
        with SidecarClient(sidecar.socket) as store:
            # Each document's whole blocks written before it is asked again.
            wait_until("both prefixes stored", lambda: store.stats().blocks >= 8, 60, 0.5)
        usages += [_chat(server, document, "And the cash flow?") for document in DOCUMENTS]
        prompt = sum(u["prompt_tokens"] for u in usages)
        cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
        assert cached > 0, usages  # the second question of each document loaded its prefix

        def all_counted() -> bool:
            # Both sums, exactly: an extrapolated increase could pass 99% of the
            # prompt tokens before the last request's cached tokens were scraped.
            seen, hit = client.scalar(denominator), client.scalar(numerator)
            return seen is not None and hit is not None and seen >= prompt and hit >= cached

        wait_until("Prometheus scraped every request", all_counted, 60, 1.0)
        verdict = analyse(client, spec, step)
        # The gate's hit rate is the clients' share of cached prompt tokens.
        counters = [
            line
            for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
            if line.startswith(("vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total"))
        ]
        assert verdict.hit_rate == pytest.approx(cached / prompt, abs=0.02), (
            verdict.message,
            usages,
            counters,
        )
        assert verdict.ttft_p99_seconds is not None and verdict.ttft_p99_seconds > 0
        # No stable revision here: the floor alone judges it.
        assert verdict.result == "Pass", verdict.message
    finally:
        prom.close()
