"""The desired children: labels, ownership, probes, security, and schema validity."""

from __future__ import annotations

import shutil
import socket
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from dscache_operator.desired import (
    TEMPLATE_HASH,
    Owner,
    children,
    model_deployment,
    parse_quantity,
    router_config,
)
from dscache_operator.rollout import Observed, TrackObservation, next_step
from dscache_operator.spec import (
    DeepSeekCacheDeploymentSpec,
    DeepSeekCacheDeploymentStatus,
    parse_spec,
    revision_of,
)

from dscache.router import DEBIAN_LUA_MODULES

OWNER = Owner("chat", "prod", "0c5f0e38-8a7a-4f5b-9d63-2c1d3d1c2a11")
T0 = datetime(2026, 11, 30, 12, tzinfo=UTC)
READY = TrackObservation(exists=True, ready=True)


def _status_for(
    spec: DeepSeekCacheDeploymentSpec, status: DeepSeekCacheDeploymentStatus | None = None
) -> DeepSeekCacheDeploymentStatus:
    src = spec.revision_source()
    o = Observed(
        generation=1,
        revision=revision_of(src),
        source=src.model_dump(mode="json", by_alias=True),
        prewarm_enabled=False,
        tracks={"blue": READY, "green": READY},
    )
    return next_step(status or DeepSeekCacheDeploymentStatus(), o, T0).status


@pytest.fixture
def spec() -> DeepSeekCacheDeploymentSpec:
    return parse_spec(
        {
            "model": {"preset": "tiny-gqa", "revision": "1"},
            "replicas": 3,
            "server": {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}},
            "prewarm": {"prompts": {"name": "chat-prompts"}},
        }
    )


def _all(spec: DeepSeekCacheDeploymentSpec) -> list[dict[str, Any]]:
    s1 = _status_for(spec)
    spec2 = parse_spec(
        {**spec.model_dump(by_alias=True), "model": {"preset": "tiny-gqa", "revision": "2"}}
    )
    s2 = _status_for(spec2, s1)  # a rollout in progress: both tracks exist
    return children(
        OWNER, spec2, s2, ("10.0.0.1:8000",), ("10.0.1.1:8000",), prewarm=True, monitoring=True
    )


def test_every_child_is_owned_labelled_and_schema_valid(spec: DeepSeekCacheDeploymentSpec) -> None:
    objs = _all(spec)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds.count("Deployment") == 3  # blue, green, router
    assert {
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "PrometheusRule",
    } <= set(kinds)
    for o in objs:
        meta = o["metadata"]
        assert meta["namespace"] == "prod"
        ref = meta["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (
            "DeepSeekCacheDeployment",
            OWNER.uid,
            True,
        )
        for key in ("name", "instance", "component", "part-of", "managed-by"):
            assert f"app.kubernetes.io/{key}" in meta["labels"], (o["kind"], key)
        assert "dscache.io/track" in meta["labels"]
        if o["kind"] in ("ServiceMonitor", "PrometheusRule"):
            continue  # not in the core schemas
        kubernetes_validate.validate(o, "1.35.0", strict=True)


def test_model_pods_are_hardened_and_probed(spec: DeepSeekCacheDeploymentSpec) -> None:
    status = _status_for(spec)
    dep = model_deployment(OWNER, spec, status, "blue")
    assert dep["metadata"]["name"] == "chat-blue" and dep["spec"]["replicas"] == 3
    assert dep["metadata"]["labels"]["dscache.io/track"] == "stable"
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    server, sidecar = pod["containers"]
    for c in (server, sidecar):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"]["drop"] == ["ALL"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "grpc_health" in " ".join(sidecar["livenessProbe"]["exec"]["command"])
    assert server["args"][:3] == ["server", "--model", "tiny-gqa"]
    assert "--sidecar-socket" in server["args"]
    assert sidecar["args"][0] == "sidecar"
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["cache"]["mountPath"] == "/var/cache/dscache"  # shared with the sidecar
    assert not mounts["cache"].get("readOnly")  # the server writes allocated blocks
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"cache", "socket", "tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"]["emptyDir"]["sizeLimit"] == str(parse_quantity("10Gi"))


def test_template_hash_is_on_the_deployment_and_in_the_template(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    dep = model_deployment(OWNER, spec, _status_for(spec), "blue")
    label = dep["metadata"]["labels"][TEMPLATE_HASH]
    assert dep["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH] == label


def test_stable_track_keeps_its_template_while_the_spec_moves_on(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    s1 = _status_for(spec)
    before = model_deployment(OWNER, spec, s1, "blue")
    spec2 = parse_spec(
        {**spec.model_dump(by_alias=True), "model": {"preset": "tiny-gqa", "revision": "9"}}
    )
    s2 = _status_for(spec2, s1)
    assert s2.canary_slot == "green"
    after = model_deployment(OWNER, spec2, s2, "blue")
    assert after["spec"]["template"] == before["spec"]["template"]
    green = model_deployment(OWNER, spec2, s2, "green")
    assert "9" in green["spec"]["template"]["spec"]["containers"][0]["args"]
    assert green["metadata"]["labels"]["dscache.io/track"] == "canary"


def test_rendering_is_deterministic(spec: DeepSeekCacheDeploymentSpec) -> None:
    assert _all(spec) == _all(spec)


def test_router_config_follows_the_status(spec: DeepSeekCacheDeploymentSpec) -> None:
    s = _status_for(spec)
    cfg = router_config(spec, s, ("10.0.0.1:8000",), ("10.0.1.1:8000",))
    assert cfg.canary == () and cfg.effective_weight == 0  # no rollout: no canary upstream
    assert cfg.session_header == "X-Session-ID"


def test_frozen_tracks_are_not_applied(spec: DeepSeekCacheDeploymentSpec) -> None:
    s = _status_for(spec)
    data = s.model_dump()
    data["slots"]["blue"]["frozen"] = True
    frozen = DeepSeekCacheDeploymentStatus.model_validate(data)
    objs = children(OWNER, spec, frozen, (), (), prewarm=False, monitoring=False)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("Deployment", "chat-blue") not in names and ("Service", "chat-blue") in names


def test_prewarm_job_targets_the_canary(spec: DeepSeekCacheDeploymentSpec) -> None:
    objs = _all(spec)
    (job,) = [o for o in objs if o["kind"] == "Job"]
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TARGET"] == "http://chat-green.prod.svc:8000" and env["TOP_N"] == "100"
    assert "dscache prewarm" in job["spec"]["template"]["spec"]["containers"][0]["command"][2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_operators_router_config_passes_nginx_t(
    spec: DeepSeekCacheDeploymentSpec, tmp_path: Path
) -> None:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists() or not all(Path(m).exists() for m in DEBIAN_LUA_MODULES):
        pytest.skip("needs nginx-light + libnginx-mod-http-lua")
    objs = _all(spec)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    text = cm["data"]["nginx.conf"]
    assert "10.0.0.1:8000" in text and "access_by_lua_block" in text
    # OpenResty has Lua built in; Debian's NGINX loads it as a module.
    modules = "".join(f"load_module {m};\n" for m in DEBIAN_LUA_MODULES)
    local = text.replace("/tmp", str(tmp_path)).replace(
        "listen 8080;", f"listen 127.0.0.1:{_free_port()};"
    )
    conf = tmp_path / "nginx.conf"
    conf.write_text(modules + local)
    done = subprocess.run(
        [nginx, "-t", "-q", "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
