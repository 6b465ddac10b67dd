"""Helm against the dev cluster: install, upgrade and uninstall a small chart."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from dscache_tools.devcluster import PINNED, DevCluster, wait_until

pytestmark = pytest.mark.cluster

CHART = Path(__file__).parent / "charts" / "hello"


def test_helm_install_and_uninstall(dev_cluster: DevCluster, namespace: str) -> None:
    ns = namespace
    dev_cluster.helm("install", "demo", str(CHART), "-n", ns, "--wait", "--timeout", "120s")
    releases = json.loads(dev_cluster.helm("list", "-n", ns, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]

    deployment = dev_cluster.kubectl_json("get", "deployment", "demo-hello", "-n", ns)
    assert deployment["status"].get("readyReplicas") == 2
    config = dev_cluster.kubectl_json("get", "configmap", "demo-hello", "-n", ns)
    assert config["data"]["greeting"] == "hello from helm"
    assert config["data"]["kubeVersion"] == PINNED.kubernetes
    dev_cluster.kubectl("get", "service", "demo-hello", "-n", ns)

    dev_cluster.helm("upgrade", "demo", str(CHART), "-n", ns, "--set", "replicaCount=3", "--wait")
    deployment = dev_cluster.kubectl_json("get", "deployment", "demo-hello", "-n", ns)
    assert deployment["status"].get("readyReplicas") == 3

    dev_cluster.helm("uninstall", "demo", "-n", ns, "--wait", "--timeout", "120s")
    assert json.loads(dev_cluster.helm("list", "-n", ns, "-o", "json").stdout) == []
    for kind in ("deployment", "configmap", "service"):
        got = dev_cluster.kubectl("get", kind, "demo-hello", "-n", ns, check=False)
        assert got.returncode != 0 and "NotFound" in got.stderr, (kind, got.stdout)
    wait_until(
        "the chart's pods to go",
        lambda: (
            not dev_cluster.kubectl_json(
                "get", "pods", "-n", ns, "-l", "app.kubernetes.io/instance=demo"
            )["items"]
        ),
    )


def test_helm_checks_kube_version(dev_cluster: DevCluster, namespace: str, tmp_path: Path) -> None:
    """A chart for an older Kubernetes is refused: helm sees the real server version."""
    chart = tmp_path / "hello"
    shutil.copytree(CHART, chart)
    chart_yaml = chart / "Chart.yaml"
    chart_yaml.write_text(
        chart_yaml.read_text().replace('kubeVersion: ">= 1.35.0-0"', 'kubeVersion: "< 1.30.0-0"')
    )
    with pytest.raises(subprocess.CalledProcessError) as failed:
        dev_cluster.helm("install", "old", str(chart), "-n", namespace)
    assert "kubeVersion" in failed.value.stderr
    assert PINNED.kubernetes in failed.value.stderr
