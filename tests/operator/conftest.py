"""Fixtures of the operator's cluster tests: the chart, a real operator, a real Prometheus.

* ``chart``: ``helm upgrade --install`` of charts/dscache (CRDs, RBAC, the
  peering object, the operator Deployment scaled to zero: the operator under
  test is the local process below, and an in-cluster replica on a real node
  would act on the same resources).
* ``operator``: the real ``dscache operator --all-namespaces`` as a local
  process against the dev cluster (a 1 s tick), restartable and killable.
* ``prometheus``: Debian's ``prometheus`` binary on a loopback port, scraping a
  fake model-server ``/metrics`` every second whose figures the test sets.
* ``ns``: a fresh namespace per test; ``rig``: all of the above for one test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dscache_tools.devcluster import DevCluster
from fakes.server_metrics import FakeServerMetrics
from operator_harness import ROOT, OperatorProcess, PrometheusProcess, Rig

CHART_NS = "dscache-system"


@pytest.fixture(scope="module")
def chart(dev_cluster: DevCluster) -> str:
    """The chart installed (CRD included); returns its namespace."""
    dev_cluster.install_chart(
        "dscache", ROOT / "charts" / "dscache", CHART_NS, {"operator.replicas": 0}
    )
    dev_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/deepseekcachedeployments.dscache.io"
    )
    return CHART_NS


@pytest.fixture(scope="module")
def server_metrics() -> Iterator[FakeServerMetrics]:
    m = FakeServerMetrics()
    yield m
    m.close()


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory, server_metrics: FakeServerMetrics
) -> Iterator[PrometheusProcess]:
    p = PrometheusProcess(tmp_path_factory.mktemp("prometheus"), server_metrics)
    yield p
    p.close()


@pytest.fixture(scope="module")
def operator(
    dev_cluster: DevCluster,
    chart: str,
    prometheus: PrometheusProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(dev_cluster, tmp_path_factory.mktemp("operator"), prometheus.url)
    yield op
    op.stop()


@pytest.fixture
def ns(namespace: str) -> str:
    """The shared per-test namespace (tests/conftest.py), under the operator tests' name."""
    return namespace


@pytest.fixture
def rig(
    dev_cluster: DevCluster,
    operator: OperatorProcess,
    prometheus: PrometheusProcess,
    server_metrics: FakeServerMetrics,
    ns: str,
) -> Rig:
    """A rollout test's namespace with the shared operator, Prometheus and fake metrics."""
    return Rig(dev_cluster, ns, operator, prometheus, server_metrics)
