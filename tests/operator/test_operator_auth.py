"""``spec.auth.apiKeysSecretRef``: the API-key Secret reaches the model server as a file.

What a user would notice: the server gets the key file and its variable, the file
follows a rotated Secret (a volume, never a subPath), a change of the reference is
a new revision and a rotation of the Secret's content is not, an operator upgrade
starts no rollout, and the prewarm Job carries a key when tenancy is on.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from dscache_operator.desired import prewarm_job
from dscache_operator.desired.prewarm import PREWARM_API_KEY_ENV
from dscache_operator.revision import RevisionSource, revision_of
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import DeepSeekCacheDeploymentSpec, parse_spec
from spec_helpers import (
    OWNER,
    released_revision,
    released_source,
    status_for,
    validated_deployment,
)

MINIMAL: dict[str, Any] = {"model": {"preset": "tiny-gqa"}}
AUTH = {"apiKeysSecretRef": {"name": "chat-api-keys", "key": "keys.json"}}


def _pod(spec: DeepSeekCacheDeploymentSpec) -> dict[str, Any]:
    pod: dict[str, Any] = validated_deployment(spec)["spec"]["template"]["spec"]
    return pod


def test_the_key_secret_is_mounted_into_the_server_only_and_follows_rotation() -> None:
    pod = _pod(parse_spec({**MINIMAL, "auth": AUTH}))
    server, sidecar = pod["containers"]
    env = {e["name"]: e for e in server["env"]}
    path = env["DSCACHE_SERVER_API_KEYS_FILE"]["value"]
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == "api-keys"]
    assert mount["readOnly"] is True
    # A subPath mount never sees the kubelet's update of a rotated Secret.
    assert "subPath" not in mount
    assert path.startswith(mount["mountPath"] + "/")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
    secret = volume["secret"]
    assert secret["secretName"] == "chat-api-keys"
    assert secret["items"] == [{"key": "keys.json", "path": path.rsplit("/", 1)[1]}]
    assert secret["defaultMode"] == 0o440  # the pods' group (fsGroup), nobody else
    assert "api-keys" not in {m["name"] for m in sidecar["volumeMounts"]}
    assert "DSCACHE_SERVER_API_KEYS_FILE" not in {e["name"] for e in sidecar.get("env", [])}


def test_without_auth_the_pod_has_no_key_file() -> None:
    pod = _pod(parse_spec(MINIMAL))
    server = pod["containers"][0]
    assert "api-keys" not in {v["name"] for v in pod["volumes"]}
    assert "DSCACHE_SERVER_API_KEYS_FILE" not in {e["name"] for e in server["env"]}


def test_a_new_secret_ref_is_a_new_revision_an_upgrade_is_not() -> None:
    plain = parse_spec(MINIMAL).revision_source()
    with_auth = parse_spec({**MINIMAL, "auth": AUTH}).revision_source()
    other_key = parse_spec(
        {**MINIMAL, "auth": {"apiKeysSecretRef": {"name": "chat-api-keys", "key": "v2.json"}}}
    ).revision_source()
    assert len({revision_of(plain), revision_of(with_auth), revision_of(other_key)}) == 3
    # The revision the operator computed before auth (and the other later fields) existed.
    assert revision_of(plain) == released_revision(plain)
    # A source stored by that operator parses; its auth is the default (none).
    assert RevisionSource.model_validate(released_source(plain)).auth == plain.auth


def test_tenancy_with_prewarm_prompts_needs_a_prewarm_key() -> None:
    prompts = {"prompts": {"name": "chat-prompts"}}
    with pytest.raises(InvalidSpecError, match=r"spec\.prewarm\.apiKeySecretRef is required"):
        parse_spec({**MINIMAL, "auth": AUTH, "prewarm": prompts})
    key = {"apiKeySecretRef": {"name": "chat-prewarm", "key": "api-key"}}
    spec = parse_spec({**MINIMAL, "auth": AUTH, "prewarm": {**prompts, **key}})
    status = status_for(spec)
    status.canary_slot, status.canary_revision = "green", "abc"
    job = prewarm_job(OWNER, spec, status, ("10.0.1.1:8000",))
    assert job is not None
    kubernetes_validate.validate(job, "1.35.0", strict=True)
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[PREWARM_API_KEY_ENV]["valueFrom"] == {
        "secretKeyRef": {"name": "chat-prewarm", "key": "api-key"}
    }
