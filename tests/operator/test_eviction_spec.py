"""``spec.cache.eviction``: the sidecar's eviction policy, chosen per resource."""

from __future__ import annotations

from typing import Any

import pytest
from dscache_operator.desired import model_deployment
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import parse_spec
from dscache_sidecar.eviction import POLICIES
from spec_helpers import OWNER, status_for

BASE: dict[str, Any] = {
    "model": {"preset": "tiny-gqa", "revision": "1"},
    "prewarm": {"prompts": {"name": "chat-prompts"}},
}


def sidecar_args(cache: dict[str, Any]) -> list[str]:
    parsed = parse_spec({**BASE, "cache": cache})
    dep = model_deployment(OWNER, parsed, status_for(parsed), "blue")
    (side,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"]
    return list(side["args"])


def test_every_sidecar_policy_is_selectable_and_unset_changes_no_template() -> None:
    assert "--policy" not in sidecar_args({})  # the sidecar's default; templates as before
    for name in POLICIES:
        args = sidecar_args({"eviction": name})
        assert args[args.index("--policy") + 1] == name


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises((InvalidSpecError, ValueError)):
        parse_spec({**BASE, "cache": {"eviction": "mru"}})
