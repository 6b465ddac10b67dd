"""The operator on a real control plane (``dscache dev cluster``), with real helm and kubectl.

What a platform team would do, end to end: install the chart, apply the
examples, change a model revision and watch the rollout, steer it with
annotations, ``kubectl rollout undo`` a track, restart the operator mid-ramp,
delete the resource. Rollout analysis reads a real Prometheus scraping a fake
model-server metrics endpoint whose figures each test sets.

Longer than ~400 lines on purpose: the scenarios share one dev cluster, one
chart install and one operator per module (minutes to start), and they run in
file order (the RBAC test must come before the shared operator starts).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from dscache_operator.crd import custom_resource_definition
from dscache_tools.devcluster import DevCluster, ToolError, wait_until
from operator_harness import (
    BAD,
    GOOD,
    REAPPLY_SECONDS,
    STABLE,
    OperatorProcess,
    Rig,
    apply,
    apply_example,
    available,
    condition,
    events,
    get,
    router_conf,
    wait_for,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
# ----------------------------------------------------------------------------- chart


#: The timestamp that starts each line of the operator's log.
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def test_chart_rbac_is_least_privilege(dev_cluster: DevCluster, chart: str, tmp_path: Path) -> None:
    sa = f"system:serviceaccount:{chart}:dscache"

    def can(*args: str) -> bool:
        done = dev_cluster.kubectl("auth", "can-i", *args, f"--as={sa}", check=False)
        return done.stdout.strip() == "yes"

    assert can("patch", "deployments.apps", "-n", "default")
    assert can("patch", "deepseekcachedeployments.dscache.io/status", "-n", "default")
    assert can("create", "jobs.batch", "-n", "default")
    assert not can("patch", "jobs.batch", "-n", "default")  # the prewarm Job is created once
    assert can("patch", "pods", "-n", "default")  # the router pods' config-hash annotation
    assert not can("delete", "pods", "-n", "default")
    assert can("patch", "clusterkopfpeerings.kopf.dev")
    assert not can("get", "secrets", "-n", "default")
    assert not can("list", "secrets", "-n", "default")
    assert can("create", "secrets", "-n", "default")  # a generated tenant salt, never read
    assert not can("delete", "deployments.apps", "-n", "default")
    assert not can("create", "clusterrolebindings.rbac.authorization.k8s.io")
    assert not can("*", "*")
    roles = dev_cluster.kubectl_json(
        "get", "clusterroles", "-l", "app.kubernetes.io/instance=dscache"
    )
    for role in roles["items"]:
        for rule in role["rules"]:
            assert "*" not in rule.get("verbs", []) and "*" not in rule.get("resources", [])
            if "secrets" in rule.get("resources", []):
                assert rule["verbs"] == ["create"] and rule["resources"] == ["secrets"]
    dep = dev_cluster.kubectl_json("get", "deployment", "dscache", "-n", chart)
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][-1] == "operator"
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True

    # And enough: the operator runs on the chart's ServiceAccount token alone. (This
    # test comes first in the module, before the shared admin operator starts.)
    token = dev_cluster.kubectl("create", "token", "dscache", "-n", chart).stdout.strip()
    config = yaml.safe_load(dev_cluster.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    kubeconfig = tmp_path / "sa-kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    sa_operator = OperatorProcess(dev_cluster, tmp_path, "http://127.0.0.1:9", kubeconfig)
    ns = "rbac-check"
    dev_cluster.kubectl("create", "namespace", ns)
    try:
        apply_example(dev_cluster, ns, "01-minimal")
        available(dev_cluster, ns, "chat", sa_operator)
        dev_cluster.kubectl("delete", "dscd", "chat", "-n", ns, "--timeout=60s")
    finally:
        sa_operator.stop()
        dev_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    log = sa_operator.tail()
    # Each line's message, without its timestamp (whose milliseconds can read "403").
    messages = [_STAMP.sub("", line) for line in log.splitlines()]
    assert not [m for m in messages if "Forbidden" in m or "403" in m], log


def test_invalid_resources_are_rejected_by_the_api_server(
    dev_cluster: DevCluster, chart: str, ns: str
) -> None:
    cases = [
        ({"model": {"preset": "a", "path": "/m"}}, "exactly one of model.preset or model.path"),
        ({"model": {"preset": "a"}, "rollout": {"steps": [50, 10, 100]}}, "must increase"),
        ({"model": {"preset": "a"}, "rollout": {"steps": [10, 50]}}, "must be 100"),
        ({"model": {"preset": "a"}, "replicas": -1}, "spec.replicas"),
        ({"model": {"preset": "a"}, "rollout": {"strategy": "yolo"}}, "Unsupported value"),
        ({"model": {"preset": "a"}, "rollout": {"interval": "soon"}}, "spec.rollout.interval"),
        (
            {"model": {"preset": "a"}, "cache": {"volume": {"type": "hostPath"}}},
            "hostPath is required",
        ),
        ({"model": {"preset": "a"}, "bogus": 1}, 'unknown field "spec.bogus"'),
        (
            {
                "model": {"preset": "a"},
                "cache": {"volume": {"type": "persistentVolumeClaim", "claimName": "kv"}},
            },
            "use cache.volume.claimTemplate",
        ),
        (
            {"model": {"preset": "a"}, "cache": {"shared": {"enabled": True}}},
            "cache.shared.secretRef is required when cache.shared.enabled is true",
        ),
        (
            {"model": {"preset": "a"}, "cache": {"shared": {"writePolicy": "sometimes"}}},
            "spec.cache.shared.writePolicy",
        ),
        (
            {
                "model": {"preset": "a"},
                "cache": {"shared": {"tls": {"caSecretRef": {"name": "ca", "key": "ca.crt"}}}},
            },
            "enable TLS or remove the CA",
        ),
        (
            {"model": {"path": "/m"}, "engine": "vllm", "server": {"dtype": "bfloat16"}},
            "pass vLLM's own dtype in spec.vllm.args",
        ),
        (
            {"model": {"path": "/m"}, "engine": "vllm", "cache": {"codec": "int8"}},
            "spec.cache.codec int8 is the reference server's",
        ),
        (
            {"model": {"preset": "a"}, "cache": {"kvEvents": {"engine": {"port": 5558}}}},
            "engine.port and engine.replayPort must differ",
        ),
        (
            {
                "model": {"path": "/m"},
                "engine": "vllm",
                "cache": {"kvEvents": {"enabled": True}},
                "vllm": {"args": ["--kv-events-config", "{}"]},
            },
            "the operator sets it",
        ),
    ]
    long_name = {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DeepSeekCacheDeployment",
        "metadata": {"name": "a" * 41},
        "spec": {"model": {"preset": "a"}},
    }
    done = dev_cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(long_name), check=False
    )
    assert done.returncode != 0 and "at most 40 characters" in done.stderr
    for spec, message in cases:
        doc = {
            "apiVersion": "dscache.io/v1alpha1",
            "kind": "DeepSeekCacheDeployment",
            "metadata": {"name": "bad"},
            "spec": spec,
        }
        done = dev_cluster.kubectl(
            "apply",
            "--validate=strict",
            "-n",
            ns,
            "-f",
            "-",
            stdin=yaml.safe_dump(doc),
            check=False,
        )
        assert done.returncode != 0, spec
        assert message in done.stderr, (message, done.stderr)


# ----------------------------------------------------------------------------- examples


@pytest.mark.parametrize("example", ["01-minimal", "02-canary", "03-blue-green-rollback"])
def test_examples_create_owned_hardened_children(
    dev_cluster: DevCluster, operator: OperatorProcess, ns: str, example: str
) -> None:
    c = dev_cluster
    apply_example(c, ns, example)
    name = next(
        d["metadata"]["name"]
        for p in sorted((ROOT / "examples" / example).glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d and d["kind"] == "DeepSeekCacheDeployment"
    )
    st = available(c, ns, name, operator)
    body = get(c, ns, name)
    uid = body["metadata"]["uid"]
    assert st["stableSlot"] == "blue" and st["observedGeneration"] == body["metadata"]["generation"]
    assert condition(st, "Ready")["status"] == "True"
    assert condition(st, "Available")["status"] == "True"

    sel = f"app.kubernetes.io/instance={name}"
    kinds = {
        "deployment": {f"{name}-blue", f"{name}-router"},
        "service": {name, f"{name}-blue"},
        "configmap": {f"{name}-router"},
        "poddisruptionbudget": {f"{name}-blue", f"{name}-router"},
    }
    for kind, names in kinds.items():
        items = c.kubectl_json("get", kind, "-n", ns, "-l", sel)["items"]
        assert {i["metadata"]["name"] for i in items} == names, kind
        for i in items:
            ref = i["metadata"]["ownerReferences"][0]
            assert (ref["kind"], ref["uid"], ref["controller"]) == (
                "DeepSeekCacheDeployment",
                uid,
                True,
            )
            labels = i["metadata"]["labels"]
            assert labels["app.kubernetes.io/managed-by"] == "dscache-operator"
            assert labels["app.kubernetes.io/part-of"] == "dscache"
            assert "dscache.io/track" in labels

    dep = c.kubectl_json("get", "deployment", f"{name}-blue", "-n", ns)
    assert dep["metadata"]["labels"]["dscache.io/track"] == "stable"
    pod = dep["spec"]["template"]["spec"]
    server, sidecar = pod["containers"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    probe = sidecar["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/readyz", "metrics")
    for container in (server, sidecar):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    pods = c.kubectl_json("get", "pods", "-n", ns, "-l", f"{sel},app.kubernetes.io/component=model")
    assert len(pods["items"]) == body["spec"]["replicas"]
    assert all(p["status"]["phase"] == "Running" for p in pods["items"])
    if example == "02-canary":  # GPUs: only nodes that have them
        nodes = {p["spec"]["nodeName"] for p in pods["items"]}
        gpu_nodes = {
            n["metadata"]["name"]
            for n in c.kubectl_json("get", "nodes")["items"]
            if "nvidia.com/gpu" in n["status"]["allocatable"]
        }
        assert nodes <= gpu_nodes
    # The router is rendered with the stable pods' addresses.
    conf = router_conf(c, ns, name)
    ips = [p["status"]["podIP"] for p in pods["items"]]
    # The Lua balancer (bounded loads, the default) carries them in its config table.
    assert "balancer_by_lua_block" in conf
    assert all(f'"{ip}:8000"' in conf for ip in ips), conf
    # Printer columns.
    table = c.kubectl("get", "dscd", name, "-n", ns).stdout
    assert table.split()[:7] == ["NAME", "PHASE", "STABLE", "CANARY", "WEIGHT", "HITRATE", "AGE"]

    # Re-applying is a no-op: the operator server-side applies every child again
    # each REAPPLY_SECONDS (a tick a second), and across several such intervals
    # no child is written: neither its resourceVersion nor the operator's
    # managedFields entry (whose time moves on any change) moves.
    def writes() -> dict[str, tuple[str, str]]:
        seen: dict[str, tuple[str, str]] = {}
        for kind in kinds:
            listed = c.kubectl_json("get", kind, "-n", ns, "-l", sel, "--show-managed-fields")
            for i in listed["items"]:
                m = i["metadata"]
                ours = [f for f in m["managedFields"] if f["manager"] == "dscache-operator"]
                assert ours, f"{kind}/{m['name']} not applied by the operator"
                seen[f"{kind}/{m['name']}"] = (m["resourceVersion"], json.dumps(ours))
        return seen

    before = writes()
    time.sleep(4 * REAPPLY_SECONDS + 1)
    assert writes() == before


# ----------------------------------------------------------------------------- rollouts


def test_good_figures_promote_through_every_step(rig: Rig) -> None:
    c, ns, name = rig.c, rig.ns, "good"
    prompts = {"prompts.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n'}
    apply(
        c,
        ns,
        [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "prompts"},
                "data": prompts,
            }
        ],
    )
    prewarm = {"prompts": {"name": "prompts"}, "placement": "ring"}
    stable = rig.deploy(name, extra={"prewarm": prewarm})
    _, canary = rig.rollout(name, "2")
    confs: dict[int, str] = {}

    def keep_conf(st: dict[str, Any]) -> None:
        if st["phase"] == "Progressing" and st["weight"] not in confs:
            confs[st["weight"]] = router_conf(c, ns, name)

    seen = rig.weights_until_promoted(name, canary, 120, keep_conf)
    weights = [w for p, w in seen if p == "Progressing"]
    assert weights == [10, 25, 50, 100], seen
    assert ("Prewarming", 0) in seen
    # New sessions split by weight onto the canary's track (green; blue is stable).
    assert "10% green;" in confs[10] and "25% green;" in confs[25] and "50% green;" in confs[50]
    assert "default green;" in confs[100]
    st = rig.status(name)
    assert (st["stableSlot"], st["previousSlot"], st["weight"]) == ("green", "blue", 0)
    assert st["lastAnalysis"]["result"] == "Pass" and st["hitRate"] == "0.950"
    reasons = rig.events(name, lambda r: "Promoted" in r)
    assert reasons.count("StepStarted") == 4 and "Prewarmed" in reasons
    job = c.kubectl_json("get", "job", f"{name}-prewarm-{canary}", "-n", ns)
    assert job["status"].get("succeeded") == 1
    # The Job warmed every canary pod (they were all ready when it was created) ...
    green_pods = c.kubectl_json(
        "get",
        "pods",
        "-n",
        ns,
        "-l",
        f"app.kubernetes.io/instance={name},app.kubernetes.io/component=model,dscache.io/slot=green",
    )["items"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    targets = set(env["DSCACHE_PREWARM_TARGETS"].split(","))
    assert targets == {f"http://{p['status']['podIP']}:8000" for p in green_pods}, targets
    assert len(targets) == 2
    # ... and was created once, never server-side applied (its template is immutable).
    shown = c.kubectl_json(
        "get", "job", f"{name}-prewarm-{canary}", "-n", ns, "--show-managed-fields"
    )
    ops = {(m["manager"], m["operation"]) for m in shown["metadata"]["managedFields"]}
    assert ("dscache-operator", "Apply") not in ops and ("dscache-operator", "Update") in ops
    # Progressive (placement ring): one copy of each prompt before 10% (two pods: still
    # one at 25% and 50%), the second copy by a Job of its own during 50%, before 100%.
    assert "--placement" in container["args"]
    assert container["args"][container["args"].index("--copies") + 1] == "1"
    last = c.kubectl_json("get", "job", f"{name}-prewarm-{canary}-s3", "-n", ns)
    assert last["status"].get("succeeded") == 1
    args = last["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--skip-copies") + 1 :][:3] == ["1", "--copies", "2"]
    # The live router pods carry the current config's hash (the kubelet resyncs them).
    cm = c.kubectl_json("get", "configmap", f"{name}-router", "-n", ns)
    digest = hashlib.sha256(cm["data"]["nginx.conf"].encode()).hexdigest()[:16]

    def router_pods_current() -> bool:
        pods = c.kubectl_json(
            "get",
            "pods",
            "-n",
            ns,
            "-l",
            f"app.kubernetes.io/instance={name},app.kubernetes.io/component=router",
        )["items"]
        return bool(pods) and all(
            p["metadata"].get("annotations", {}).get("dscache.io/router-config-hash") == digest
            for p in pods
        )

    wait_until("router pods annotated with the config hash", router_pods_current, 30)
    template_meta = rig.deployment(f"{name}-router")["spec"]["template"]["metadata"]
    assert "dscache.io/router-config-hash" not in (template_meta.get("annotations") or {})
    # The old track stays warm; the labels say who is who.
    blue, green = rig.deployment(f"{name}-blue"), rig.deployment(f"{name}-green")
    assert (
        blue["spec"]["replicas"] == 2
        and blue["metadata"]["labels"]["dscache.io/track"] == "previous"
    )
    assert green["metadata"]["labels"]["dscache.io/track"] == "stable"
    assert stable != canary


def test_bad_hit_rate_at_25_rolls_back_within_one_interval(rig: Rig) -> None:
    name = "bad"
    rig.deploy(name, interval="6s")
    _, canary = rig.rollout(name, "2")
    st = rig.wait(name, "weight 25", lambda s: s.get("weight") == 25)
    rig.metrics.set(rig.ns, canary, BAD)
    bad_from = max(datetime.fromisoformat(st["stepStartedAt"]), datetime.now(UTC))
    st = rig.wait(name, "rolled back", lambda s: s.get("phase") == "RolledBack")
    rolled_back = datetime.fromisoformat(condition(st, "RolledBack")["lastTransitionTime"])
    # The first analysis whose window holds only bad figures fails: at most two intervals
    # (6 s) after they began (the first may still average good ones in), plus a tick and
    # whole-second timestamps; the step itself is longer.
    assert (rolled_back - bad_from).total_seconds() <= 2 * 6 + 3
    assert st["weight"] == 0 and st.get("canaryRevision") is None
    rb = condition(st, "RolledBack")
    assert (rb["status"], rb["reason"]) == ("True", "AnalysisFailed")
    # The window may still hold good figures from before the switch: the rate is between
    # the bad 0.40 and the stable track's floor, and the reason says so.
    seen = re.search(r"hit rate (\d\.\d+)", rb["message"])
    assert seen and BAD.hit_rate <= float(seen[1]) < STABLE.hit_rate, rb["message"]
    assert "hit rate below" in rb["message"] and "25%" in rb["message"]
    assert st["lastAnalysis"]["result"] == "Fail"
    assert "default stable;" in router_conf(rig.c, rig.ns, name)
    assert rig.deployment(f"{name}-green")["spec"]["replicas"] == 0
    time.sleep(3)  # not retried while the spec asks for the same revision
    assert rig.status(name)["phase"] == "RolledBack"
    rig.events(name, lambda r: "AnalysisFailed" in r)


def test_no_data_pauses_and_data_resumes(rig: Rig) -> None:
    name = "nodata"
    rig.deploy(name, interval="3s")
    _, canary = rig.rollout(name, "2", figures=None)
    st = rig.wait(name, "paused", lambda s: s.get("phase") == "Paused")
    prog = condition(st, "Progressing")
    assert (prog["status"], prog["reason"]) == ("False", "AnalysisNoData")
    assert st["weight"] == 10 and st["lastAnalysis"]["result"] == "NoData"
    time.sleep(7)  # two more intervals: never promoted blind
    st = rig.status(name)
    assert (st["weight"], st["phase"]) == (10, "Paused")
    rig.metrics.set(rig.ns, canary, GOOD)
    rig.wait(name, "resumed", lambda s: s.get("weight", 0) >= 25)


def test_annotations_pause_promote_and_abort(rig: Rig) -> None:
    c, ns, name = rig.c, rig.ns, "steer"
    rig.deploy(name, interval="1h")  # nothing advances by itself
    rig.rollout(name, "2")
    rig.wait(name, "weight 10", lambda s: s.get("weight") == 10)

    def annotate(*kv: str) -> None:
        c.kubectl("annotate", "--overwrite", "dscd", name, "-n", ns, *kv)

    annotate("dscache.io/promote=next")
    st = rig.wait(name, "promoted a step", lambda s: s.get("weight") == 25)
    assert st["lastAction"]["type"] == "promote"
    wait_until(
        "promote annotation cleared",
        lambda: "dscache.io/promote" not in (get(c, ns, name)["metadata"].get("annotations") or {}),
        10,
    )

    annotate("dscache.io/pause=true")
    st = rig.wait(name, "paused", lambda s: s.get("phase") == "Paused")
    assert condition(st, "Progressing")["reason"] == "Paused" and st["weight"] == 25
    annotate("dscache.io/pause-")
    rig.wait(name, "resumed", lambda s: s.get("phase") == "Progressing")

    annotate("dscache.io/abort=true")
    st = rig.wait(name, "aborted", lambda s: s.get("phase") == "RolledBack")
    assert st["weight"] == 0 and condition(st, "RolledBack")["reason"] == "Aborted"

    # A new revision, promoted fully at once, then aborted inside the rollback window:
    # traffic goes straight back to the warm old track.
    _, rev3 = rig.rollout(name, "3")
    rig.wait(name, "weight 10", lambda s: s.get("weight") == 10)
    annotate("dscache.io/promote=full")
    st = rig.wait(name, "full", lambda s: s.get("stableRevision") == rev3)
    assert st["phase"] == "Available" and st["previousSlot"] == "blue"
    annotate("dscache.io/abort=true")
    st = rig.wait(name, "switched back", lambda s: s.get("stableSlot") == "blue")
    assert condition(st, "RolledBack")["reason"] == "RolledBackToPrevious"
    rig.events(name, lambda r: {"Promoted", "Aborted", "RolledBackToPrevious"} <= set(r))


def test_kubectl_rollout_undo_is_honoured(rig: Rig) -> None:
    c, ns, name = rig.c, rig.ns, "undo"
    first = rig.deploy(name, interval="1h")

    def blue_revision() -> str:
        dep = rig.deployment(f"{name}-blue")
        rev: str = dep["spec"]["template"]["metadata"]["labels"]["dscache.io/revision"]
        return rev

    # Revision 2 promoted to green; revision 3 then reuses blue, which had revision 1.
    _, rev2 = rig.rollout(name, "2")
    c.kubectl("annotate", "dscd", name, "-n", ns, "dscache.io/promote=full")
    rig.wait(name, "rev 2 stable", lambda s: s.get("stableRevision") == rev2)
    _, rev3 = rig.rollout(name, "3")
    st = rig.wait(name, "weight 10", lambda s: s.get("weight") == 10)
    assert st["canarySlot"] == "blue"
    wait_until("blue at revision 3", lambda: blue_revision() == rev3)
    c.kubectl("rollout", "undo", f"deployment/{name}-blue", "-n", ns)
    st = rig.wait(name, "undo recorded", lambda s: s.get("phase") == "RolledBack")
    rb = condition(st, "RolledBack")
    assert (rb["reason"], st["weight"], st["slots"]["blue"]["frozen"]) == ("RolloutUndo", 0, True)
    assert st["lastAction"]["type"] == "undo"
    rig.events(name, lambda r: "RolloutUndo" in r)
    assert "default stable;" in router_conf(c, ns, name)
    assert blue_revision() == first
    time.sleep(4)  # several ticks: the operator does not fight the undo
    assert blue_revision() == first
    # A new spec gives the track a new revision again.
    _, rev4 = rig.rollout(name, "4")
    wait_until("blue overwritten", lambda: blue_revision() == rev4, 30)


def test_operator_restarted_mid_ramp_resumes(rig: Rig) -> None:
    name = "restart"
    rig.deploy(name, interval="5s")
    _, canary = rig.rollout(name, "2")
    rig.wait(name, "weight 25", lambda s: s.get("weight") == 25)
    # The 25% step's Event is out before the kill (an Event still in kopf's posting
    # queue dies with the process: Events are best effort).
    rig.events(name, lambda r: r.count("StepStarted") == 2)
    rig.op.kill()
    try:
        time.sleep(7)  # the step's interval runs out while no operator runs
        assert rig.status(name)["weight"] == 25
    finally:
        rig.op.start()
    seen = rig.weights_until_promoted(name, canary, 90, lambda st: None)
    weights = [w for _, w in seen]
    assert weights[:3] == [25, 50, 100], (seen, rig.op.tail())
    # No step repeated or skipped (the last Event may trail the status).
    reasons = rig.events(name, lambda r: "Promoted" in r)
    assert reasons.count("StepStarted") == 4, reasons


def test_deleting_the_resource_garbage_collects_everything(rig: Rig) -> None:
    c, ns = rig.c, rig.ns
    apply_example(c, ns, "01-minimal")
    rig.available("chat")
    c.kubectl("delete", "dscd", "chat", "-n", ns, "--wait=true", "--timeout=60s")
    sel = "app.kubernetes.io/instance=chat"

    def gone() -> bool:
        out = c.kubectl_json(
            "get", "deployments,services,configmaps,poddisruptionbudgets,pods", "-n", ns, "-l", sel
        )
        return not out["items"]

    wait_until("children garbage-collected", gone, 60)
    with pytest.raises(ToolError):
        c.kubectl("get", "dscd", "chat", "-n", ns)


def test_kubectl_explain_documents_the_fields(dev_cluster: DevCluster, chart: str) -> None:
    out = dev_cluster.kubectl("explain", "dscd.spec.rollout.analysis.minHitRateRatio").stdout
    assert "at least the stable track's hit rate" in out
    out = dev_cluster.kubectl("explain", "dscd.status.conditions").stdout
    assert "Available, Progressing, Degraded, RolledBack, Ready." in out


def test_a_spec_the_schema_admits_but_the_operator_cannot_run_says_why(
    dev_cluster: DevCluster, operator: OperatorProcess, ns: str
) -> None:
    c = dev_cluster
    doc = {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DeepSeekCacheDeployment",
        "metadata": {"name": "zero"},
        "spec": {"model": {"preset": "tiny-gqa"}, "rollout": {"interval": "0s"}},
    }
    apply(c, ns, [doc])
    st = wait_for(c, ns, "zero", "InvalidSpec", lambda s: s.get("phase") == "Failed", operator)
    ready = condition(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.rollout.interval must be at least 1s" in ready["message"]
    events(c, ns, "zero", lambda r: "InvalidSpec" in r)
    c.kubectl(
        "patch",
        "dscd",
        "zero",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        '{"spec":{"rollout":{"interval":"1m"}}}',
    )
    st = available(c, ns, "zero", operator)
    assert condition(st, "Ready")["status"] == "True"


def _stub_crd(plural: str, kind: str) -> dict[str, Any]:
    """A stand-in for a Prometheus Operator CRD: same group, kind and scope, open schema."""
    names = {"plural": plural, "kind": kind, "singular": kind.lower()}
    version = {"name": "v1", "served": True, "storage": True}
    schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return custom_resource_definition("monitoring.coreos.com", names, "Namespaced", version, schema)


def test_monitoring_objects_appear_once_their_crds_exist(rig: Rig) -> None:
    c, ns = rig.c, rig.ns
    apply_example(c, ns, "01-minimal")
    rig.available("chat")
    assert not c.kubectl("api-resources", "--api-group=monitoring.coreos.com").stdout.count(
        "servicemonitors"
    )
    crds = [
        _stub_crd("servicemonitors", "ServiceMonitor"),
        _stub_crd("prometheusrules", "PrometheusRule"),
    ]
    c.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(crds))
    try:
        c.kubectl(
            "wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com"
        )

        def created() -> dict[str, Any] | None:
            done = c.kubectl(
                "get", "servicemonitor,prometheusrule", "-n", ns, "-o", "json", check=False
            )
            items = json.loads(done.stdout)["items"] if done.returncode == 0 else []
            by_name = {(i["kind"], i["metadata"]["name"]): i for i in items}
            return by_name if len(items) == 3 else None

        objs = wait_until("two ServiceMonitors and a PrometheusRule", created, 40)
        sm = objs[("ServiceMonitor", "chat")]["spec"]
        assert sm["podTargetLabels"] == ["dscache.io/revision", "dscache.io/slot"]
        router = objs[("ServiceMonitor", "chat-router")]["spec"]
        assert router["endpoints"][0]["path"] == "/dscache/router/metrics"
        assert router["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
        rule = objs[("PrometheusRule", "chat")]
        rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
        # No minHitRate in the example: the floor is 0.85, and the drop alert is
        # relative to the service's own level over the hour before.
        assert rules["DscacheHitRateLow"]["expr"].endswith("< 0.85")
        assert "< 0.95 * (" in rules["DscacheHitRateDropped"]["expr"]
        assert {"DscacheSidecarDown", "DscacheFallbackRateHigh"} <= set(rules)
    finally:
        for crd in crds:
            c.kubectl("delete", "crd", crd["metadata"]["name"], "--wait=false", check=False)
