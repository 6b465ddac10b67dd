"""``spec.server.dtype``: the reference server's weights, activations and cached KV.

What a user would notice: without the field (or with float32) the pods, their
template hash and the revision are what they were, so an operator upgrade starts
no rollout; bfloat16 or float16 reaches the server as ``--dtype`` (a flag the
server accepts) and is a new revision, rolled out like a model change (the cache
keys differ anyway); with engine vllm the field is refused, by the operator and
by the CRD schema, with a message pointing at ``spec.vllm.args``.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from dscache_operator.crd import build_crd
from dscache_operator.desired import TEMPLATE_HASH
from dscache_operator.revision import revision_of
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import parse_spec
from dscache_server.config import add_server_arguments
from spec_helpers import released_revision, status_for, validated_deployment

#: A minimal resource as the API server stored it until now: the CRD's defaults are
#: persisted on create, the old ``cache.minTokens`` default (512) among them, so the
#: new default (0, cost-based admission) changes no stored resource's revision.
MINIMAL: dict[str, Any] = {
    "model": {"preset": "tiny-gqa"},
    "cache": {"minTokens": 512},
    "tenantSalt": {"source": "namespace"},  # the old default, persisted likewise
}
#: The revision every operator so far computed for MINIMAL (as in the shared-tier tests).
REVISION_OF_MINIMAL = "3da970e14f"
VLLM: dict[str, Any] = {"model": {"path": "/models/ds"}, "engine": "vllm"}


def _with_dtype(raw: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {**raw, "server": {**raw.get("server", {}), "dtype": dtype}}


def _server_args(dep: dict[str, Any]) -> list[str]:
    server = dep["spec"]["template"]["spec"]["containers"][0]
    assert server["name"] == "server"
    return list(server["args"])


def _revision(raw: dict[str, Any]) -> str:
    return revision_of(parse_spec(raw).revision_source())


def test_without_a_dtype_the_pods_and_the_revision_are_what_they_were() -> None:
    plain = parse_spec(MINIMAL)
    dep = validated_deployment(plain)
    assert "--dtype" not in _server_args(dep)
    # float32 said out loud is the same resource as before the field existed.
    explicit = parse_spec(_with_dtype(MINIMAL, "float32"))
    assert _revision(_with_dtype(MINIMAL, "float32")) == _revision(MINIMAL) == REVISION_OF_MINIMAL
    explicit_dep = validated_deployment(explicit)
    assert explicit_dep["spec"]["template"] == dep["spec"]["template"]
    assert (
        explicit_dep["metadata"]["labels"][TEMPLATE_HASH]
        == (dep["metadata"]["labels"][TEMPLATE_HASH])
    )
    # A track stored by the previous operator has no server.dtype in its source.
    status = status_for(plain)
    legacy = status.model_copy(deep=True)
    del legacy.slots["blue"].source["server"]["dtype"]
    assert validated_deployment(plain, legacy) == dep
    # ... and the revision that operator computed: the hash of the source without the
    # fields added since release, at their defaults.
    assert revision_of(plain.revision_source()) == released_revision(plain.revision_source())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_reaches_the_server_and_is_a_new_revision(dtype: str) -> None:
    args = _server_args(validated_deployment(parse_spec(_with_dtype(MINIMAL, dtype))))
    assert args[args.index("--dtype") + 1] == dtype
    # The flag is the server's own: its parser reads the operator's args as written.
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert args[0] == "server"
    assert parser.parse_args(args[1:]).dtype == dtype
    assert _revision(_with_dtype(MINIMAL, dtype)) != _revision(MINIMAL)


def test_each_dtype_is_its_own_revision() -> None:
    revisions = {_revision(_with_dtype(MINIMAL, d)) for d in ("float32", "bfloat16", "float16")}
    assert len(revisions) == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_vllm_refuses_the_reference_servers_dtype(dtype: str) -> None:
    with pytest.raises(InvalidSpecError, match=r"spec\.vllm\.args") as info:
        parse_spec(_with_dtype(VLLM, dtype))
    assert "spec.server.dtype" in str(info.value) and dtype in str(info.value)
    # float32 (the default) is no dtype of vLLM's: the pods stay as they were.
    vllm = parse_spec(_with_dtype(VLLM, "float32"))
    assert _revision(_with_dtype(VLLM, "float32")) == _revision(VLLM)
    assert "--dtype" not in _server_args(validated_deployment(vllm))
    # vLLM's own flag is the way, and still reaches vllm serve.
    own = parse_spec({**VLLM, "vllm": {"args": ["--dtype", dtype]}})
    args = _server_args(validated_deployment(own))
    assert args[-2:] == ["--dtype", dtype]


def test_the_crd_lists_the_dtypes_and_refuses_them_with_vllm() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_schema = schema["properties"]["spec"]
    dtype = spec_schema["properties"]["server"]["properties"]["dtype"]
    assert dtype["enum"] == ["float32", "bfloat16", "float16"]
    assert dtype["default"] == "float32"
    assert "engine vllm" in dtype["description"]
    (rule,) = [v for v in spec_schema["x-kubernetes-validations"] if "server.dtype" in v["rule"]]
    assert rule["rule"].startswith("self.engine != 'vllm' ||")
    assert "spec.vllm.args" in rule["message"]
