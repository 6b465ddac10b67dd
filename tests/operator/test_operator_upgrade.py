"""An operator upgrade restarts no pod of a resource that was already safe.

``data/safe_children_3c92707.json`` holds, for specs that pass today's admin
policy by default (examples, a hostPath cache under the default root, a Secret
salt with API keys, tolerations with keys, ...), the spec and status as the
API server stored them and every child the operator rendered before issue 30
(commit 3c92707). Today's operator, given the same stored spec and status,
must render each of its Deployments, Services and PDBs byte for byte: the same
pod templates, so no Deployment rolls. The router's ConfigMap is left out of
the file on purpose: its nginx.conf changed (API paths only,
connection bounds), which NGINX reloads without a restart. Objects that are
new (NetworkPolicies) are not compared here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dscache_operator.desired import children
from dscache_operator.policy import DEFAULT_POLICY, check_spec
from dscache_operator.spec import parse_spec
from dscache_operator.status import parse_status
from spec_helpers import OWNER

GOLDEN = json.loads((Path(__file__).parent / "data" / "safe_children_3c92707.json").read_text())
#: What an upgrade must not change: pod templates (a change rolls the pods), Services
#: and PDBs. Alert rules and scrape configs may improve between releases (no pod sees
#: them), and the router's config is reloaded in place (see the module docstring).
OLD_KINDS = {"Deployment", "Service", "PodDisruptionBudget"}


#: The template hash the operator writes on a Deployment and its pod template.
HASH = "dscache.io/template-hash"


def _without_deliberate_changes(new: dict[str, Any], old: dict[str, Any]) -> tuple[Any, Any]:
    """``new`` and ``old`` less the template changes made on purpose since 3c92707, each
    a fix worth the one restart it causes (and so the template hash it changes):

    * vLLM pods' memory-backed /dev/shm (vLLM's multiprocess executor wants more than a
      container's 64 MiB: without it a CPU or tensor-parallel vLLM pod cannot start);
    * the router pods' picker probes by port number (the named port was NGINX's, so the
      kubelet could not run the probe and a hung picker was never restarted): only the
      stateless router pods restart;
    * the reference server's torch threads from its CPU limit (``--threads``): torch's
      thread per node core ran out a limited container's CPU quota early in each period;
    * the sidecar's startup probe: on a busy node its liveness probe killed a sidecar
      still starting, and the restarted store refused writes for 90 s (a new
      revision's prewarm stored nothing: CI saw a warm canary rolled back at 0.000)."""
    if new["kind"] != "Deployment":
        return new, old
    new, old = json.loads(json.dumps(new)), json.loads(json.dumps(old))
    changed = False
    pod = new["spec"]["template"]["spec"]
    if any(v["name"] == "dshm" for v in pod.get("volumes", ())):
        pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "dshm"]
        for c in pod["containers"]:
            c["volumeMounts"] = [m for m in c.get("volumeMounts", ()) if m["name"] != "dshm"]
        changed = True
    for c in pod["containers"]:
        args = c.get("args", [])
        if c["name"] == "server" and "--threads" in args:
            at = args.index("--threads")
            c["args"] = args[:at] + args[at + 2 :]
            changed = True
    for obj in (new, old):
        for c in obj["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "picker":
                c.pop("startupProbe", None)
                c.pop("livenessProbe", None)
                changed = True
            if c["name"] == "sidecar":
                c.pop("startupProbe", None)
                changed = True
    if changed:
        for obj in (new, old):
            obj["metadata"]["labels"].pop(HASH, None)
            obj["spec"]["template"]["metadata"].get("annotations", {}).pop(HASH, None)
    return new, old


def _render(case: dict[str, Any]) -> list[dict[str, Any]]:
    spec = parse_spec(case["spec"])
    check_spec(spec, DEFAULT_POLICY)  # safe: allowed by the default policy
    status = parse_status(case["status"])
    objs = children(OWNER, spec, status, ("10.0.0.1:8000", "10.0.0.2:8000"), (), monitoring=True)
    return [o for o in objs if o["kind"] in OLD_KINDS]


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_safe_resources_render_the_same_children_as_before(name: str) -> None:
    case = GOLDEN["cases"][name]
    got = _render(case)
    want = [o for o in case["children"] if o["kind"] in OLD_KINDS]
    assert [(o["kind"], o["metadata"]["name"]) for o in got] == [
        (o["kind"], o["metadata"]["name"]) for o in want
    ]
    for rendered, stored in zip(got, want, strict=True):
        new, old = _without_deliberate_changes(rendered, stored)
        assert json.dumps(new, sort_keys=True) == json.dumps(old, sort_keys=True), (
            f"{new['kind']} {new['metadata']['name']} changed for {name}"
        )
