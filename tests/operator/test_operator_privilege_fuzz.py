"""Privilege fuzzing of the resource (issue 30): whatever a namespace user writes in a spec,
the operator renders no privileged pod, no host path outside the admin's roots, no
reference into another namespace, and fetches no URL the admin did not allow.

Hypothesis generates specs around the fields that touch privilege (volumes, sizes,
images, tolerations, secrets, the Prometheus URL, the shared tier, the engine). A
spec is either refused (``InvalidSpecError``, ``NotAllowedError``: safe) or rendered
with every child, the prewarm Job included, and checked.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from dscache_operator.analysis import PrometheusError
from dscache_operator.desired import Owner, children, prewarm_job
from dscache_operator.kube import Kube
from dscache_operator.metrics import OperatorMetrics
from dscache_operator.policy import AdminPolicy, check_spec, normalise_host_path
from dscache_operator.reconcile import Reconciler
from dscache_operator.schema import InvalidSpecError
from dscache_operator.settings import OperatorSettings
from dscache_operator.spec import parse_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_helpers import status_for

OWNER = Owner("fuzz", "team-a", "11111111-2222-3333-4444-555555555555")
ADMIN_URL = "http://prometheus.monitoring:9090"
POLICY = AdminPolicy(prometheus_url=ADMIN_URL, toleration_keys=("nvidia.com/*", "dscache.io/*"))

_path_part = st.sampled_from(["..", ".", "", "var", "lib", "dscache", "etc", "root", "a", "/"])
host_paths = st.lists(_path_part, min_size=1, max_size=6).map(lambda p: "/" + "/".join(p))
names = st.from_regex(r"[a-z][a-z0-9-]{0,8}[a-z0-9]", fullmatch=True)
images = st.fixed_dictionaries(
    {
        "repository": st.sampled_from(
            ["ghcr.io/dscache/dscache-core", "evil.example/root", "ghcr.io/dscache/dscache"]
        ),
        "tag": st.sampled_from(["0.1.0", "latest", "sha256:" + "a" * 64]),
    }
)
secret_refs = st.fixed_dictionaries({"name": names, "key": st.sampled_from(["k", "salt"])})
tolerations = st.lists(
    st.fixed_dictionaries(
        {"operator": st.sampled_from(["Exists", "Equal"])},
        optional={
            "key": st.sampled_from(["nvidia.com/gpu", "node-role.kubernetes.io/control-plane"]),
            "effect": st.sampled_from(["NoSchedule", "NoExecute"]),
        },
    ),
    max_size=3,
)
volumes = st.one_of(
    st.just({"type": "emptyDir"}),
    st.fixed_dictionaries({"type": st.just("hostPath"), "hostPath": host_paths}),
    st.fixed_dictionaries(
        {"type": st.just("persistentVolumeClaim")},
        optional={"claimName": names, "claimTemplate": st.just({"storageClassName": "ssd"})},
    ),
)
urls = st.sampled_from(
    [
        ADMIN_URL,
        ADMIN_URL + "/",
        "http://169.254.169.254/latest/meta-data",
        "http://kubernetes.default:443",
        "http://prometheus.monitoring:9090.evil.example",
    ]
)
specs = st.fixed_dictionaries(
    {"model": st.just({"preset": "tiny-gqa"})},
    optional={
        "engine": st.just("reference"),
        "server": st.fixed_dictionaries({"image": images}),
        "sidecar": st.fixed_dictionaries({"image": images}),
        "cache": st.fixed_dictionaries(
            {"volume": volumes},
            optional={
                "size": st.sampled_from(["1Gi", "900Gi", "2Ti", "100Ei"]),
                "shared": st.fixed_dictionaries(
                    {"enabled": st.booleans(), "secretRef": st.fixed_dictionaries({"name": names})}
                ),
            },
        ),
        "tenantSalt": st.one_of(
            st.just({"source": "generated"}),
            st.just({"source": "namespace"}),
            st.fixed_dictionaries({"source": st.just("secret"), "secretRef": secret_refs}),
        ),
        "auth": st.fixed_dictionaries(
            {}, optional={"apiKeysSecretRef": secret_refs, "gatewaySecretRef": secret_refs}
        ),
        "prewarm": st.fixed_dictionaries(
            {"prompts": st.fixed_dictionaries({"name": names}), "image": images},
            optional={"apiKeySecretRef": secret_refs},
        ),
        "routing": st.fixed_dictionaries({"image": images}),
        "scheduling": st.fixed_dictionaries({"tolerations": tolerations}),
        "rollout": st.fixed_dictionaries(
            {"analysis": st.fixed_dictionaries({"prometheusUrl": urls})}
        ),
    },
)


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    tmpl = obj.get("spec", {}).get("template", {}).get("spec")
    return [tmpl] if tmpl else []


def _check_pod(pod: dict[str, Any]) -> None:
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(flag), flag
    assert pod["securityContext"]["runAsNonRoot"] is True
    for t in pod.get("tolerations", []):
        assert t.get("key", "").startswith(("nvidia.com/", "dscache.io/")), t
    for c in [*pod["containers"], *pod.get("initContainers", [])]:
        sc = c["securityContext"]
        assert not sc.get("privileged")
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        added = sc["capabilities"].get("add", [])
        if c["name"] == "cache-owner":
            # The one root container: the admin's image and command, CHOWN only.
            assert added == ["CHOWN"] and c["image"] == POLICY.cache_owner_image.reference
            assert c["command"] == ["chown", "10001:10001", "/var/cache/dscache"]
        else:
            assert added == [] and sc["runAsNonRoot"] is True and sc.get("runAsUser") != 0
    for v in pod.get("volumes", []):
        assert "persistentVolumeClaim" not in v  # one claim for every pod is refused
        if "hostPath" in v:
            path = v["hostPath"]["path"]
            assert normalise_host_path(path) == path  # no .. left for the kubelet
            assert POLICY.host_path_allowed(path), path


def _check_refs(obj: dict[str, Any]) -> None:
    """Every object is in the resource's namespace; no reference names another one."""
    assert obj["metadata"]["namespace"] == OWNER.namespace
    text = repr(obj)
    assert "'namespace':" not in text.replace(f"'namespace': '{OWNER.namespace}'", "")


@pytest.mark.slow
@pytest.mark.slow  # 300 generated resources, each rendered whole: seconds
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=specs)
def test_generated_specs_never_escape_the_admins_policy(raw: dict[str, Any]) -> None:
    try:
        spec = parse_spec(raw)
        check_spec(spec, POLICY)
    except InvalidSpecError:
        return  # refused (NotAllowedError included) with a message: nothing rendered
    status = status_for(spec)
    objs = children(OWNER, spec, status, ("10.0.0.1:8000",), (), monitoring=True, policy=POLICY)
    canary = status.model_copy(update={"canary_slot": "green", "canary_revision": "r1"})
    job = prewarm_job(OWNER, spec, canary, ("10.0.0.2:8000",), sources=("10.0.0.1:8000",))
    for obj in [*objs, *([job] if job else [])]:
        _check_refs(obj)
        for pod in _pod_specs(obj):
            _check_pod(pod)
    # The analysis fetches only what the admin allows.
    fetched: list[str] = []

    class Recorder:
        def __init__(self, url: str, **_: Any) -> None:
            fetched.append(url)

        def scalar(self, promql: str) -> float | None:
            raise PrometheusError("not a real Prometheus")

    reconciler = Reconciler(
        Kube.__new__(Kube), OperatorSettings(prometheus_url=ADMIN_URL), OperatorMetrics()
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dscache_operator.reconcile.PrometheusClient", Recorder)
        reconciler._analyse(OWNER, spec, status, datetime.now(UTC))
    assert all(url.rstrip("/") == ADMIN_URL for url in fetched), fetched
