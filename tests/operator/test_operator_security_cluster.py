"""Issue 30 on the dev cluster: what a namespace user cannot make the operator do.

* a hostPath cache outside the admin's roots is refused (``Ready=False,
  NotAllowed`` naming the roots) and no pod is rendered;
* an existing Service ``web`` is not taken over by a resource named ``web``
  (``OwnershipConflict`` and a ``ChildConflict`` event), and deleting the
  resource leaves it;
* a new resource gets its own random tenant salt in a Secret it owns;
* the rendered NetworkPolicies are enforced on the real node (kube-router's
  firewall, started by the dev cluster): a model pod answers its router's pods,
  not a stranger's.

The model and router pods of the first three go to simulated nodes (no process
runs); the last runs real pods of the core image on the real node.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import yaml
from dscache_operator.desired import Owner, network_policies, selector_labels
from dscache_operator.policy import AdminPolicy
from dscache_operator.spec import parse_spec
from dscache_operator.status import DeepSeekCacheDeploymentStatus
from dscache_tools.devcluster import DevCluster, wait_until
from dscache_tools.devcluster.images.specs import IMAGES
from needs import need_binary
from operator_harness import Rig, apply, condition, spec_doc

pytestmark = pytest.mark.cluster


def _ready(st: dict[str, Any]) -> dict[str, Any]:
    return condition(st, "Ready")


def test_a_host_path_outside_the_roots_is_refused_naming_them(rig: Rig) -> None:
    doc = spec_doc("etc", rig.prom)
    doc["spec"]["cache"] = {
        "volume": {"type": "hostPath", "hostPath": "/var/lib/dscache/../../../etc"}
    }
    apply(rig.c, rig.ns, [doc])
    st = rig.wait("etc", "refused", lambda s: _ready(s).get("reason") == "NotAllowed")
    assert "/var/lib/dscache" in _ready(st)["message"] and "'/etc'" in _ready(st)["message"]
    assert st["phase"] == "Failed"
    deployments = rig.c.kubectl_json("get", "deployments", "-n", rig.ns)["items"]
    assert deployments == []  # nothing mounts /etc
    rig.events("etc", lambda r: "NotAllowed" in r)


def test_an_existing_service_is_not_adopted_nor_deleted(rig: Rig) -> None:
    c, ns = rig.c, rig.ns
    c.kubectl("create", "service", "clusterip", "web", "--tcp=80:8080", "-n", ns)
    before = c.kubectl_json("get", "service", "web", "-n", ns)
    apply(c, ns, [spec_doc("web", rig.prom)])
    st = rig.wait(
        "web", "the conflict", lambda s: condition(s, "OwnershipConflict").get("status") == "True"
    )
    message = condition(st, "OwnershipConflict")["message"]
    assert "Service web" in message and "left alone" in message
    rig.events("web", lambda r: "ChildConflict" in r)
    after = c.kubectl_json("get", "service", "web", "-n", ns)
    assert not after["metadata"].get("ownerReferences")
    assert after["spec"]["selector"] == before["spec"]["selector"]
    assert after["spec"]["ports"] == before["spec"]["ports"]
    # Everything else of the resource is there, and ours.
    router = rig.deployment("web-router")
    uid = c.kubectl_json("get", "dscd", "web", "-n", ns)["metadata"]["uid"]
    assert router["metadata"]["ownerReferences"][0]["uid"] == uid

    c.kubectl("delete", "dscd", "web", "-n", ns, "--timeout=60s")
    wait_until(
        "the resource's own children collected",
        lambda: not c.kubectl("get", "deployment", "web-router", "-n", ns, check=False).stdout,
        90,
    )
    kept = c.kubectl_json("get", "service", "web", "-n", ns)
    assert kept["metadata"]["uid"] == before["metadata"]["uid"]


def test_a_new_resource_gets_its_own_random_tenant_salt(rig: Rig) -> None:
    c, ns = rig.c, rig.ns
    rig.deploy("salted")
    secret = c.kubectl_json("get", "secret", "salted-tenant-salt", "-n", ns)
    uid = c.kubectl_json("get", "dscd", "salted", "-n", ns)["metadata"]["uid"]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
    assert secret.get("immutable") is True and len(secret["data"]["salt"]) > 64
    pod = rig.deployment("salted-blue")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    ref = env["DSCACHE_SERVER_TENANT_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "salted-tenant-salt", "key": "salt"}
    # The internal token (key info, template and holdings filters) comes with it: the
    # server, its sidecar and the router's picker read the same key of that Secret.
    assert len(secret["data"]["internal-token"]) > 40
    token = {"name": "salted-tenant-salt", "key": "internal-token", "optional": True}
    sidecar = {e["name"]: e for e in pod["containers"][1]["env"]}
    assert env["DSCACHE_SERVER_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == token
    assert sidecar["DSCACHE_SIDECAR_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == token
    router = rig.deployment("salted-router")["spec"]["template"]["spec"]["containers"]
    picker = {e["name"]: e for c in router for e in c.get("env", [])}
    assert picker["DSCACHE_PICKER_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == token


# ----------------------------------------------------------------------------- enforcement


def _core_image() -> str:
    return IMAGES["core"].ref


def _pod(name: str, labels: dict[str, str], command: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"dscache.io/node-kind": "real"},
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": _core_image(),
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                }
            ],
        },
    }


_SERVE = "python -m http.server 8000 & python -m http.server 9102 & wait"
_CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()\n"
    "    print('open')\n"
    "except OSError as exc:\n"
    "    print('closed', exc)\n"
)


def test_the_rendered_policies_are_enforced_on_the_real_node(
    dev_cluster: DevCluster, namespace: str
) -> None:
    c, ns = dev_cluster, namespace
    if not getattr(c, "real_nodes", ()):
        pytest.skip("needs the dev cluster's real node (DSCACHE_TEST_REAL_NODES=0)")
    # The dev cluster starts its NetworkPolicy controller only with the ipset tool:
    # without it the policies are not enforced (a failure in CI, which installs it).
    need_binary("ipset", "ipset")
    owner = Owner("chat", ns, "00000000-0000-0000-0000-000000000000")
    spec = parse_spec({"model": {"preset": "tiny-gqa"}})
    policies = network_policies(owner, spec, DeepSeekCacheDeploymentStatus(), AdminPolicy())
    for p in policies:
        del p["metadata"]["ownerReferences"]  # no such owner: the collector would take them
    pods = [
        _pod("model", selector_labels(owner, "model"), _SERVE),
        _pod("router", selector_labels(owner, "router"), "sleep 3600"),
        _pod("prewarm", selector_labels(owner, "prewarm"), "sleep 3600"),
        _pod("stranger", {"app": "stranger"}, "sleep 3600"),
    ]
    c.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([*policies, *pods]))
    c.kubectl("wait", "--for=condition=Ready", "pod", "--all", "-n", ns, "--timeout=180s")
    ip = c.kubectl_json("get", "pod", "model", "-n", ns)["status"]["podIP"]

    def reach(client: str, port: int) -> bool:
        out = c.kubectl(
            "exec", client, "-n", ns, "--", "python", "-c", _CONNECT, ip, str(port), timeout=60
        ).stdout
        return out.startswith("open")

    # The controller programs its rules a moment after the pods get their IPs.
    wait_until("the stranger shut out", lambda: not reach("stranger", 8000), 60, 1.0)
    assert reach("router", 8000) and reach("router", 9102)
    assert reach("prewarm", 8000) and not reach("prewarm", 9102)
    assert not reach("stranger", 9102)
    # The node itself (kubelet probes, Prometheus on the host) still gets through.
    socket.create_connection((ip, 9102), timeout=5).close()
    # Without the policies the stranger gets in again: the controller did the blocking.
    c.kubectl("delete", "networkpolicy", "--all", "-n", ns)
    wait_until("the stranger let in", lambda: reach("stranger", 8000), 60, 1.0)
