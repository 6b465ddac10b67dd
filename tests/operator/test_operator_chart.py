"""The Helm chart: ``helm lint --strict`` and every rendered manifest valid for Kubernetes 1.35.

Uses the dev cluster's pinned helm (built once into the cache); no cluster runs.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dscache.devcluster import ensure_built

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dscache"
K8S = "1.35.0"
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "namespaced": ["--set", "operator.watchNamespaces={team-a,team-b}"],
    "monitoring": [
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "monitoring.dashboard.enabled=true",
        "--set",
        "operator.prometheusUrl=http://prometheus.monitoring:9090",
    ],
}


@pytest.fixture(scope="module")
def helm() -> str:
    return str(ensure_built().helm)


def _helm(helm: str, *args: str) -> str:
    done = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.cluster  # the dev cluster's pinned helm
@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_helm_lint_strict(helm: str, values: str) -> None:
    out = _helm(helm, "lint", "--strict", str(CHART), *VALUE_SETS[values])
    assert "0 chart(s) failed" in out


@pytest.mark.cluster
@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_rendered_manifests_are_valid_kubernetes(helm: str, values: str) -> None:
    text = _helm(
        helm,
        "template",
        "dscache",
        str(CHART),
        "--namespace",
        "dscache-system",
        "--include-crds",
        *VALUE_SETS[values],
    )
    docs = [d for d in yaml.safe_load_all(text) if d]
    kinds = [d["kind"] for d in docs]
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "dscache"
            continue
        kubernetes_validate.validate(doc, K8S, strict=True)
    if values == "monitoring":
        dash = next(d for d in docs if d["kind"] == "ConfigMap")
        assert json.loads(dash["data"]["dscache.json"])["uid"] == "dscache-overview"
        assert {"ServiceMonitor", "PrometheusRule"} <= set(kinds)
    else:
        assert not {"ServiceMonitor", "PrometheusRule"} & set(kinds)  # off by default
    if values == "namespaced":
        roles = [d for d in docs if d["kind"] == "Role"]
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
        assert [d for d in docs if d["kind"] == "ClusterRole"] == [
            d
            for d in docs
            if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-discovery")
        ]


@pytest.mark.cluster
def test_invalid_values_are_rejected_by_the_schema(helm: str) -> None:
    done = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", "operator.logLevel=LOUD"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "logLevel" in done.stderr
    done = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", "operator.typo=1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "typo" in done.stderr


def _documented_leaves(values: Any, schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys whose value is a leaf or a free-form map; each must carry a ``# --`` comment."""
    out: list[str] = []
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        node = schema["properties"][key]
        assert node.get("description"), f"{path} is not described in values.schema.json"
        if isinstance(value, dict) and "properties" in node:
            out += _documented_leaves(value, node, path)
        else:
            out.append(path)
    return out


def test_every_value_is_documented_and_in_the_schema() -> None:
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    schema = json.loads((CHART / "values.schema.json").read_text())
    leaves = _documented_leaves(yaml.safe_load(text), schema)
    assert len(leaves) > 20
    cursor = 0
    for key in leaves:  # values.yaml order: find each leaf after the previous one
        leaf = key.rsplit(".", 1)[-1]
        idx = next(
            i for i in range(cursor, len(lines)) if re.match(rf"^\s*{re.escape(leaf)}:", lines[i])
        )
        assert lines[idx - 1].strip().startswith("# --"), key
        cursor = idx + 1
