"""The spec models, the generated CRD, and that both agree."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from dscache_operator.crd import (
    build_crd,
    build_peering_crd,
    main,
    render_crd_yaml,
    render_files,
    target_dirs,
    targets,
)
from dscache_operator.revision import RevisionSource, revision_of
from dscache_operator.schema import InvalidSpecError, parse_duration
from dscache_operator.spec import DeepSeekCacheDeploymentSpec, parse_spec
from dscache_router.nginx import DEBIAN_LUA_MODULES

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"model": {"preset": "tiny-gqa"}}


def test_crd_files_are_generated_from_the_models() -> None:
    text = render_crd_yaml()
    for path in targets(ROOT):
        assert path.read_text() == text, f"{path} is stale: python -m dscache_operator.crd"
    files = render_files()
    assert set(files) == {
        "deepseekcachedeployments.dscache.io.yaml",
        "clusterkopfpeerings.kopf.dev.yaml",
        "kopfpeerings.kopf.dev.yaml",
    }
    for directory in target_dirs(ROOT):
        assert {p.name for p in directory.glob("*.yaml")} == set(files), directory
        for name, want in files.items():
            assert (directory / name).read_text() == want, f"{directory / name} is stale"


def test_crd_check_fails_on_a_stale_or_stray_file(tmp_path: Path) -> None:
    assert main(["--root", str(tmp_path)]) == 0  # writes them
    assert main(["--root", str(tmp_path), "--check"]) == 0
    chart_crd = tmp_path / "charts" / "dscache" / "crds" / "kopfpeerings.kopf.dev.yaml"
    chart_crd.write_text(chart_crd.read_text() + "# edited\n")
    assert main(["--root", str(tmp_path), "--check"]) == 1
    assert main(["--root", str(tmp_path)]) == 0
    (tmp_path / "crds" / "old.yaml").write_text("kind: Nothing\n")
    assert main(["--root", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize(
    "crd",
    [build_crd(), build_peering_crd(clusterwide=True), build_peering_crd(clusterwide=False)],
    ids=["dscd", "clusterkopfpeering", "kopfpeering"],
)
def test_crd_is_a_valid_kubernetes_object(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, "1.35.0", strict=True)


def test_peering_crds_are_what_kopf_looks_for() -> None:
    cluster = build_peering_crd(clusterwide=True)["spec"]
    ns = build_peering_crd(clusterwide=False)["spec"]
    assert (cluster["group"], cluster["names"]["plural"], cluster["scope"]) == (
        "kopf.dev",
        "clusterkopfpeerings",
        "Cluster",
    )
    assert (ns["names"]["kind"], ns["scope"]) == ("KopfPeering", "Namespaced")
    for spec in (cluster, ns):
        (version,) = spec["versions"]
        assert version["name"] == "v1" and "subresources" not in version  # kopf patches the object
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it (objects only; enough here)."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for name, prop in schema.get("properties", {}).items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
        if name in out:
            out[name] = _apply_defaults(prop, out[name])
    return out


def test_api_server_defaults_equal_the_model_defaults() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_schema = schema["properties"]["spec"]
    defaulted = _apply_defaults(spec_schema, copy.deepcopy(MINIMAL))
    local = DeepSeekCacheDeploymentSpec.model_validate(MINIMAL).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    # Empty maps are the same thing as absent ones to the API server.
    assert _drop_empty(defaulted) == _drop_empty(local)


def _drop_empty(value: Any) -> Any:
    if isinstance(value, dict):
        inner = {k: _drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in inner.items() if v != {}}
    return value


def test_every_field_is_documented_for_kubectl_explain() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for name, prop in node.get("properties", {}).items():
            if path and not prop.get("description"):
                missing.append(f"{path}.{name}")
            walk(prop, f"{path}.{name}" if path else name)
            if "items" in prop:
                walk(prop["items"], f"{path}.{name}[]")

    walk(schema["properties"]["spec"], "spec")
    walk(schema["properties"]["status"], "status")
    assert missing == []


def test_minimal_spec_gets_the_documented_defaults() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.replicas == 2
    assert spec.rollout.steps == [10, 25, 50, 100] and spec.steps == (10, 25, 50, 100)
    assert spec.rollout.analysis.min_hit_rate is None  # no absolute floor by default
    assert spec.rollout.analysis.min_hit_rate_ratio == 0.95
    assert spec.server.image.reference == "ghcr.io/dscache/dscache:0.1.0"
    assert spec.sidecar.image.reference == "ghcr.io/dscache/dscache-core:0.1.0"
    assert spec.prewarm.image.reference == "ghcr.io/dscache/dscache-core:0.1.0"
    assert spec.routing.image.reference == "ghcr.io/dscache/dscache-router:0.1.0"
    assert spec.routing.load_modules == list(DEBIAN_LUA_MODULES)
    assert spec.interval_s == 300 and spec.rollback_window_s == 1800
    assert spec.routing.session_header == "X-Session-ID"
    assert spec.cache.block_tokens == 256 and spec.cache.min_tokens == 0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": {}}, "exactly one of spec.model.preset or spec.model.path"),
        ({"model": {"preset": "a", "path": "/m"}}, "exactly one"),
        ({**MINIMAL, "rollout": {"steps": [50, 25, 100]}}, "must increase"),
        ({**MINIMAL, "rollout": {"steps": [10, 50]}}, "end at 100"),
        ({**MINIMAL, "rollout": {"interval": "5 minutes"}}, "spec.rollout.interval"),
        ({**MINIMAL, "replicas": -1}, "spec.replicas"),
        ({**MINIMAL, "cache": {"volume": {"type": "hostPath"}}}, "hostPath is required"),
        ({**MINIMAL, "tenantSalt": {"source": "secret"}}, "secretRef is required"),
        ({**MINIMAL, "unknown": 1}, "spec.unknown"),
        ({**MINIMAL, "routing": {"balanceFactor": 0.5}}, "balanceFactor must be 0"),
        ({**MINIMAL, "cache": {"tenantQuota": 0}}, "spec.cache.tenantQuota"),
        ({**MINIMAL, "cache": {"tenantQuota": 1.5}}, "spec.cache.tenantQuota"),
    ],
)
def test_invalid_specs_say_what_to_change(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec(raw)


def test_revision_changes_only_with_the_pods() -> None:
    base = parse_spec(MINIMAL)
    rev = revision_of(base.revision_source())
    assert rev == revision_of(parse_spec(MINIMAL).revision_source())
    for unrelated in (
        {"replicas": 7},
        {"routing": {"cookieName": "c"}},
        {"rollout": {"steps": [50, 100]}},
        {"prewarm": {"topN": 5}},
    ):
        assert revision_of(parse_spec({**MINIMAL, **unrelated}).revision_source()) == rev
    for related in (
        {"model": {"preset": "tiny-gqa", "revision": "2"}},
        {"server": {"image": {"repository": "r", "tag": "2"}}},
        {"cache": {"blockTokens": 128}},
    ):
        assert revision_of(parse_spec({**MINIMAL, **related}).revision_source()) != rev


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_examples_parse() -> None:
    for path in sorted((ROOT / "examples").glob("*/*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "DeepSeekCacheDeployment":
                parse_spec(doc["spec"])


def test_a_track_stored_by_an_older_operator_keeps_its_sidecar_image() -> None:
    # Before the core image, sidecar.image null meant "the server's image".
    stored = parse_spec(MINIMAL).revision_source().model_dump(mode="json", by_alias=True)
    stored["sidecar"]["image"] = None
    stored["server"]["image"] = {"repository": "r.example/dscache", "tag": "0.0.9"}
    src = RevisionSource.model_validate(stored)
    assert src.sidecar.image.reference == "r.example/dscache:0.0.9"


def test_patterns_are_valid_for_the_api_servers_go_regexp() -> None:
    # Go's RE2 rejects repeat counts above 1000; Python's re does not.
    patterns: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(build_crd())
    assert patterns
    for p in patterns:
        counts = [int(n) for n in re.findall(r"\{(\d+)(?:,(\d*))?\}", p) for n in n if n]
        assert all(c <= 1000 for c in counts), p
