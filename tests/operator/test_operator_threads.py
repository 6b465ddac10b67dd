"""The reference server's torch threads follow its container's CPU limit.

What a user would notice: a pod with a CPU limit runs torch with that many whole cores of
intra-op threads (``--threads``, a flag the server accepts), not one per core of the node,
which would run out its CPU quota early in every period; a pod without a limit keeps
torch's default and the template it had; vLLM pods are left to vLLM.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from dscache_operator.desired.model import torch_threads
from dscache_operator.revision import ResourcesSpec
from dscache_operator.spec import parse_spec
from dscache_server.config import add_server_arguments
from spec_helpers import validated_deployment

BASE: dict[str, Any] = {"model": {"preset": "tiny-gqa"}}


def _server_args(raw: dict[str, Any]) -> list[str]:
    server = validated_deployment(parse_spec(raw))["spec"]["template"]["spec"]["containers"][0]
    assert server["name"] == "server"
    return list(server["args"])


def _with(resources: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, "server": {"resources": resources}}


@pytest.mark.parametrize(
    ("resources", "threads"),
    [
        ({"limits": {"cpu": "100m"}}, 1),
        ({"requests": {"cpu": "500m"}, "limits": {"cpu": "1500m"}}, 2),
        ({"limits": {"cpu": 4}}, 4),
        ({"requests": {"cpu": "4"}}, None),  # a share under contention, not a cap
        ({"limits": {"memory": "1Gi"}}, None),
        ({}, None),
    ],
)
def test_threads_are_the_cpu_limit_in_whole_cores(
    resources: dict[str, Any], threads: int | None
) -> None:
    assert torch_threads(ResourcesSpec.model_validate(resources)) == threads


def test_a_cpu_limit_reaches_the_server_as_its_threads_flag() -> None:
    args = _server_args(_with({"requests": {"cpu": "1"}, "limits": {"cpu": "1500m"}}))
    assert args[args.index("--threads") + 1] == "2"
    # The flag is the server's own: its parser reads the operator's args as written.
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert parser.parse_args(args[1:]).threads == 2


def test_without_a_cpu_limit_torch_keeps_its_default() -> None:
    assert "--threads" not in _server_args(BASE)
    assert "--threads" not in _server_args(_with({"requests": {"cpu": "100m"}}))
    assert "--threads" not in _server_args(_with({"limits": {"memory": "3Gi"}}))


def test_vllm_pods_are_left_to_vllm() -> None:
    raw = {"model": {"path": "/models/ds"}, "engine": "vllm"}
    raw["server"] = {"resources": {"limits": {"cpu": "2"}}}
    assert "--threads" not in _server_args(raw)
