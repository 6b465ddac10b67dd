"""``spec.cache.shared``: a Redis Cluster shared by the sidecars, wired from a Secret.

What a user would notice: with the tier enabled each sidecar gets the
``DSCACHE_SIDECAR_SHARED_*`` variables the sidecar reads (addresses and
credentials straight from the Secret, never through the operator; the TLS CA as
a file), the model server gets none of it; without it (absent, or disabled with
any settings) the pods, their template hash and the revision are what they
were, so an operator upgrade restarts nothing; and a spec that cannot work is
refused with a message naming the field, by the operator and by the CRD schema.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from dscache_operator.crd import build_crd
from dscache_operator.desired import TEMPLATE_HASH
from dscache_operator.revision import revision_of
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import parse_spec
from dscache_sidecar.config import add_sidecar_arguments, settings_from_args
from spec_helpers import released_revision, status_for, validated_deployment

#: A minimal resource as the API server stored it until now: the CRD's defaults are
#: persisted on create, the old ``cache.minTokens`` default (512) among them, so the
#: new default (0, cost-based admission) changes no stored resource's revision.
MINIMAL: dict[str, Any] = {
    "model": {"preset": "tiny-gqa"},
    "cache": {"minTokens": 512},
    "tenantSalt": {"source": "namespace"},  # the old default, persisted likewise
}
#: The revision every operator so far computed for MINIMAL: a change is a rollout of
#: every such resource on upgrade.
REVISION_OF_MINIMAL = "3da970e14f"
SHARED: dict[str, Any] = {
    "enabled": True,
    "secretRef": {"name": "redis-shared"},
    "usernameKey": "username",
    "passwordKey": "password",
    "tls": {"enabled": True, "caSecretRef": {"name": "redis-ca", "key": "ca.pem"}},
    "timeoutMs": 100,
    "fetchBudgetMs": 1500,
    "writePolicy": "all",
    "ttl": "1h30m",
    "queueBlocks": 64,
}
#: What the Secrets hold, for resolving the pod's secretKeyRefs as the kubelet would.
SECRETS = {
    "redis-shared": {
        "endpoints": "10.246.0.1:7000,10.246.0.1:7001",
        "username": "dscache",
        "password": "s3cret",
        # The namespace's own prefix and HMAC key, as the chart's per-namespace Secret has.
        "keyPrefix": "dscache-team-a",
        "signingKey": "k" * 64,
    }
}


def _with_shared(shared: dict[str, Any]) -> dict[str, Any]:
    return {**MINIMAL, "cache": {**MINIMAL["cache"], "shared": shared}}


def _containers(dep: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    server, sidecar = dep["spec"]["template"]["spec"]["containers"]
    assert (server["name"], sidecar["name"]) == ("server", "sidecar")
    return server, sidecar


def test_the_sidecar_gets_the_tier_from_the_secret_and_the_ca_as_a_file() -> None:
    dep = validated_deployment(parse_spec(_with_shared(SHARED)))
    pod = dep["spec"]["template"]["spec"]
    server, sidecar = _containers(dep)
    ref = {"name": "redis-shared"}
    assert sidecar["env"] == [
        {
            "name": "DSCACHE_SIDECAR_SHARED_NODES",
            "valueFrom": {"secretKeyRef": {**ref, "key": "endpoints"}},
        },
        {
            "name": "DSCACHE_SIDECAR_SHARED_USERNAME",
            "valueFrom": {"secretKeyRef": {**ref, "key": "username"}},
        },
        {
            "name": "DSCACHE_SIDECAR_SHARED_PASSWORD",
            "valueFrom": {"secretKeyRef": {**ref, "key": "password"}},
        },
        {
            "name": "DSCACHE_SIDECAR_SHARED_KEY_PREFIX",
            "valueFrom": {"secretKeyRef": {**ref, "key": "keyPrefix", "optional": True}},
        },
        {
            "name": "DSCACHE_SIDECAR_SHARED_SIGNING_KEY",
            "valueFrom": {"secretKeyRef": {**ref, "key": "signingKey", "optional": True}},
        },
        {
            "name": "DSCACHE_SIDECAR_SHARED_SIGNING_KEY_PREVIOUS",
            "valueFrom": {"secretKeyRef": {**ref, "key": "signingKeyPrevious", "optional": True}},
        },
        {"name": "DSCACHE_SIDECAR_SHARED_TLS", "value": "true"},
        {"name": "DSCACHE_SIDECAR_SHARED_TLS_VERIFY_HOSTNAME", "value": "true"},
        {"name": "DSCACHE_SIDECAR_SHARED_TIMEOUT_S", "value": "0.1"},
        {"name": "DSCACHE_SIDECAR_SHARED_FETCH_BUDGET_S", "value": "1.5"},
        {"name": "DSCACHE_SIDECAR_SHARED_WRITE_POLICY", "value": "all"},
        {"name": "DSCACHE_SIDECAR_SHARED_TTL_S", "value": "5400"},
        {"name": "DSCACHE_SIDECAR_SHARED_QUEUE_BLOCKS", "value": "64"},
        {"name": "DSCACHE_SIDECAR_SHARED_TLS_CA_FILE", "value": "/etc/dscache/shared-tier/ca.crt"},
    ]
    (mount,) = [m for m in sidecar["volumeMounts"] if m["name"] == "shared-tier-ca"]
    assert mount == {
        "name": "shared-tier-ca",
        "mountPath": "/etc/dscache/shared-tier",
        "readOnly": True,
    }  # a volume, not a subPath: a renewed CA reaches the running sidecar
    (volume,) = [v for v in pod["volumes"] if v["name"] == "shared-tier-ca"]
    assert volume["secret"] == {
        "secretName": "redis-ca",
        "items": [{"key": "ca.pem", "path": "ca.crt"}],
        "defaultMode": 0o440,
    }
    # The model server sees none of it.
    assert not [e for e in server["env"] if e["name"].startswith("DSCACHE_SIDECAR_")]
    assert "shared-tier-ca" not in {m["name"] for m in server["volumeMounts"]}


def test_the_sidecar_reads_what_the_operator_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract end to end: the container's args and env, resolved as the kubelet
    does, parsed by the sidecar's own settings into the values the spec asked for."""
    _, sidecar = _containers(validated_deployment(parse_spec(_with_shared(SHARED))))
    for var in sidecar["env"]:
        if "valueFrom" in var:
            ref = var["valueFrom"]["secretKeyRef"]
            value = SECRETS[ref["name"]].get(ref["key"])
            if value is None:
                assert ref.get("optional") is True, ref  # the kubelet leaves it unset
                continue
            monkeypatch.setenv(var["name"], value)
        else:
            monkeypatch.setenv(var["name"], var["value"])
    parser = argparse.ArgumentParser()
    add_sidecar_arguments(parser)
    assert sidecar["args"][0] == "sidecar"
    args = parser.parse_args(sidecar["args"][1:])
    args.data_dir = str(tmp_path)  # the pod's cache volume
    settings = settings_from_args(args)
    assert settings.shared_node_list == ["10.246.0.1:7000", "10.246.0.1:7001"]
    assert settings.shared_username == "dscache"
    assert settings.shared_password.get_secret_value() == "s3cret"
    assert settings.shared_tls is True and settings.shared_tls_verify_hostname is True
    assert settings.shared_tls_ca_file == Path("/etc/dscache/shared-tier/ca.crt")
    assert (settings.shared_timeout_s, settings.shared_fetch_budget_s) == (0.1, 1.5)
    assert settings.shared_write_policy == "all"
    assert (settings.shared_ttl_s, settings.shared_queue_blocks) == (5400, 64)
    assert settings.shared_key_prefix == "dscache-team-a"
    assert settings.shared_signing_key.get_secret_value() == "k" * 64
    assert settings.shared_signing_key_previous.get_secret_value() == ""


def test_optional_credentials_and_tls_are_left_out() -> None:
    minimal_tier = {"enabled": True, "secretRef": {"name": "redis-shared"}}
    _, sidecar = _containers(validated_deployment(parse_spec(_with_shared(minimal_tier))))
    env = {e["name"].removeprefix("DSCACHE_SIDECAR_SHARED_"): e for e in sidecar["env"]}
    assert env["NODES"]["valueFrom"]["secretKeyRef"] == {"name": "redis-shared", "key": "endpoints"}
    assert {"USERNAME", "PASSWORD", "TLS_CA_FILE"}.isdisjoint(env)
    # The spec's defaults are the sidecar's defaults.
    assert {k: v["value"] for k, v in env.items() if "value" in v} == {
        "TLS": "false",
        "TLS_VERIFY_HOSTNAME": "true",
        "TIMEOUT_S": "0.25",
        "FETCH_BUDGET_S": "1",
        "WRITE_POLICY": "reused",
        "TTL_S": "86400",
        "QUEUE_BLOCKS": "1024",
    }
    assert "shared-tier-ca" not in {m["name"] for m in sidecar["volumeMounts"]}
    # TLS with the system's CAs: no file, no volume.
    tls = _with_shared({**minimal_tier, "tls": {"enabled": True, "verifyHostname": False}})
    dep = validated_deployment(parse_spec(tls))
    _, sidecar = _containers(dep)
    env = {e["name"].removeprefix("DSCACHE_SIDECAR_SHARED_"): e for e in sidecar["env"]}
    assert (env["TLS"]["value"], env["TLS_VERIFY_HOSTNAME"]["value"]) == ("true", "false")
    assert "TLS_CA_FILE" not in env
    assert "shared-tier-ca" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}


def test_without_the_tier_pods_template_hash_and_revision_are_unchanged() -> None:
    """An absent cache.shared, one stored by an operator from before it, and a disabled
    one with settings render the same pods and the same revision as before the field."""
    spec = parse_spec(MINIMAL)
    status = status_for(spec)
    dep = validated_deployment(spec, status)
    _, sidecar = _containers(dep)
    assert "env" not in sidecar
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"cache", "socket", "tmp"}
    assert {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]} == {
        "cache",
        "socket",
        "tmp",
    }
    # A track stored by the previous operator: no cache.shared in its source.
    legacy = status.model_copy(deep=True)
    del legacy.slots["blue"].source["cache"]["shared"]
    assert validated_deployment(spec, legacy) == dep
    # ... and the revision that operator computed for the same spec (the hash of its
    # source without the fields added since, at their defaults).
    old_digest = released_revision(spec.revision_source())
    assert revision_of(spec.revision_source()) == old_digest == REVISION_OF_MINIMAL
    # Disabled, whatever else it says: nothing in the pods, no rollout.
    off = parse_spec(_with_shared({**SHARED, "enabled": False, "tls": {"enabled": True}}))
    assert revision_of(off.revision_source()) == old_digest
    off_dep = validated_deployment(off)
    assert off_dep["spec"]["template"] == dep["spec"]["template"]
    assert off_dep["metadata"]["labels"][TEMPLATE_HASH] == dep["metadata"]["labels"][TEMPLATE_HASH]


def test_enabling_or_changing_the_tier_is_a_new_revision() -> None:
    plain = revision_of(parse_spec(MINIMAL).revision_source())
    on = revision_of(parse_spec(_with_shared(SHARED)).revision_source())
    reused = revision_of(
        parse_spec(_with_shared({**SHARED, "writePolicy": "reused"})).revision_source()
    )
    other_secret = revision_of(
        parse_spec(_with_shared({**SHARED, "secretRef": {"name": "redis-b"}})).revision_source()
    )
    assert len({plain, on, reused, other_secret}) == 4


@pytest.mark.parametrize(
    ("shared", "message"),
    [
        (
            {"enabled": True},
            r"spec\.cache\.shared\.secretRef is required when spec\.cache\.shared\.enabled",
        ),
        ({**SHARED, "writePolicy": "sometimes"}, r"spec\.cache\.shared\.writePolicy: .*'reused'"),
        (
            {**SHARED, "tls": {"enabled": False, "caSecretRef": {"name": "c", "key": "ca.crt"}}},
            "enable TLS or remove the CA",
        ),
        ({**SHARED, "ttl": "1500ms"}, r"spec\.cache\.shared\.ttl must be whole seconds"),
        ({**SHARED, "ttl": "0s"}, "at least 1s"),
        ({**SHARED, "ttl": "1 day"}, r"spec\.cache\.shared\.ttl"),
        ({**SHARED, "timeoutMs": 0}, r"spec\.cache\.shared\.timeoutMs"),
        ({**SHARED, "fetchBudgetMs": 600000}, r"spec\.cache\.shared\.fetchBudgetMs"),
        ({**SHARED, "endpointsKey": "redis nodes"}, r"spec\.cache\.shared\.endpointsKey"),
        ({**SHARED, "secretRef": {"name": "Redis"}}, r"spec\.cache\.shared\.secretRef\.name"),
        ({**SHARED, "endpoints": "a:1"}, r"spec\.cache\.shared\.endpoints"),
    ],
)
def test_invalid_tiers_say_what_to_change(shared: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec(_with_shared(shared))


def _spec_schema() -> dict[str, Any]:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema: dict[str, Any] = root["properties"]["spec"]
    return schema


def _shared_schema() -> dict[str, Any]:
    schema: dict[str, Any] = _spec_schema()["properties"]["cache"]["properties"]["shared"]
    return schema


def test_the_crd_carries_the_rules_and_the_defaults() -> None:
    shared = _shared_schema()
    assert shared["x-kubernetes-validations"] == [
        {
            "rule": "!self.enabled || has(self.secretRef)",
            "message": "cache.shared.secretRef is required when cache.shared.enabled is true: "
            "name a Secret whose endpoints key holds the Redis Cluster's host:port list",
        }
    ]
    tls = shared["properties"]["tls"]
    assert tls["x-kubernetes-validations"][0]["rule"] == "self.enabled || !has(self.caSecretRef)"
    # The API server's default is the model's, and disabled.
    assert shared["default"] == {
        "enabled": False,
        "endpointsKey": "endpoints",
        "keyPrefixKey": "keyPrefix",
        "signingKeyKey": "signingKey",
        "signingKeyPreviousKey": "signingKeyPrevious",
        "tls": {"enabled": False, "verifyHostname": True},
        "timeoutMs": 250,
        "fetchBudgetMs": 1000,
        "writePolicy": "reused",
        "ttl": "24h",
        "queueBlocks": 1024,
    }
    assert shared["properties"]["writePolicy"]["enum"] == ["reused", "all"]


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"writePolicy": "sometimes"}, ["cache", "shared", "writePolicy"]),
        ({"timeoutMs": 0}, ["cache", "shared", "timeoutMs"]),
        ({"ttl": "1 day"}, ["cache", "shared", "ttl"]),
        ({"secretRef": {}}, ["cache", "shared", "secretRef"]),
        ({"endpointsKey": "a/b"}, ["cache", "shared", "endpointsKey"]),
    ],
)
def test_the_crd_schema_refuses_what_the_models_refuse(
    change: dict[str, Any], path: list[str]
) -> None:
    schema = _spec_schema()
    validator = jsonschema.Draft7Validator(schema)
    good = _with_shared(SHARED)
    assert list(validator.iter_errors(good)) == []
    bad = copy.deepcopy(good)
    bad["cache"]["shared"].update(change)
    errors = list(validator.iter_errors(bad))
    assert errors and all(list(e.absolute_path)[: len(path)] == path for e in errors)
    with pytest.raises(InvalidSpecError):
        parse_spec(bad)
