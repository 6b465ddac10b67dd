"""Custom resources on the dev cluster: the API server enforces the schema.

A CRD with a strict structural schema accepts a valid object, rejects an
invalid one with the API server's own validation message, rejects unknown
fields under strict field validation, and serves a status subresource that
spec writes cannot touch.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from dscache_tools.devcluster import DevCluster, wait_until

pytestmark = pytest.mark.cluster

GROUP = "dev.dscache.io"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "required": ["spec"],
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size", "mode"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1, "maximum": 10},
                                    "mode": {"type": "string", "enum": ["canary", "blueGreen"]},
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {"phase": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


def _widget(name: str, spec: dict[str, Any]) -> str:
    return json.dumps(
        {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}
    )


@pytest.fixture(scope="module")
def widget_crd(dev_cluster: DevCluster) -> str:
    dev_cluster.kubectl("apply", "-f", "-", stdin=json.dumps(CRD))
    dev_cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/widgets.{GROUP}", "--timeout=60s"
    )
    # Discovery can lag behind Established for a moment.
    wait_until(
        "widgets in discovery",
        lambda: dev_cluster.kubectl("get", "widgets", "-A", check=False).returncode == 0,
    )
    return f"widgets.{GROUP}"


def test_valid_custom_resource_is_accepted(
    dev_cluster: DevCluster, widget_crd: str, namespace: str
) -> None:
    dev_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=_widget("ok", {"size": 3, "mode": "canary"})
    )
    got = dev_cluster.kubectl_json("get", widget_crd, "-n", namespace, "ok")
    assert got["spec"] == {"size": 3, "mode": "canary"}
    assert got["metadata"]["generation"] == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"size": 0, "mode": "canary"}, "spec.size: Invalid value: 0"),
        ({"size": 11, "mode": "canary"}, "should be less than or equal to 10"),
        ({"size": 2, "mode": "sideways"}, 'spec.mode: Unsupported value: "sideways"'),
        ({"size": 2}, "spec.mode: Required value"),
        ({"size": "two", "mode": "canary"}, 'spec.size: Invalid value: "string"'),
    ],
)
def test_invalid_custom_resource_is_rejected(
    dev_cluster: DevCluster,
    widget_crd: str,
    namespace: str,
    spec: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(subprocess.CalledProcessError) as failed:
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_widget("bad", spec))
    assert "is invalid" in failed.value.stderr
    assert message in failed.value.stderr
    assert dev_cluster.kubectl("get", widget_crd, "-n", namespace, "bad", check=False).returncode


def test_unknown_field_is_rejected_under_strict_validation(
    dev_cluster: DevCluster, widget_crd: str, namespace: str
) -> None:
    spec = {"size": 2, "mode": "canary", "replicaz": 3}
    with pytest.raises(subprocess.CalledProcessError) as failed:
        dev_cluster.kubectl(
            "apply", "--validate=strict", "-n", namespace, "-f", "-", stdin=_widget("typo", spec)
        )
    assert 'unknown field "spec.replicaz"' in failed.value.stderr
    # Without strict validation the API server prunes the unknown field.
    dev_cluster.kubectl(
        "apply", "--validate=false", "-n", namespace, "-f", "-", stdin=_widget("typo", spec)
    )
    got = dev_cluster.kubectl_json("get", widget_crd, "-n", namespace, "typo")
    assert got["spec"] == {"size": 2, "mode": "canary"}


def _merge_patch(
    cluster: DevCluster,
    crd: str,
    namespace: str,
    patch: dict[str, object],
    subresource: str | None = None,
) -> None:
    """A JSON merge patch of widget ``st``, of its ``subresource`` when given."""
    flags = [f"--subresource={subresource}"] if subresource else []
    cluster.kubectl(
        "patch", crd, "st", "-n", namespace, *flags, "--type=merge", "-p", json.dumps(patch)
    )


def test_status_subresource(dev_cluster: DevCluster, widget_crd: str, namespace: str) -> None:
    dev_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=_widget("st", {"size": 1, "mode": "blueGreen"})
    )
    _merge_patch(dev_cluster, widget_crd, namespace, {"status": {"phase": "Ready"}}, "status")
    got = dev_cluster.kubectl_json("get", widget_crd, "-n", namespace, "st")
    assert got["status"] == {"phase": "Ready"}
    assert got["metadata"]["generation"] == 1, "a status write does not bump generation"

    # Through the main resource, status is ignored and spec changes bump generation.
    _merge_patch(
        dev_cluster, widget_crd, namespace, {"spec": {"size": 5}, "status": {"phase": "Hacked"}}
    )
    got = dev_cluster.kubectl_json("get", widget_crd, "-n", namespace, "st")
    assert got["status"] == {"phase": "Ready"}
    assert got["spec"]["size"] == 5
    assert got["metadata"]["generation"] == 2
