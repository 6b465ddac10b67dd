"""Session-wide fixtures shared by every test folder: the dev Kubernetes cluster.

``dev_cluster`` starts one real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) with one real node (containerd +
kubelet, kube-proxy: its pods run the dscache images), Debian's Prometheus
beside it scraping the dscache pods (``prometheus_url``), and KWOK with three
simulated nodes (two with 8 ``nvidia.com/gpu`` each, one without; tainted, so
only pods that ask for them land there) for the whole session, through the
same code as ``dscache dev cluster up``, and stops it at the end (which undoes
every host change). Missing binaries and images are built first (tens of
minutes the first time, with progress on the terminal); a failed build or start
is a test error, never a skip: real nodes need root and the Debian packages
named in the error. Component logs stay in pytest's temporary directory
(``<basetemp>/devcluster*/logs``).

Tests that use it carry ``@pytest.mark.cluster``; ``namespace`` gives such a
test a namespace of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator

import pytest
from dscache_tools.devcluster import DevCluster, ensure_built, is_built
from dscache_tools.devcluster.images import image_loader
from dscache_tools.podlogs import save_pod_logs

logger = logging.getLogger(__name__)
_namespaces = itertools.count()

# Every sidecar a test starts (in-process or as a child) makes sparse segment files
# unless it asks otherwise: the stores take disk only as blocks are written, so the
# suite stays small on disk. Tests about preallocation ask for "zero" themselves.
os.environ.setdefault("DSCACHE_SIDECAR_SEGMENT_INIT", "sparse")


def _terminal_progress(config: pytest.Config) -> Callable[[str], None]:
    """Shows build progress on the terminal even while output is captured."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        logger.info("dev cluster build: %s", line)
        if reporter is None:
            return
        paused = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
        with paused:
            reporter.write_line(f"[dev cluster build] {line}")

    return say


@pytest.fixture(scope="session")
def dev_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevCluster]:
    """A ready dev cluster: ``.kubeconfig``, ``.env()``, ``.kubectl()``, ``.helm()``."""
    progress = None if is_built() else _terminal_progress(request.config)
    binaries = ensure_built(progress=progress)
    # DSCACHE_TEST_REAL_NODES=0: KWOK nodes only, so a second session can run
    # beside one that holds the host's real node (tests that run pods then fail);
    # its pods run no process, so it needs no images either.
    real_nodes = int(os.environ.get("DSCACHE_TEST_REAL_NODES", "1"))
    from dscache_tools.demo.kube.options import IMAGES as DEMO_IMAGES  # matplotlib: lazily

    # The reference engine's images only: the one test that runs a vLLM pod
    # (tests/e2e) imports the vllm image itself (`DevCluster.load_images`), so a
    # run of other cluster tests never waits for its 6 GiB.
    loader = (
        image_loader(progress=_terminal_progress(request.config), names=DEMO_IMAGES["reference"])
        if real_nodes
        else None
    )
    prometheus = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if prometheus is None:
        pytest.fail("the cluster tests need Debian's Prometheus: apt-get install prometheus")
    cluster = DevCluster.start(
        tmp_path_factory.mktemp("devcluster"),
        node_count=3,
        real_nodes=real_nodes,
        load_images=loader,
        prometheus_binary=prometheus,
        binaries=binaries,
        tie_to_parent=True,
        timeout=90.0,
    )
    try:
        yield cluster
    finally:
        cluster.stop(keep_logs=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keeps each phase's report on the item, so fixtures can tell a failed test."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def namespace(
    dev_cluster: DevCluster,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A namespace of its own for one test, named after it, deleted afterwards (without
    waiting). When the test failed (or ``DSCACHE_TEST_KEEP_POD_LOGS=1``), its pods'
    logs and events are kept first, under ``<basetemp>/podlogs*/``."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_").lower())
    name = f"t{os.getpid() % 10000}-{next(_namespaces)}-{slug}"[:63].strip("-")
    with dev_cluster.temporary_namespace(name):
        yield name
        report = getattr(request.node, "report_call", None)
        keep = os.environ.get("DSCACHE_TEST_KEEP_POD_LOGS") == "1"
        if keep or (report is not None and report.failed):
            out = tmp_path_factory.mktemp("podlogs")
            save_pod_logs(str(dev_cluster.binaries.kubectl), dev_cluster.kubeconfig, name, out)
