"""``spec.cache.codec: int8``: lossy int8 KV on the reference server.

What a user would notice: int8 reaches the server as ``--store-compress int8`` (a
value its parser accepts) and is a new revision (its cache keys differ from the
exact ones anyway); with engine vllm it is refused, by the operator and by the CRD
schema, with a message saying what to use instead.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from dscache_operator.crd import build_crd
from dscache_operator.revision import revision_of
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import parse_spec
from dscache_server.config import add_server_arguments
from spec_helpers import validated_deployment

MINIMAL: dict[str, Any] = {"model": {"preset": "tiny-gqa"}}
VLLM: dict[str, Any] = {"model": {"path": "/models/ds"}, "engine": "vllm"}


def _with_codec(raw: dict[str, Any], codec: str) -> dict[str, Any]:
    return {**raw, "cache": {**raw.get("cache", {}), "codec": codec}}


def test_int8_reaches_the_server_and_is_a_new_revision() -> None:
    dep = validated_deployment(parse_spec(_with_codec(MINIMAL, "int8")))
    server = dep["spec"]["template"]["spec"]["containers"][0]
    args = list(server["args"])
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert parser.parse_args(args[1:]).store_compress == "int8"
    revisions = {
        revision_of(parse_spec(_with_codec(MINIMAL, c)).revision_source())
        for c in ("raw", "int8", "auto")
    }
    assert len(revisions) == 3


def test_engine_vllm_refuses_int8() -> None:
    with pytest.raises(InvalidSpecError, match="codec int8"):
        parse_spec(_with_codec(VLLM, "int8"))
    parse_spec(_with_codec(VLLM, "raw"))  # the exact codec stays fine
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    codec = schema["properties"]["cache"]["properties"]["codec"]
    assert codec["enum"] == ["auto", "raw", "zstd", "int8"] and codec["default"] == "raw"
    (rule,) = [v for v in schema["x-kubernetes-validations"] if "cache.codec" in v["rule"]]
    assert "codec int8" in rule["message"]
