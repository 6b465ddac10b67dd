"""The Helm chart: ``helm lint --strict`` and every rendered manifest valid for Kubernetes 1.35.

Uses the dev cluster's pinned helm (built once into the cache); no cluster runs.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from dscache_operator.settings import OperatorSettings
from dscache_tools.devcluster import ensure_built, locate

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
    "sharedTier": [
        "--set",
        "sharedTier.create=true",
        "--set",
        "sharedTier.endpoints={10.246.0.1:7000,10.246.0.1:7001}",
        "--set",
        "sharedTier.password=s3cret",
        "--set",
        "sharedTier.namespaces={team-a,team-b}",
    ],
}


@pytest.fixture(scope="module")
def helm() -> str:
    # Only helm is needed: a lone build of the pinned one does (ensure_built builds all parts).
    pinned = locate().helm
    return str(pinned if pinned.is_file() else ensure_built().helm)


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
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "kopf.dev/")):
            assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "dscache"
            continue
        kubernetes_validate.validate(doc, K8S, strict=True)
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert crds == {
        "deepseekcachedeployments.dscache.io",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }
    _check_operator_deployment(docs, values)
    _check_shared_tier_secrets(docs, values)
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
@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("operator.logLevel=LOUD", "logLevel"),
        ("operator.typo=1", "typo"),
        ("sharedTier.endpoints={redis-0}", "/sharedTier/endpoints/0"),
    ],
)
def test_invalid_values_are_rejected_by_the_schema(helm: str, value: str, named: str) -> None:
    done = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and named in done.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["sharedTier.create=true"], "sharedTier.endpoints is required"),
        (
            ["sharedTier.create=true", "sharedTier.endpoints={a:1}", "sharedTier.existingSecret=s"],
            "set create or existingSecret, not both",
        ),
    ],
)
def test_a_shared_tier_secret_needs_its_endpoints(
    helm: str, values: list[str], message: str
) -> None:
    args = [a for v in values for a in ("--set", v)]
    done = subprocess.run(
        [helm, "template", "x", str(CHART), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and message in done.stderr


def _check_shared_tier_secrets(docs: list[dict[str, Any]], values: str) -> None:
    secrets = [d for d in docs if d["kind"] == "Secret"]
    if values != "sharedTier":
        assert secrets == []  # off by default
        return
    (acl,) = [s for s in secrets if s["metadata"]["name"] == "dscache-shared-tier-acl"]
    tiers = [s for s in secrets if s is not acl]
    assert sorted(s["metadata"]["namespace"] for s in tiers) == ["team-a", "team-b"]
    lines = acl["stringData"]["users.acl"].splitlines()
    passwords, signing = set(), set()
    for secret in tiers:
        ns = secret["metadata"]["namespace"]
        assert secret["metadata"]["name"] == "dscache-shared-tier"
        assert secret["metadata"]["labels"]["app.kubernetes.io/component"] == "shared-tier"
        data = secret["stringData"]
        # A credential of its own per namespace, never one copied everywhere.
        assert data["endpoints"] == "10.246.0.1:7000,10.246.0.1:7001"
        assert data["username"] == data["keyPrefix"] == f"dscache-{ns}"
        assert len(data["password"]) == 40 and len(data["signingKey"]) == 64
        passwords.add(data["password"])
        signing.add(data["signingKey"])
        digest = hashlib.sha256(data["password"].encode()).hexdigest()
        # The ACL user may touch only its own prefix.
        (line,) = [x for x in lines if x.split()[1] == f"dscache-{ns}"]
        assert f"#{digest}" in line.split() and f"~dscache-{ns}:*" in line.split()
        assert "resetkeys" in line and "-@all" in line and "+flushall" not in line
    assert len(passwords) == len(signing) == 2


def _rules(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for d in docs if d["kind"] == kind for r in d["rules"]]


def _check_operator_deployment(docs: list[dict[str, Any]], values: str) -> None:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # Two replicas by default, one acting through kopf peering.
    assert dep["spec"]["replicas"] == 2
    assert c["args"][-2:] == ["--peering", "dscache"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["DSCACHE_OPERATOR_PEERING_LIFETIME_SECONDS"]["value"] == "30"
    # As a pod: the ServiceAccount token mounted, the slim image, read-only root, /tmp.
    assert pod["automountServiceAccountToken"] is True
    assert c["image"] == "ghcr.io/dscache/dscache-core:0.1.0"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
    assert [v["emptyDir"] for v in pod["volumes"] if v["name"] == "tmp"] == [{"sizeLimit": "64Mi"}]
    peerings = [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    if values == "namespaced":
        assert sorted((p["kind"], p["metadata"]["namespace"]) for p in peerings) == [
            ("KopfPeering", "team-a"),
            ("KopfPeering", "team-b"),
        ]
        peering_rules = [r for r in _rules(docs, "Role") if r["apiGroups"] == ["kopf.dev"]]
        assert {tuple(r["resources"]) for r in peering_rules} == {("kopfpeerings",)}
        namespaced = _rules(docs, "Role")
    else:
        assert [(p["kind"], p["metadata"]["name"]) for p in peerings] == [
            ("ClusterKopfPeering", "dscache")
        ]
        peering_rules = [r for r in _rules(docs, "ClusterRole") if r["apiGroups"] == ["kopf.dev"]]
        assert [r["resources"] for r in peering_rules] == [["clusterkopfpeerings"]]
        namespaced = _rules(docs, "ClusterRole")
    assert all(r["verbs"] == ["get", "list", "watch", "patch"] for r in peering_rules)
    by_resource = {res: r["verbs"] for r in namespaced for res in r["resources"]}
    assert "patch" in by_resource["pods"] and "delete" not in by_resource["pods"]
    assert by_resource["jobs"] == ["get", "list", "watch", "create"]  # created once, never patched


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


@pytest.mark.cluster  # the dev cluster's pinned helm
def test_the_chart_hands_the_operator_its_policy(helm: str) -> None:
    """The chart's policy values reach the operator's settings as the admin wrote them,
    and its NetworkPolicy admits only the metrics peers to the operator's pods."""
    text = _helm(
        helm,
        "template",
        "dscache",
        str(CHART),
        "--set-json",
        'operator.policy.hostPathRoots=["/mnt/nvme","/srv/kv"]',
        "--set-json",
        'operator.policy.prometheusUrls=["http://prom.a:9090"]',
        "--set-json",
        'networkPolicy.metricsFrom=[{"ipBlock":{"cidr":"10.0.0.0/8"}}]',
    )
    docs = [d for d in yaml.safe_load_all(text) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {
        e["name"]: e["value"]
        for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    operator_env = {k: v for k, v in env.items() if k.startswith("DSCACHE_OPERATOR_")}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in operator_env.items():
            mp.setenv(name, value)
        policy = OperatorSettings().policy()
    assert policy.host_path_roots == ("/mnt/nvme", "/srv/kv")
    assert policy.prometheus_allowed("http://prom.a:9090/")
    assert policy.metrics_peers == ({"ipBlock": {"cidr": "10.0.0.0/8"}},)
    assert policy.cache_owner_image.reference == "ghcr.io/dscache/dscache-core:0.1.0"
    assert policy.max_cache_bytes == 1 << 40 and not policy.allow_keyless_tolerations
    (np,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert np["spec"]["ingress"] == [
        {
            "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
            "ports": [{"protocol": "TCP", "port": 9090}],
        }
    ]
    assert np["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_every_series_on_the_dashboard_is_one_dscache_exports() -> None:
    """A panel naming a metric no component exports stays empty: caught here."""
    from dscache_operator.metrics import OperatorMetrics
    from dscache_server.metrics import ServerMetrics
    from dscache_sidecar.metrics import SidecarMetrics
    from prometheus_client import CollectorRegistry

    from dscache import metricnames

    exported = {
        name
        for registry in (
            ServerMetrics().registry,
            SidecarMetrics().registry,
            OperatorMetrics(CollectorRegistry()).registry,
        )
        for family in registry.collect()
        for name in (family.name,)
    }
    exported |= {v for k, v in vars(metricnames).items() if k.startswith("ROUTER_")}
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    used = {
        re.sub(r"_(bucket|sum|count|total)$", "", m)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for m in re.findall(r"\b(dscache_[a-z_]+)\b", target["expr"])
        if not m.startswith("dscache_io_")  # a pod target label, not a metric
    }
    assert any(m.startswith("dscache_router_") for m in used)
    assert used - exported == set()
