"""The admin's policy: what a resource may make the operator do (issue 30, finding 1).

Each refusal is what a namespace user who can create the resource gets instead
of a way around the admin: a node directory outside the allowed roots, a cache
bigger than the admin allows, a toleration of every taint, one claim shared by
every pod, the root init container or the shared tier's credential in an image
of the user's choosing.
"""

from __future__ import annotations

from typing import Any

import pytest
from dscache_operator.desired import Owner, model_deployment
from dscache_operator.policy import (
    DEFAULT_POLICY,
    AdminPolicy,
    NotAllowedError,
    check_spec,
    normalise_host_path,
)
from dscache_operator.revision import ImageSpec
from dscache_operator.schema import InvalidSpecError
from dscache_operator.settings import OperatorSettings
from dscache_operator.spec import parse_spec
from spec_helpers import OWNER, status_for, validated_deployment

BASE: dict[str, Any] = {"model": {"preset": "tiny-gqa"}}


def _spec(**fields: Any) -> Any:
    return parse_spec({**BASE, **fields})


def _host(path: str) -> Any:
    return _spec(cache={"volume": {"type": "hostPath", "hostPath": path}})


@pytest.mark.parametrize(
    "path",
    [
        "/etc",
        "/",
        "//etc",
        "/var/lib/dscache/../../etc",
        "/var/lib/dscache/./../dscache-other",
        "/var/lib/dscache2",
        "/var/lib",
        "/var/run/containerd",
    ],
)
def test_host_paths_outside_the_roots_are_refused_naming_the_roots(path: str) -> None:
    with pytest.raises(NotAllowedError) as err:
        check_spec(_host(path), DEFAULT_POLICY)
    assert "/var/lib/dscache" in str(err.value)
    assert "DSCACHE_OPERATOR_HOST_PATH_ROOTS" in str(err.value)
    assert err.value.reason == "NotAllowed"


@pytest.mark.parametrize("path", ["/var/lib/dscache", "/var/lib/dscache/", "/var/lib/dscache/a/b"])
def test_host_paths_below_a_root_are_allowed(path: str) -> None:
    check_spec(_host(path), DEFAULT_POLICY)


def test_roots_are_an_admin_setting_and_none_refuses_every_host_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DSCACHE_OPERATOR_HOST_PATH_ROOTS", "/mnt/nvme/, /srv/kv/../cache")
    policy = OperatorSettings().policy()
    assert policy.host_path_roots == ("/mnt/nvme", "/srv/cache")
    check_spec(_host("/mnt/nvme/dscache"), policy)
    check_spec(_host("/srv/cache"), policy)
    with pytest.raises(NotAllowedError, match="/mnt/nvme, /srv/cache"):
        check_spec(_host("/var/lib/dscache"), policy)
    with pytest.raises(NotAllowedError, match=r"\(none;"):
        check_spec(_host("/var/lib/dscache"), AdminPolicy(host_path_roots=()))
    assert normalise_host_path("//a//b/../c/") == "/a/c"


def test_cache_size_is_bounded_by_the_admin() -> None:
    check_spec(_spec(cache={"size": "1Ti"}), DEFAULT_POLICY)
    with pytest.raises(NotAllowedError, match="above the largest cache per pod"):
        check_spec(_spec(cache={"size": "1025Gi"}), DEFAULT_POLICY)
    with pytest.raises(NotAllowedError, match="DSCACHE_OPERATOR_MAX_CACHE_SIZE"):
        check_spec(_spec(cache={"size": "20Gi"}), AdminPolicy(max_cache_size="10Gi"))


def test_tolerations_only_as_the_admin_allows() -> None:
    every = {"tolerations": [{"operator": "Exists"}]}
    with pytest.raises(NotAllowedError, match="tolerate every taint"):
        check_spec(_spec(scheduling=every), DEFAULT_POLICY)
    check_spec(_spec(scheduling=every), AdminPolicy(allow_keyless_tolerations=True))
    gpu = {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}
    check_spec(_spec(scheduling=gpu), DEFAULT_POLICY)  # any named key by default
    narrow = AdminPolicy(toleration_keys=("nvidia.com/*",))
    check_spec(_spec(scheduling=gpu), narrow)
    cp = {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}
    with pytest.raises(NotAllowedError, match="DSCACHE_OPERATOR_TOLERATION_KEYS"):
        check_spec(_spec(scheduling=cp), narrow)


def test_one_claim_for_every_pod_is_refused_and_a_claim_template_gives_each_pod_its_own() -> None:
    with pytest.raises(InvalidSpecError, match=r"use cache\.volume\.claimTemplate"):
        _spec(cache={"volume": {"type": "persistentVolumeClaim", "claimName": "kv"}})
    with pytest.raises(InvalidSpecError, match="claimTemplate is required"):
        _spec(cache={"volume": {"type": "persistentVolumeClaim"}})
    spec = _spec(
        cache={
            "size": "20Gi",
            "volume": {
                "type": "persistentVolumeClaim",
                "claimTemplate": {"storageClassName": "ssd"},
            },
        }
    )
    dep = validated_deployment(spec)
    cache = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache")
    claim = cache["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": str(20 << 30)}},
        "storageClassName": "ssd",
    }
    assert "persistentVolumeClaim" not in cache  # no shared claim


def test_the_root_init_container_runs_the_admins_image_never_the_resources() -> None:
    spec = _spec(
        sidecar={"image": {"repository": "evil.example/tools", "tag": "latest"}},
        cache={"volume": {"type": "hostPath", "hostPath": "/var/lib/dscache"}},
    )
    admin = AdminPolicy(cache_owner_image=ImageSpec(repository="registry.local/core", tag="1"))
    dep = model_deployment(OWNER, spec, status_for(spec), "blue", admin)
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert init["image"] == "registry.local/core:1"
    assert init["command"] == ["chown", "10001:10001", "/var/cache/dscache"]
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["allowPrivilegeEscalation"] is False and "privileged" not in sc
    assert OperatorSettings(cache_owner_image="r.local/x@sha256:ab").policy().cache_owner_image == (
        ImageSpec(repository="r.local/x", tag="sha256:ab")
    )


def test_the_shared_tier_credential_goes_only_to_allowed_images_in_a_pod_of_its_own() -> None:
    shared = {"shared": {"enabled": True, "secretRef": {"name": "redis"}}}
    custom = {"image": {"repository": "evil.example/sidecar", "tag": "1"}}
    with pytest.raises(NotAllowedError, match="DSCACHE_OPERATOR_SHARED_TIER_IMAGES"):
        check_spec(_spec(cache=shared, sidecar=custom), DEFAULT_POLICY)
    ok = _spec(cache=shared)
    check_spec(ok, DEFAULT_POLICY)
    pod = validated_deployment(ok)["spec"]["template"]["spec"]
    # No shared PID namespace: the server cannot read the sidecar's /proc/<pid>/environ.
    assert "shareProcessNamespace" not in pod
    assert validated_deployment(_spec())["spec"]["template"]["spec"]["shareProcessNamespace"]


def test_a_new_resource_gets_a_generated_salt_and_stored_ones_keep_theirs() -> None:
    owner = Owner("chat", "prod", "u")
    spec = _spec()
    assert spec.tenant_salt.source == "generated"
    env = model_deployment(owner, spec, status_for(spec), "blue")["spec"]["template"]["spec"][
        "containers"
    ][0]["env"]
    ref = {"name": "chat-tenant-salt", "key": "salt"}
    assert {"name": "DSCACHE_SERVER_TENANT_SECRET", "valueFrom": {"secretKeyRef": ref}} in env
    old = _spec(tenantSalt={"source": "namespace"})
    env = validated_deployment(old)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[0]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
