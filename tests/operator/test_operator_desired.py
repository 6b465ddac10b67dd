"""The desired children: labels, ownership, probes, security, and schema validity."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from dscache_operator.desired import (
    PREWARM_TARGETS_ENV,
    ROUTER_CONF,
    TEMPLATE_HASH,
    children,
    model_deployment,
    prewarm_copy_range,
    prewarm_job,
    router_config,
    router_configmap,
    router_deployment,
)
from dscache_operator.quantity import quantity_bytes
from dscache_operator.revision import revision_of
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import DeepSeekCacheDeploymentSpec, parse_spec
from dscache_operator.status import DeepSeekCacheDeploymentStatus
from dscache_router.nginx import DEBIAN_LUA_MODULES, render_nginx_conf
from dscache_router.nginx.render import PICKER_HEALTH_PATH
from dscache_tools.net import free_port
from needs import need_nginx
from spec_helpers import OWNER, released_revision, status_for


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


def _rollout(
    spec: DeepSeekCacheDeploymentSpec,
) -> tuple[DeepSeekCacheDeploymentSpec, DeepSeekCacheDeploymentStatus]:
    s1 = status_for(spec)
    spec2 = parse_spec(
        {**spec.model_dump(by_alias=True), "model": {"preset": "tiny-gqa", "revision": "2"}}
    )
    return spec2, status_for(spec2, s1)  # a rollout in progress: both tracks exist


CANARY_PODS = ("10.0.1.1:8000", "10.0.1.2:8000", "[fd00::7]:8000")


def _all(spec: DeepSeekCacheDeploymentSpec) -> list[dict[str, Any]]:
    spec2, s2 = _rollout(spec)
    objs = children(OWNER, spec2, s2, ("10.0.0.1:8000",), CANARY_PODS[:1], monitoring=True)
    job = prewarm_job(OWNER, spec2, s2, CANARY_PODS)
    assert job is not None
    return [*objs, job]


def test_every_child_is_owned_labelled_and_schema_valid(spec: DeepSeekCacheDeploymentSpec) -> None:
    objs = _all(spec)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds.count("Deployment") == 3  # blue, green, router
    monitors = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "ServiceMonitor"}
    # NGINX's counters, and the picker's, which listens on the pod's loopback only.
    assert monitors["chat-router"]["endpoints"] == [
        {"port": "http", "path": "/dscache/router/metrics", "interval": "15s"},
        {"port": "http", "path": "/dscache/picker/metrics", "interval": "15s"},
    ]
    spec_off, s_off = _rollout(
        parse_spec({**spec.model_dump(by_alias=True), "routing": {"picker": {"enabled": False}}})
    )
    off = children(OWNER, spec_off, s_off, ("10.0.0.1:8000",), (), monitoring=True)
    (router_monitor,) = [
        o for o in off if o["kind"] == "ServiceMonitor" and o["metadata"]["name"] == "chat-router"
    ]
    assert [e["path"] for e in router_monitor["spec"]["endpoints"]] == ["/dscache/router/metrics"]
    assert monitors["chat"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "model"
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
    status = status_for(spec)
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
    # The sidecar's probes are HTTP on its metrics port: no process spawned per probe.
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert "exec" not in sidecar["livenessProbe"] and "exec" not in sidecar["readinessProbe"]
    # Liveness starts once the sidecar answers: a slow start on a busy node is waited
    # for (minutes), not killed (a killed store quarantines its space for 90 s).
    start = sidecar["startupProbe"]
    assert start["httpGet"] == sidecar["livenessProbe"]["httpGet"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 300
    live = sidecar["livenessProbe"]
    assert start["periodSeconds"] < live["periodSeconds"] * live["failureThreshold"]
    assert {p["name"] for p in sidecar["ports"]} == {"metrics"}
    # Images: torch for the server, the slim core image for the sidecar.
    assert server["image"] == "ghcr.io/dscache/dscache:0.1.0"
    assert sidecar["image"] == "ghcr.io/dscache/dscache-core:0.1.0"
    assert "initContainers" not in pod  # emptyDir: nothing to chown
    assert server["args"][:3] == ["server", "--model", "tiny-gqa"]
    assert "--sidecar-socket" in server["args"]
    assert sidecar["args"][0] == "sidecar"
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["cache"]["mountPath"] == "/var/cache/dscache"  # shared with the sidecar
    assert not mounts["cache"].get("readOnly")  # the server writes allocated blocks
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"cache", "socket", "tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"]["emptyDir"]["sizeLimit"] == str(quantity_bytes("10Gi"))


def test_template_hash_is_on_the_deployment_and_in_the_template(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    dep = model_deployment(OWNER, spec, status_for(spec), "blue")
    label = dep["metadata"]["labels"][TEMPLATE_HASH]
    assert dep["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH] == label


def test_stable_track_keeps_its_template_while_the_spec_moves_on(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    s1 = status_for(spec)
    before = model_deployment(OWNER, spec, s1, "blue")
    spec2 = parse_spec(
        {**spec.model_dump(by_alias=True), "model": {"preset": "tiny-gqa", "revision": "9"}}
    )
    s2 = status_for(spec2, s1)
    assert s2.canary_slot == "green"
    after = model_deployment(OWNER, spec2, s2, "blue")
    assert after["spec"]["template"] == before["spec"]["template"]
    green = model_deployment(OWNER, spec2, s2, "green")
    assert "9" in green["spec"]["template"]["spec"]["containers"][0]["args"]
    assert green["metadata"]["labels"]["dscache.io/track"] == "canary"


def test_rendering_is_deterministic(spec: DeepSeekCacheDeploymentSpec) -> None:
    assert _all(spec) == _all(spec)


def test_router_config_follows_the_status(spec: DeepSeekCacheDeploymentSpec) -> None:
    s = status_for(spec)
    cfg = router_config(spec, s, ("10.0.0.1:8000",), ("10.0.1.1:8000",))
    assert cfg.canary == () and cfg.effective_weight == 0  # no rollout: no canary upstream
    assert cfg.session_header == "X-Session-ID"


def test_bounded_loads_and_tenant_quotas_reach_the_router_and_the_sidecars(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    s = status_for(spec)
    cfg = router_config(spec, s, ("10.0.0.1:8000", "10.0.0.2:8000"), ())
    assert cfg.balance_factor == 1.25 and cfg.balanced  # on by default
    assert "balancer_by_lua_block" in render_nginx_conf(cfg)

    def sidecar_args(raw: dict[str, Any]) -> list[str]:
        parsed = parse_spec(raw)
        dep = model_deployment(OWNER, parsed, status_for(parsed), "blue")
        containers = dep["spec"]["template"]["spec"]["containers"]
        (side,) = [c for c in containers if c["name"] == "sidecar"]
        return list(side["args"])

    base = spec.model_dump(by_alias=True)
    assert "--tenant-quota" not in sidecar_args(base)  # no quota, templates as before
    args = sidecar_args({**base, "cache": {**base["cache"], "tenantQuota": 0.2}})
    assert args[args.index("--tenant-quota") + 1] == "0.2"
    off = parse_spec({**base, "routing": {**base["routing"], "balanceFactor": 0}})
    plain = router_config(off, s, ("10.0.0.1:8000", "10.0.0.2:8000"), ())
    assert not plain.balanced
    assert "hash $dscache_key consistent;" in render_nginx_conf(plain)


def test_direct_lookups_share_the_pid_namespace_and_an_upgrade_restarts_no_pod(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    """LMDB tells reader processes apart by pid: the server reading the sidecar's
    index needs one PID namespace in the pod. Tracks stored by an older operator
    keep their template (no restart on upgrade) and their revision."""
    s = status_for(spec)
    pod = model_deployment(OWNER, spec, s, "blue")["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    base = spec.model_dump(by_alias=True)
    off = parse_spec({**base, "cache": {**base["cache"], "directLookup": False}})
    off_pod = model_deployment(OWNER, off, status_for(off), "blue")["spec"]["template"]["spec"]
    assert "shareProcessNamespace" not in off_pod
    assert revision_of(off.revision_source()) != revision_of(spec.revision_source())
    # What an older operator stored: no cache.directLookup in the track's source.
    legacy = s.model_copy(deep=True)
    del legacy.slots["blue"].source["cache"]["directLookup"]
    legacy_pod = model_deployment(OWNER, spec, legacy, "blue")["spec"]["template"]
    off_template = model_deployment(OWNER, off, status_for(off), "blue")["spec"]["template"]
    assert "shareProcessNamespace" not in legacy_pod["spec"]
    assert legacy_pod["spec"] == off_template["spec"]
    # ... and the spec (read with the new default) keeps the revision it had then.
    assert revision_of(spec.revision_source()) == released_revision(spec.revision_source())


def test_engine_vllm_runs_dscache_vllm_serve_beside_the_sidecar(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    base = spec.model_dump(by_alias=True)
    vllm = parse_spec(
        {
            **base,
            "engine": "vllm",
            "model": {"path": "/models/ds", "revision": "7"},
            "vllm": {"args": ["--dtype", "bfloat16"]},
            "tenantSalt": {"source": "namespace"},
        }
    )
    assert revision_of(vllm.revision_source()) != revision_of(spec.revision_source())
    pod = model_deployment(OWNER, vllm, status_for(vllm), "blue")["spec"]["template"]["spec"]
    server, sidecar = pod["containers"]
    assert server["image"] == "ghcr.io/dscache/dscache-vllm:0.1.0"
    assert server["command"] == ["dscache"]
    args = server["args"]
    assert args[:2] == ["vllm", "serve"]
    # dscache's flags before the model, vLLM's after it.
    at = args.index("/models/ds")
    assert args[args.index("--socket") + 1] == "/run/dscache/sidecar.sock"
    assert args[args.index("--data-dir") + 1] == "/var/cache/dscache"
    assert args[args.index("--revision") + 1] == "7"
    assert max(args.index(f) for f in ("--socket", "--data-dir", "--revision")) < at
    assert args[at + 1 :] == [
        "--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "8", "--dtype", "bfloat16",
    ]  # fmt: skip
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in server["env"]
    assert any(e["name"] == "DSCACHE_VLLM_TENANT_SECRET" for e in server["env"])
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    assert sidecar["name"] == "sidecar" and pod["shareProcessNamespace"] is True
    # vLLM's multiprocess executor needs more shared memory than a container's 64 MiB.
    assert {"name": "dshm", "mountPath": "/dev/shm"} in server["volumeMounts"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    # The reference engine's pods are what they were (the new fields at their defaults).
    ref = model_deployment(OWNER, spec, status_for(spec), "blue")["spec"]["template"]["spec"]
    assert ref["containers"][0]["args"][0] == "server"
    assert "dshm" not in {v["name"] for v in ref["volumes"]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": {"preset": "tiny-gqa"}}, "set spec.model.path"),
        ({"auth": {"apiKeysSecretRef": {"name": "k", "key": "k"}}}, "gateway"),
    ],
)
def test_engine_vllm_rejects_what_it_cannot_serve(
    spec: DeepSeekCacheDeploymentSpec, change: dict[str, Any], message: str
) -> None:
    base = {**spec.model_dump(by_alias=True), "model": {"path": "/m"}, "engine": "vllm"}
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec({**base, **change})


def test_router_tracks_are_slots_and_the_previous_one_keeps_its_sessions(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    spec2, s2 = _rollout(spec)
    stable, canary, old = ("10.0.0.1:8000",), ("10.0.1.1:8000",), ("10.0.2.1:8000",)
    during = router_config(spec2, s2, stable, canary)
    assert (during.stable_name, during.canary_name) == (s2.stable_slot, s2.canary_slot)
    assert during.session_memory_s == 1800  # routing.sessionMemory default 30m
    # Promoted: the new slot is stable, the old one is the warm previous track,
    # named by its slot so the sessions remembered on it stay there.
    promoted = s2.model_copy(
        update={
            "stable_slot": s2.canary_slot,
            "stable_revision": s2.canary_revision,
            "previous_slot": s2.stable_slot,
            "canary_slot": None,
            "canary_revision": None,
            "weight": 0,
        }
    )
    after = router_config(spec2, promoted, canary, (), old)
    assert after.stable == canary and after.stable_name == s2.canary_slot
    assert after.previous == old and after.previous_name == s2.stable_slot
    assert after.canary == ()
    assert after.live_tracks == (s2.canary_slot, s2.stable_slot)
    text = render_nginx_conf(after)
    assert (
        f"upstream dscache_{s2.stable_slot} " in text and "lua_shared_dict dscache_sessions" in text
    )
    # sessionMemory 0s: sessions follow the weight, a previous track takes nothing.
    forgetful = parse_spec({**spec2.model_dump(by_alias=True), "routing": {"sessionMemory": "0s"}})
    off = router_config(forgetful, promoted, canary, (), old)
    assert off.session_memory_s == 0 and off.previous == ()
    assert "lua_shared_dict dscache_sessions" not in render_nginx_conf(off)


def test_frozen_tracks_are_not_applied(spec: DeepSeekCacheDeploymentSpec) -> None:
    s = status_for(spec)
    data = s.model_dump()
    data["slots"]["blue"]["frozen"] = True
    frozen = DeepSeekCacheDeploymentStatus.model_validate(data)
    objs = children(OWNER, spec, frozen, (), (), monitoring=False)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("Deployment", "chat-blue") not in names and ("Service", "chat-blue") in names


def test_prewarm_job_warms_every_ready_canary_pod(spec: DeepSeekCacheDeploymentSpec) -> None:
    spec2, s2 = _rollout(spec)
    job = prewarm_job(OWNER, spec2, s2, CANARY_PODS)
    assert job is not None
    assert job["metadata"]["name"] == f"chat-prewarm-{s2.canary_revision}"
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env[PREWARM_TARGETS_ENV] == (
        "http://10.0.1.1:8000,http://10.0.1.2:8000,http://[fd00::7]:8000"
    )
    # Exec form, no shell: every target, the top N prompts, the core image.
    assert c["command"] == ["dscache"]
    args = c["args"]
    assert args[:3] == ["prewarm", "--target", f"$({PREWARM_TARGETS_ENV})"]
    assert args[args.index("--top-n") + 1] == "100"
    assert args[args.index("--concurrency") + 1] == "2"
    assert c["image"] == "ghcr.io/dscache/dscache-core:0.1.0"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    # The Job is not among the children re-applied on every reconcile.
    assert not any(o["kind"] == "Job" for o in children(OWNER, spec2, s2, (), (), monitoring=False))


def _args(job: dict[str, Any] | None) -> list[str]:
    assert job is not None
    args: list[str] = job["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_ring_prewarm_is_progressive_one_copy_first_then_as_the_share_grows(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    spec2, s2 = _rollout(spec)
    every = spec2
    prewarm = {**spec2.prewarm.model_dump(by_alias=True), "placement": "ring"}
    spec2 = parse_spec({**spec2.model_dump(by_alias=True), "prewarm": prewarm})
    pods = tuple(f"10.0.2.{i}:8000" for i in range(1, 11))  # ten canary pods
    # Steps 10/25/50/100: 1, 3, 5, 10 copies of each prompt on its ring walk.
    assert [prewarm_copy_range(spec2, 10, i) for i in range(4)] == [
        (0, 1),
        (1, 3),
        (3, 5),
        (5, 10),
    ]
    first = _args(prewarm_job(OWNER, spec2, s2, pods))
    assert _flag(first, "--placement") == "ring"
    assert (_flag(first, "--skip-copies"), _flag(first, "--copies")) == ("0", "1")
    assert _flag(first, "--prompt-key-max-bytes") == "4096"  # the router's prompt key
    third = prewarm_job(OWNER, spec2, s2, pods, step=2)
    assert third is not None
    assert third["metadata"]["name"] == f"chat-prewarm-{s2.canary_revision}-s2"
    assert (_flag(_args(third), "--skip-copies"), _flag(_args(third), "--copies")) == ("3", "5")
    # Two pods: 10% and 25% and 50% all mean one copy; only 100% needs a second Job.
    two = CANARY_PODS[:2]
    assert [prewarm_copy_range(spec2, 2, i) for i in range(4)] == [(0, 1), None, None, (1, 2)]
    assert prewarm_job(OWNER, spec2, s2, two, step=1) is None
    assert prewarm_job(OWNER, spec2, s2, two, step=4) is None  # past the last step
    # placement: all (the default) is the one-shot warm of every pod before the first step.
    assert "--placement" not in _args(prewarm_job(OWNER, every, s2, pods))
    assert prewarm_copy_range(every, 10, 1) is None


def test_mined_templates_need_the_gateway_secret_and_come_from_the_stable_pods(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    spec2, s2 = _rollout(spec)
    stable = ("10.0.3.1:8000", "10.0.3.2:8000")
    # No gateway secret: the prompt list only.
    assert "--mined-from" not in _args(prewarm_job(OWNER, spec2, s2, CANARY_PODS, sources=stable))
    data = spec2.model_dump(by_alias=True)
    data["auth"] = {"gatewaySecretRef": {"name": "gw", "key": "token"}}
    data["prewarm"] = {"mined": {"top": 20}}  # no prompt list at all
    gated = parse_spec(data)
    job = prewarm_job(OWNER, gated, s2, CANARY_PODS, sources=stable)
    args = _args(job)
    assert _flag(args, "--mined-from") == "$(DSCACHE_PREWARM_SOURCES)"
    assert _flag(args, "--mined-top") == "20" and "--prompts" not in args
    assert job is not None
    (c,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["DSCACHE_PREWARM_SOURCES"] == "http://10.0.3.1:8000,http://10.0.3.2:8000"
    token = {"secretKeyRef": {"name": "gw", "key": "token"}}
    assert env["DSCACHE_PREWARM_GATEWAY_TOKEN"] == token
    assert [m["name"] for m in c["volumeMounts"]] == ["tmp"]  # no prompts ConfigMap
    # The model servers check the same token.
    objs = children(OWNER, gated, status_for(gated), (), (), monitoring=False)
    server = next(
        ct
        for o in objs
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-blue"
        for ct in o["spec"]["template"]["spec"]["containers"]
        if ct["name"] == "server"
    )
    server_env = {e["name"]: e.get("valueFrom") for e in server["env"]}
    assert server_env["DSCACHE_SERVER_GATEWAY_SECRET"] == token
    # Mined off: no prompts, no Job.
    data["prewarm"] = {"mined": {"enabled": False}}
    assert prewarm_job(OWNER, parse_spec(data), s2, CANARY_PODS, sources=stable) is None


def test_no_prewarm_job_without_a_ready_canary_pod(spec: DeepSeekCacheDeploymentSpec) -> None:
    spec2, s2 = _rollout(spec)
    assert prewarm_job(OWNER, spec2, s2, ()) is None
    no_prompts = parse_spec({**spec2.model_dump(by_alias=True), "prewarm": {}})
    assert prewarm_job(OWNER, no_prompts, s2, CANARY_PODS) is None


def test_scheduling_places_model_router_and_prewarm_pods(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    placement = {
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "inference",
    }
    placed = parse_spec({**spec.model_dump(by_alias=True), "scheduling": placement})
    # Where model pods run shapes them: a new placement is a new revision (rolled out).
    assert revision_of(placed.revision_source()) != revision_of(spec.revision_source())
    spec2, s2 = _rollout(placed)
    objs = children(OWNER, spec2, s2, ("10.0.0.1:8000",), CANARY_PODS[:1], monitoring=False)
    job = prewarm_job(OWNER, spec2, s2, CANARY_PODS)
    assert job is not None
    pods = [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"]
    pods.append(job["spec"]["template"]["spec"])
    assert len(pods) == 4  # blue, green, router, prewarm
    for pod in pods:
        assert pod["nodeSelector"] == placement["nodeSelector"]
        assert pod["tolerations"] == placement["tolerations"]
        assert pod["priorityClassName"] == "inference"
    # Unset: none of the fields is rendered.
    for o in children(OWNER, spec, status_for(spec), (), (), monitoring=False):
        if o["kind"] == "Deployment":
            assert not {"nodeSelector", "tolerations", "priorityClassName"} & set(
                o["spec"]["template"]["spec"]
            )


def test_invalid_scheduling_is_rejected(spec: DeepSeekCacheDeploymentSpec) -> None:
    base = spec.model_dump(by_alias=True)
    with pytest.raises(InvalidSpecError, match="scheduling"):
        parse_spec({**base, "scheduling": {"tolerations": [{"operator": "Sometimes"}]}})
    with pytest.raises(InvalidSpecError, match="scheduling"):
        parse_spec({**base, "scheduling": {"nodeSelector": {"bad key!": "x"}}})


def test_host_path_caches_get_a_directory_per_track(spec: DeepSeekCacheDeploymentSpec) -> None:
    hp = parse_spec(
        {
            **spec.model_dump(by_alias=True),
            "cache": {"volume": {"type": "hostPath", "hostPath": "/mnt/nvme/dscache/"}},
        }
    )
    spec2, s2 = _rollout(hp)
    paths = {}
    for slot in ("blue", "green"):
        dep = model_deployment(OWNER, spec2, s2, slot)
        kubernetes_validate.validate(dep, "1.35.0", strict=True)
        pod = dep["spec"]["template"]["spec"]
        (cache,) = [v for v in pod["volumes"] if v["name"] == "cache"]
        paths[slot] = cache["hostPath"]["path"]
        assert cache["hostPath"]["type"] == "DirectoryOrCreate"
        # The kubelet creates it root-owned; an init container hands it to uid 10001 ...
        (init,) = pod["initContainers"]
        assert init["command"] == ["chown", "10001:10001", "/var/cache/dscache"]
        assert init["image"] == "ghcr.io/dscache/dscache-core:0.1.0"
        assert init["volumeMounts"] == [{"name": "cache", "mountPath": "/var/cache/dscache"}]
        # ... as root with CHOWN alone: no other capability, no escalation, read-only root.
        sc = init["securityContext"]
        assert (sc["runAsUser"], sc["runAsNonRoot"]) == (0, False)
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        # Two pods of one track never share a node (and so never a directory).
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["labelSelector"]["matchLabels"]["dscache.io/slot"] == slot
    assert paths == {
        "blue": "/mnt/nvme/dscache/prod/chat-blue",
        "green": "/mnt/nvme/dscache/prod/chat-green",
    }
    # Stable across restarts and rollouts: the same track finds the same directory.
    spec3, s3 = _rollout(spec2)
    again = model_deployment(OWNER, spec3, s3, "blue")["spec"]["template"]["spec"]["volumes"]
    assert {v["name"]: v for v in again}["cache"]["hostPath"]["path"] == paths["blue"]


def test_router_runs_nginx_itself_and_watches_its_config(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    dep = router_deployment(OWNER, spec)
    pod = dep["spec"]["template"]["spec"]
    c, picker = containers = pod["containers"]
    assert c["image"] == "ghcr.io/dscache/dscache-router:0.1.0"
    assert c["command"] == ["nginx"]  # exec form, no shell
    assert c["args"] == [
        "-p",
        "/tmp",
        "-e",
        "stderr",
        "-c",
        "/etc/dscache-router/nginx.conf",
        "-g",
        "daemon off;",
    ]
    assert (
        "annotations" not in dep["spec"]["template"]["metadata"]
    )  # a config change restarts nothing
    cfg = router_config(spec, status_for(spec), ("10.0.0.1:8000",), ())
    assert cfg.watch_config and cfg.config_path == ROUTER_CONF
    text = router_configmap(OWNER, cfg)["data"]["nginx.conf"]
    assert "init_worker_by_lua_block" in text and "# dscache-config-id: " in text
    for module in DEBIAN_LUA_MODULES:
        assert f"load_module {module};" in text
    openresty = parse_spec({**spec.model_dump(by_alias=True), "routing": {"loadModules": []}})
    assert "load_module" not in render_text(openresty)
    # Beside NGINX, the picker on the pod's loopback: NGINX asks it, and proxies its health.
    assert picker["command"] == ["dscache"] and picker["image"] == spec.sidecar.image.reference
    assert picker["args"][:5] == ["picker", "--host", "127.0.0.1", "--port", "8090"]
    assert picker["args"][5:7] == ["--holdings-port", str(spec.sidecar.metrics_port)]
    # Probed through NGINX by port number (a named port would be looked up in the
    # picker's own container, which has none: the kubelet could not run the probe).
    for kind in ("startupProbe", "livenessProbe"):
        assert picker[kind]["httpGet"] == {"path": PICKER_HEALTH_PATH, "port": 8080}, kind
    named = {port["name"] for c in containers for port in c.get("ports", [])}
    for c in containers:
        own = {port["name"] for port in c.get("ports", [])}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = c.get(kind, {}).get("httpGet", {}).get("port")
            assert not isinstance(port, str) or port in own, (c["name"], kind, named)
    assert cfg.picker == "127.0.0.1:8090" and cfg.picker_timeout_ms == 250
    assert f"location = {PICKER_HEALTH_PATH}" in text and "upstream dscache_picker" in text


@pytest.mark.parametrize(
    "routing",
    [{"picker": {"enabled": False}}, {"balanceFactor": 0}],
    ids=["picker off", "no Lua balancer"],
)
def test_without_the_picker_the_router_pod_is_nginx_alone(
    spec: DeepSeekCacheDeploymentSpec, routing: dict[str, object]
) -> None:
    off = parse_spec({**spec.model_dump(by_alias=True), "routing": routing})
    (c,) = router_deployment(OWNER, off)["spec"]["template"]["spec"]["containers"]
    assert c["name"] == "nginx"
    assert router_config(off, status_for(off), ("10.0.0.1:8000",), ()).picker is None
    assert "dscache_picker" not in render_text(off)


def test_picker_settings_reach_its_flags_and_bad_ones_are_refused(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    picker = {"similarityThreshold": 0.8, "domainTerms": {"ebitda": 4}, "timeout": "1s"}
    tuned = parse_spec({**spec.model_dump(by_alias=True), "routing": {"picker": picker}})
    args = router_deployment(OWNER, tuned)["spec"]["template"]["spec"]["containers"][1]["args"]
    assert args[7:] == ["--similarity-threshold", "0.8", "--domain-term", "ebitda=4"]
    assert router_config(tuned, status_for(tuned), ("10.0.0.1:8000",), ()).picker_timeout_ms == 1000
    for bad in ({"timeout": "20s"}, {"domainTerms": {"a b": 1}}, {"similarityThreshold": 2}):
        with pytest.raises(InvalidSpecError):
            parse_spec({**spec.model_dump(by_alias=True), "routing": {"picker": bad}})


def render_text(spec: DeepSeekCacheDeploymentSpec) -> str:
    cfg = router_config(spec, status_for(spec), ("10.0.0.1:8000",), ())
    text: str = router_configmap(OWNER, cfg)["data"]["nginx.conf"]
    return text


def test_the_operators_router_config_passes_nginx_t(
    spec: DeepSeekCacheDeploymentSpec, tmp_path: Path
) -> None:
    nginx = need_nginx()
    objs = _all(spec)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    text = cm["data"]["nginx.conf"]
    assert "10.0.0.1:8000" in text and "access_by_lua_block" in text
    # As the router image runs it: Debian's NGINX loading the ndk and Lua modules.
    local = text.replace("/tmp", str(tmp_path)).replace(
        "listen 8080;", f"listen 127.0.0.1:{free_port()};"
    )
    conf = tmp_path / "nginx.conf"
    conf.write_text(local)
    done = subprocess.run(
        [nginx, "-t", "-q", "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
