"""``dscache demo kubernetes``: what it applies, for each engine, without a cluster.

The resource of each engine's example is a valid spec the operator accepts; the
bad revision is a new revision whose cache cannot hit, and its restore patch
returns the resource to the stable revision exactly (the same revision hash, so
the operator starts no second rollout). The runs themselves are in tests/e2e.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from dscache_operator.revision import revision_of
from dscache_operator.spec import parse_spec
from dscache_tools.demo.kube.cluster import bad_revision_patches, resource
from dscache_tools.demo.kube.options import (
    NO_CACHE_BLOCK_TOKENS,
    NO_CACHE_MIN_TOKENS,
    NO_PREFIX_CACHING,
    Engine,
    KubeDemoOptions,
)


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch (what ``kubectl patch --type merge`` applies)."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``replace`` and ``remove`` (the restore's operations)."""
    out = copy.deepcopy(target)
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node = out
        for part in parents:
            node = node[part]
        if op["op"] == "remove":
            del node[last]
        else:
            assert op["op"] == "replace" and last in node, op
            node[last] = copy.deepcopy(op["value"])
    return out


def _revision(spec: dict[str, Any]) -> str:
    return revision_of(parse_spec(spec).revision_source())


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_the_bad_revision_is_a_new_revision_and_its_restore_the_old_one(engine: Engine) -> None:
    spec = resource(KubeDemoOptions(engine=engine), "1")["spec"]
    patch, restore = bad_revision_patches(spec)
    bad = _merge({"spec": spec}, patch)["spec"]
    assert _revision(bad) != _revision(spec)
    back = _json_patch({"spec": bad}, restore)["spec"]
    assert back == spec and _revision(back) == _revision(spec)


def test_the_reference_bad_revision_admits_nothing() -> None:
    spec = resource(KubeDemoOptions(), "1")["spec"]
    bad = parse_spec(_merge({"spec": spec}, bad_revision_patches(spec)[0])["spec"])
    assert bad.engine == "reference" and bad.cache.min_tokens == NO_CACHE_MIN_TOKENS


def test_the_vllm_demo_runs_vllm_pods_and_its_bad_revision_reuses_nothing() -> None:
    spec = resource(KubeDemoOptions(engine="vllm", interval_s=20), "7")["spec"]
    parsed = parse_spec(spec)
    assert parsed.engine == "vllm" and parsed.replicas == 1
    assert parsed.model.path == "/models/dscache-tiny" and parsed.model.revision == "7"
    assert parsed.vllm.image.repository == "ghcr.io/dscache/dscache-vllm"
    assert parsed.rollout.interval == "20s"
    # Client figures need cached tokens in each answer's usage.
    assert "--enable-prompt-tokens-details" in parsed.vllm.args
    bad = parse_spec(_merge({"spec": spec}, bad_revision_patches(spec)[0])["spec"])
    # No whole block in any prompt (2-3.4k tokens here), no prefix cache in vLLM.
    assert bad.cache.block_tokens == NO_CACHE_BLOCK_TOKENS
    assert bad.vllm.args == [*parsed.vllm.args, NO_PREFIX_CACHING]
