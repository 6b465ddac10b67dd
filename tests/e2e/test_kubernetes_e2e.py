"""The Kubernetes story on running pods: what an SRE does after ``helm install``.

Everything here runs for real on the session dev cluster's real node: the
operator as two peered pods (Helm), model-server + sidecar pods of the dscache
image, the NGINX router pod, the prewarm Job, and Debian's Prometheus beside
the cluster scraping the pods. ``dscache demo kubernetes --quick`` runs first
(the warm canary promoted on real hit rates and TTFT, a bad revision rolled
back by the gate, the blind rolling update); then the abort annotation and
``kubectl rollout undo`` on live pods, an operator pod killed mid-ramp, and a
hostPath cache that survives its pod and keeps the two tracks apart; a vLLM pod
(``spec.engine: vllm``) whose replacement loads its prefix from the node's store;
a session that moves to another pod finding its prefix in the shared tier (a Redis
Cluster on the host); and ``routing.gateway: inferencePool`` with the Gateway API
Inference Extension's own CRD, a conversation's turns sent through the router pods'
endpoint picker to the pods holding their KV.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dscache_tools.demo.kube import EXAMPLE, KubeDemoOptions, run_kubernetes_demo, write_png
from dscache_tools.demo.kube.options import EXAMPLE_VLLM
from dscache_tools.devcluster import DevCluster, wait_until
from dscache_tools.devcluster.images import image_loader
from dscache_tools.eppcheck import build as build_eppcheck
from dscache_tools.eppcheck import check as run_eppcheck
from dscache_tools.eppcheck import inference_objective_crd, inference_pool_crd
from dscache_tools.rediscluster import LocalRedisCluster
from prometheus_client.parser import text_string_to_metric_families

from dscache.metricnames import PICKER_METRICS_PATH

# Each test starts model pods on a 2-core machine: minutes, not the suite's default 10.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]
log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NS = "dscache-system"
#: A weight change must reach the router "within a few seconds"; slack for a loaded CI machine.
ROUTER_LATENCY_BOUND_S = 15.0
#: The hostPath test's node directory, one of the roots the chart's operator allows.
E2E_HOST_DIR = f"/var/lib/dscache-e2e-{os.getpid()}"


@pytest.fixture(scope="module")
def release(dev_cluster: DevCluster) -> Iterator[str]:
    """The chart installed as a user would: the operator as two peered pods."""
    assert dev_cluster.prometheus_url, "the session cluster runs Prometheus"
    values = {
        "operator.prometheusUrl": dev_cluster.prometheus_url,
        "operator.tickSeconds": 2,
        "operator.peeringLifetimeSeconds": 10,
        # The hostPath test's directory, beside the default root (the admin's allow-list).
        "operator.policy.hostPathRoots": f"{{/var/lib/dscache,{E2E_HOST_DIR}}}",
    }
    dev_cluster.install_chart(
        "dscache", ROOT / "charts" / "dscache", OPERATOR_NS, values, timeout="300s"
    )
    yield OPERATOR_NS
    # The operator modules run their own operator process: leave no replica acting.
    dev_cluster.helm("uninstall", "dscache", "--namespace", OPERATOR_NS, "--wait", check=False)


def _resource(name: str, example: Path = EXAMPLE, **spec: Any) -> dict[str, Any]:
    """The CPU-sized example (or ``example``), one pod per track, a small cache, no
    prewarm; ``spec`` on top."""
    doc: dict[str, Any] = yaml.safe_load(example.read_text())
    doc["metadata"] = {"name": name}
    base = doc["spec"]
    base["replicas"] = 1
    base["cache"]["size"] = "256Mi"
    base["prewarm"] = {"enabled": False}
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return doc


def _apply(c: DevCluster, ns: str, doc: dict[str, Any]) -> None:
    c.kubectl("apply", "-n", ns, "-f", "-", stdin=json.dumps(doc))


def _status(c: DevCluster, ns: str, name: str) -> dict[str, Any]:
    st: dict[str, Any] = c.kubectl_json("get", "dscd", name, "-n", ns).get("status") or {}
    return st


def _wait_status(
    c: DevCluster, ns: str, name: str, what: str, ok: Any, timeout: float = 600
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        st = _status(c, ns, name)
        return st if ok(st) else None

    try:
        result: dict[str, Any] = wait_until(what, probe, timeout, 1.0)
    except TimeoutError as exc:
        pods = c.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        raise AssertionError(f"{exc}\nstatus: {_status(c, ns, name)}\npods:\n{pods}") from exc
    return result


def _available(c: DevCluster, ns: str, name: str, timeout: float = 900) -> dict[str, Any]:
    """At rest, and the ``Available`` condition True: the stable pods and a router pod."""

    def ok(s: dict[str, Any]) -> bool:
        cond = next((x for x in s.get("conditions", []) if x["type"] == "Available"), {})
        return s.get("phase") == "Available" and cond.get("status") == "True"

    return _wait_status(c, ns, name, "Available", ok, timeout)


def _patch(c: DevCluster, ns: str, name: str, patch: dict[str, Any]) -> None:
    c.kubectl("patch", "dscd", name, "-n", ns, "--type", "merge", "-p", json.dumps(patch))


def _router_status(c: DevCluster, ns: str, name: str) -> dict[str, Any] | None:
    pods = c.kubectl_json(
        "get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name},"
        "app.kubernetes.io/component=router",
    )["items"]  # fmt: skip
    ips = [p["status"].get("podIP") for p in pods if p["status"].get("podIP")]
    if not ips:
        return None
    try:
        with urllib.request.urlopen(f"http://{ips[0]}:8080/dscache/router/status", timeout=5) as r:
            body: dict[str, Any] = json.loads(r.read())
            return body
    except OSError:
        return None


def _chat(c: DevCluster, ns: str, name: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    svc = c.kubectl_json("get", "service", name, "-n", ns)["spec"]["clusterIP"]
    body = json.dumps({"messages": messages, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://{svc}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "X-Session-ID": "e2e-hostpath"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:  # through the router Service
        reply: dict[str, Any] = json.loads(r.read())
        return reply


def _chat_when_served(
    c: DevCluster, ns: str, name: str, messages: list[dict[str, str]]
) -> dict[str, Any]:
    """:func:`_chat`, retried while the router has no ready pod to send it to (503),
    and while the router itself is not ready yet (the Service refuses connections:
    the resource's ``Available`` phase says the model track is ready, not the router)."""

    def answer() -> dict[str, Any] | None:
        try:
            return _chat(c, ns, name, messages)
        except urllib.error.HTTPError as exc:
            # One pod per track here: until the router's config lists a (new) pod.
            if exc.code in (502, 503):
                return None
            raise
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionRefusedError):
                return None
            raise

    reply: dict[str, Any] = wait_until("an answer through the router", answer, 300, 2.0)
    return reply


# ----------------------------------------------------------------------------- the demo


@pytest.mark.timeout(2700)
def test_demo_kubernetes_promotes_the_good_revision_and_rolls_back_the_bad_one(
    dev_cluster: DevCluster, release: str, tmp_path: Path
) -> None:
    opts = KubeDemoOptions(
        quick=True,
        kubeconfig=dev_cluster.kubeconfig,
        prometheus_url=dev_cluster.prometheus_url,
        namespace="e2e-demo",
        operator_namespace=release,
        # A failed run keeps its pods' logs here (pod-logs/<namespace>/).
        workdir=tmp_path,
        # A light load: the test checks the behaviour, the benchmark the figures.
        concurrency=8,
        think_s=3.0,
        # The seconds measured after each rollout feed only the figures (30 s in the
        # quick profile), which this test does not assert.
        settle_s=5.0,
        # The latency gate compares timings: on a shared 2-core host a P99 can
        # double by itself (CI once rolled the warm canary back at 2.2 s vs
        # 0.96 s). The hit-rate gate is what must tell the cold revision from
        # the warm one here; the bound stays, wide, so it is still exercised.
        max_ttft_p99_ratio=10.0,
        # The cold revision reads 0.0; a warm canary once read 0.78 against stable's
        # 0.94 in its first 10% window on this loaded host (a cluster stage run
        # back to back), under the example's 0.9 ratio. 0.6 still tells them apart.
        min_hit_rate_ratio=0.6,
    )
    report = run_kubernetes_demo(opts, say=lambda line: log.info("demo: %s", line))
    (tmp_path / "demo.json").write_text(json.dumps(report, indent=2))
    assert report["promoted"] is True
    assert report["bad_revision_rolled_back"] is True
    bad = report["bad_revision"]["last_analysis"]
    assert bad["result"] == "Fail" and bad["hitRate"] == pytest.approx(0.0, abs=1e-6)
    for key in ("warm_canary", "blind_rolling"):
        part = report[key]
        for field in ("recomputed_tokens", "prompt_tokens", "ttft_p99_s", "errors"):
            assert part[field] is not None, (key, field)
        assert part["prompt_tokens"] > 0 and 0 <= part["recomputed_tokens"] <= part["prompt_tokens"]
    # Nothing a client sent failed during the warm canary's whole rollout.
    assert report["warm_canary"]["errors"] == 0
    # Each step of the ramp was served, in order, once.
    weights = [s["weight"] for s in report["warm_canary"]["per_step"]]
    ramp = [w for w in weights if w]
    assert ramp[: ramp.index(100) + 1] == [10.0, 25.0, 50.0, 100.0], weights
    # The blind update ran alone: the operator rolled nothing out meanwhile.
    blind_events = report["timeline"]["blind_rolling"]["events"]
    assert {e["value"] for e in blind_events if e["what"] == "weight"} == {0.0}, blind_events
    latency = report["router_weight_latency_s"]
    assert latency is not None and latency < ROUTER_LATENCY_BOUND_S
    write_png(report, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    # Prometheus scraped the pods' real metrics, labelled by revision (over the
    # whole run: the demo deleted its namespace, so the series have ended).
    query = urllib.parse.quote(
        "count by (dscache_io_revision) (last_over_time("
        'dscache_server_prompt_tokens_total{namespace="e2e-demo"}[2h]))'
    )
    with urllib.request.urlopen(f"{dev_cluster.prometheus_url}/api/v1/query?query={query}") as r:
        result = json.loads(r.read())["data"]["result"]
    revisions = {s["metric"].get("dscache_io_revision") for s in result}
    # Revisions 1, 2 and the bad one; every series carries its pod's revision.
    assert None not in revisions and len(revisions) >= 3, result
    # In the pods (one PID namespace each), the server read its sidecar's LMDB index
    # itself: every lookup was direct, none went over gRPC.
    lookups = urllib.parse.quote(
        "sum by (path) (last_over_time("
        'dscache_server_cache_lookups_total{namespace="e2e-demo"}[2h]))'
    )
    with urllib.request.urlopen(f"{dev_cluster.prometheus_url}/api/v1/query?query={lookups}") as r:
        by_path = {
            s["metric"]["path"]: float(s["value"][1])
            for s in json.loads(r.read())["data"]["result"]
        }
    assert by_path.get("direct", 0) > 0 and by_path.get("rpc", 0) == 0, by_path


# ----------------------------------------------------------------------------- steering


def test_abort_and_rollout_undo_on_live_pods(
    dev_cluster: DevCluster, release: str, namespace: str
) -> None:
    c, ns = dev_cluster, namespace
    name = "steer"
    # An hour per step: nothing advances unless a person says so.
    _apply(c, ns, _resource(name, rollout={"interval": "1h", "steps": [10, 50, 100]}))
    first = _available(c, ns, name)
    # Available counts the router: once it is True a router pod answers, no wait.
    assert _router_status(c, ns, name) is not None, "Available, but no router pod answers"
    stable_slot = first["stableSlot"]
    _patch(c, ns, name, {"spec": {"model": {"revision": "2"}}})
    st = _wait_status(c, ns, name, "weight 10", lambda s: s.get("weight") == 10)
    canary_slot = st["canarySlot"]
    wait_until(
        "the router to serve 10% on the canary track",
        lambda: (_router_status(c, ns, name) or {}).get("canary_weight") == 10.0,
        ROUTER_LATENCY_BOUND_S,
    )

    c.kubectl("annotate", "dscd", name, "-n", ns, "dscache.io/abort=true")
    st = _wait_status(c, ns, name, "aborted", lambda s: s.get("phase") == "RolledBack")
    assert st["weight"] == 0 and st["stableSlot"] == stable_slot
    wait_until(
        "the router to drop the canary",
        lambda: (_router_status(c, ns, name) or {}).get("canary") is None,
        ROUTER_LATENCY_BOUND_S,
    )
    wait_until(
        "the aborted track's pods to go",
        lambda: (
            not c.kubectl_json("get", "pods", "-n", ns, "-l", f"dscache.io/slot={canary_slot}")[
                "items"
            ]
        ),
        180,
    )
    annotations = c.kubectl_json("get", "dscd", name, "-n", ns)["metadata"].get("annotations", {})
    assert "dscache.io/abort" not in annotations  # one-shot: acted on, then cleared

    # A new revision, promoted in one go; then a person undoes its Deployment.
    _patch(c, ns, name, {"spec": {"model": {"revision": "3"}}})
    _wait_status(c, ns, name, "revision 3 at 10%", lambda s: s.get("weight") == 10)
    c.kubectl("annotate", "dscd", name, "-n", ns, "dscache.io/promote=full")
    st = _wait_status(
        c, ns, name, "promoted", lambda s: s.get("phase") == "Available" and s.get("previousSlot")
    )
    new_slot, old_slot = st["stableSlot"], st["previousSlot"]
    assert (new_slot, old_slot) == (canary_slot, stable_slot)
    deployment = f"{name}-{new_slot}"
    before = c.kubectl_json("get", "deployment", deployment, "-n", ns)
    c.kubectl("rollout", "undo", f"deployment/{deployment}", "-n", ns)
    st = _wait_status(
        c, ns, name, "the undo honoured", lambda s: s.get("stableSlot") == old_slot, 120
    )
    assert st["lastAction"]["type"] == "undo" or st["phase"] == "RolledBack"
    wait_until(
        "the router to send every session to the warm previous track",
        lambda: (_router_status(c, ns, name) or {}).get("stable") == old_slot,
        ROUTER_LATENCY_BOUND_S,
    )
    # Not fought: the undone template stays as the person left it.
    after = c.kubectl_json("get", "deployment", deployment, "-n", ns)
    assert (
        after["spec"]["template"]["metadata"]["annotations"]
        != before["spec"]["template"]["metadata"]["annotations"]
    )


def _active_operator_pod(c: DevCluster) -> str | None:
    """The operator pod that acts: the one whose /metrics counts reconciles."""
    pods = c.kubectl_json("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=dscache")
    for pod in pods["items"]:
        ip = pod["status"].get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp"):
            continue
        try:
            with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if (
                line.startswith("dscache_operator_reconciles_total{")
                and float(line.split()[-1]) > 0
            ):
                name: str = pod["metadata"]["name"]
                return name
    return None


def test_an_operator_pod_killed_mid_ramp_resumes_without_repeating_a_step(
    dev_cluster: DevCluster, release: str, namespace: str
) -> None:
    c, ns = dev_cluster, namespace
    name = "ramp"
    # Blind steps (no analysis): this is about the operator, not the gate.
    rollout = {"interval": "20s", "steps": [10, 25, 50, 100], "analysis": {"enabled": False}}
    _apply(c, ns, _resource(name, rollout=rollout))
    _available(c, ns, name)
    _patch(c, ns, name, {"spec": {"model": {"revision": "2"}}})
    _wait_status(c, ns, name, "weight 25", lambda s: s.get("weight") == 25)
    victim = wait_until("the acting operator pod", lambda: _active_operator_pod(c), 60)
    c.kubectl("delete", "pod", victim, "-n", OPERATOR_NS, "--grace-period=0", "--force")
    st = _available(c, ns, name, 600)
    assert st["weight"] == 0 and st.get("previousSlot")
    events = c.kubectl_json(
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        f"involvedObject.name={name},reason=StepStarted",
    )["items"]
    weights = sorted(int(e["message"].split(" at ")[1].split("%")[0]) for e in events)
    assert weights == [10, 25, 50, 100], [e["message"] for e in events]


# ----------------------------------------------------------------------------- hostPath


def _replaced_pod_answers_from_the_host_path(
    c: DevCluster, ns: str, name: str, host_dir: Path, store_wait_s: float | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Asks the blue track's pod a prompt long enough to be cached (over minTokens),
    waits ``store_wait_s`` at most for its blocks in the pod's store on the node's
    disk (None: deletes the pod right after the answer, while the server's stores
    are still queued), deletes the pod, and asks its replacement the same: both
    answers, the second served from the host path (asserted)."""
    text = " ".join(f"Quarterly revenue line {i} grew by {i % 7} percent." for i in range(80))
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "Summary?"}]
    pod = c.kubectl_json("get", "pods", "-n", ns, "-l", "dscache.io/slot=blue")["items"][0]
    ip = pod["status"]["podIP"]
    # The store holds blocks of its own before the prompt (the reference server's
    # start-up calibration writes two): wait for the prompt's, written after the answer.
    before = _pod_metric(ip, 9102, "dscache_sidecar_blocks")
    first = _chat_when_served(c, ns, name, messages)
    assert first["usage"]["prompt_tokens"] > 256
    if store_wait_s is not None:
        wait_until(
            "the prompt's blocks in the pod's store",
            lambda: _pod_metric(ip, 9102, "dscache_sidecar_blocks") > before,
            store_wait_s,
        )
    blue = host_dir / ns / f"{name}-blue"
    assert any(blue.glob("segments/*"))  # on the node's disk, under the track's directory
    c.kubectl("delete", "pod", pod["metadata"]["name"], "-n", ns, "--wait=true")
    c.kubectl("rollout", "status", f"deployment/{name}-blue", "-n", ns, "--timeout=600s")
    again = _chat_when_served(c, ns, name, messages)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 256, again["usage"]
    return first, again


def test_a_host_path_cache_survives_its_pod_and_keeps_the_tracks_apart(
    dev_cluster: DevCluster, release: str, namespace: str, tmp_path: Path
) -> None:
    c, ns = dev_cluster, namespace
    name = "disk"
    host_dir = Path(E2E_HOST_DIR)
    try:
        volume = {"type": "hostPath", "hostPath": str(host_dir)}
        doc = _resource(name, cache={"volume": volume}, rollout={"interval": "1h"})
        _apply(c, ns, doc)
        _available(c, ns, name)
        # The pod is deleted right after its answer, before its server's queued stores
        # are written (both containers get SIGTERM at once; the sidecar serves on
        # until the server has gone); its replacement on the same node finds the
        # cache warm.
        _replaced_pod_answers_from_the_host_path(c, ns, name, host_dir, None)
        blue = host_dir / ns / f"{name}-blue"
        assert blue.stat().st_uid == 10001  # the init container gave it to the pods' user

        # A rollout puts the second track on the same node, in a directory of its own.
        _patch(c, ns, name, {"spec": {"model": {"revision": "2"}}})
        _wait_status(c, ns, name, "the canary at 10%", lambda s: s.get("weight") == 10)
        green = host_dir / ns / f"{name}-green"
        wait_until("the green track's own store", (green / "index").exists, 120)
        assert (blue / "index").exists() and blue != green
        # Each store is locked by its own track's sidecar (a second daemon on either
        # directory would refuse to start): two holders, one per track's pod.
        holders = {json.loads((d / "LOCK").read_text())["host"] for d in (blue, green)}
        assert len(holders) == 2 and all(h.startswith(f"{name}-") for h in holders), holders
        nodes = {
            p["spec"]["nodeName"]
            for p in c.kubectl_json(
                "get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=model"
            )["items"]
        }
        assert nodes == {"dev-real-0"}
        c.kubectl("delete", "dscd", name, "-n", ns, "--timeout=300s")
        wait_until(
            "the model pods to go",
            lambda: (
                not c.kubectl_json(
                    "get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=model"
                )["items"]
            ),
            300,
        )
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)  # the test undoes what it put on the host


# ----------------------------------------------------------------------------- vLLM


def test_a_vllm_pod_loads_the_prefix_the_pod_before_it_stored(
    dev_cluster: DevCluster, release: str, namespace: str
) -> None:
    """``spec.engine: vllm`` on the real node: vLLM's CPU build with the dscache
    connector, in the pod the operator renders (read-only root, non-root, beside its
    sidecar, on a hostPath cache), answers through the router; the pod that replaces
    it loads the prompt's prefix from the node's store and answers alike."""
    c, ns = dev_cluster, namespace
    name = "vllm"
    # The session cluster's node has the reference engine's images only.
    c.load_images(image_loader(names=["vllm"]))
    host_dir = Path(E2E_HOST_DIR)
    try:
        volume = {"type": "hostPath", "hostPath": str(host_dir)}
        doc = _resource(name, EXAMPLE_VLLM, cache={"volume": volume}, rollout={"interval": "1h"})
        _apply(c, ns, doc)
        _available(c, ns, name)
        pods = c.kubectl_json("get", "pods", "-n", ns, "-l", "dscache.io/slot=blue")["items"]
        images = {k["name"]: k["image"] for k in pods[0]["spec"]["containers"]}
        assert "dscache-vllm" in images["server"], images
        # A new vLLM process has an empty prefix cache: what it finds is dscache's.
        first, again = _replaced_pod_answers_from_the_host_path(c, ns, name, host_dir, 120)
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        c.kubectl("delete", "dscd", name, "-n", ns, "--timeout=300s")
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)  # the test undoes what it put on the host


# ----------------------------------------------------------------------------- shared tier


def _pod_metric(ip: str, port: int, name: str, **labels: str) -> float:
    """One sample of a pod's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
        return sum(
            s.value
            for f in families
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )


def _shared_tier_blocks(cluster: LocalRedisCluster, password: str) -> dict[str, int]:
    """Blocks in the shared tier by tenant id (names end ``:<tenant hex>:<key hex>``)."""
    import redis as redis_py

    counts: dict[str, int] = {}
    for port in cluster.ports:
        node = redis_py.Redis(host=cluster.host, port=port, password=password)
        try:
            for name in node.scan_iter(count=1000):
                tenant = name.decode().rsplit(":", 2)[-2]
                counts[tenant] = counts.get(tenant, 0) + 1
        finally:
            node.close()
    return counts


def _pod_chat(ip: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A chat request straight to one model pod (no router: the test picks the pod)."""
    body = json.dumps({"messages": messages, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://{ip}:8000/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        reply: dict[str, Any] = json.loads(r.read())
        return reply


def test_a_session_moved_to_another_pod_finds_its_prefix_in_the_shared_tier(
    dev_cluster: DevCluster, release: str, namespace: str, tmp_path: Path
) -> None:
    """examples/06-shared-tier for real: a Redis Cluster on the host (at the node
    bridge's address, where pods reach the host), two model pods whose sidecars use
    it through a Secret; a conversation's next turn sent to the other pod is a hit."""
    c, ns = dev_cluster, namespace
    assert c.prometheus_url, "the session cluster runs Prometheus on the node bridge"
    host = urllib.parse.urlparse(c.prometheus_url).hostname or ""
    with LocalRedisCluster(tmp_path / "redis", password="e2e-shared", host=host) as redis:
        secret = yaml.safe_load((ROOT / "examples" / "06-shared-tier" / "secret.yaml").read_text())
        secret["metadata"] = {"name": secret["metadata"]["name"]}
        secret["stringData"] = {"endpoints": redis.nodes, "password": "e2e-shared"}
        c.kubectl("apply", "-n", ns, "-f", "-", stdin=json.dumps(secret))
        example = yaml.safe_load(
            (ROOT / "examples" / "06-shared-tier" / "deepseekcachedeployment.yaml").read_text()
        )
        shared = {**example["spec"]["cache"]["shared"], "writePolicy": "all"}
        name = "shared"
        _apply(c, ns, _resource(name, replicas=2, cache={"shared": shared}))
        _available(c, ns, name)
        pods = c.kubectl_json("get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=model")[
            "items"
        ]
        ips = sorted(p["status"]["podIP"] for p in pods if p["status"].get("podIP"))
        assert len(ips) == 2, pods
        a, b = ips
        text = " ".join(
            f"Segment margin note {i}: freight rates moved {i % 9} points." for i in range(90)
        )
        turn1 = [{"role": "system", "content": text}, {"role": "user", "content": "Summary?"}]
        first = _pod_chat(a, turn1)
        assert first["usage"]["prompt_tokens"] > 256
        # Waited for in the tier itself: each pod's start-up calibration writes two
        # blocks of its own tenant too, so A's push counter alone said "written"
        # before turn 1's blocks were, and on a loaded machine B then missed them.
        full_blocks = first["usage"]["prompt_tokens"] // 256
        wait_until(
            f"pod A's sidecar to write turn 1's {full_blocks} blocks to the shared tier",
            lambda: (
                max(_shared_tier_blocks(redis, "e2e-shared").values(), default=0) >= full_blocks
            ),
            120,
        )
        turn2 = [
            *turn1,
            {"role": "assistant", "content": "Rates rose."},
            {"role": "user", "content": "Why?"},
        ]
        moved = _pod_chat(b, turn2)
        cached = moved["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 256, moved["usage"]
        fetched = _pod_metric(
            b, 9102, "dscache_sidecar_remote_blocks_total", op="fetch", result="ok"
        )
        assert fetched > 0
        assert _pod_metric(b, 9102, "dscache_sidecar_remote_up") == 1
        c.kubectl("delete", "dscd", name, "-n", ns, "--timeout=300s")


# ----------------------------------------------------------------------------- gateway


def _epp_destination(address: str) -> str | None:
    """The endpoint picker's answer to a headers-only request (a GET), or None."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":method", raw_value=b"GET"),
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models"),
        ]
    )
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True)
    )
    with grpc.insecure_channel(address) as channel:
        try:
            for answer in pb_grpc.ExternalProcessorStub(channel).Process(
                iter([request]), timeout=10
            ):
                for h in answer.request_headers.response.header_mutation.set_headers:
                    if h.header.key == "x-gateway-destination-endpoint":
                        return h.header.raw_value.decode()
        except grpc.RpcError:
            return None
    return None


def test_through_the_endpoint_picker_each_turn_reaches_the_pod_holding_its_kv(
    dev_cluster: DevCluster, release: str, namespace: str
) -> None:
    """``routing.gateway: inferencePool`` on the real node: the extension's own
    InferencePool CRD (its schema checks what the operator makes), the router pods'
    picker serving ext_proc on the pool the operator wrote, and ``dscache dev
    eppcheck --forward`` as the gateway (no gateway builds here; README): its
    protocol checks against the extension's reference picker, then each turn of six
    conversations, with a session id and without, picked and sent to that model pod,
    where every later turn finds the KV its conversation left. With ``cache.kvEvents``
    on: the sidecars publish their holdings over ZeroMQ (PLAIN login with the
    resource's internal token), and the picker's feeds of both are in sync. The pool's
    InferenceObjectives (the extension's CRD) reach the picker's pool file."""
    c, ns = dev_cluster, namespace
    crd, objective_crd = inference_pool_crd(), inference_objective_crd()
    binary = build_eppcheck()
    c.kubectl("apply", "--server-side", "-f", str(crd), "-f", str(objective_crd))
    try:
        for established in (
            "crd/inferencepools.inference.networking.k8s.io",
            "crd/inferenceobjectives.inference.networking.x-k8s.io",
        ):
            c.kubectl("wait", "--for=condition=Established", established)
        name = "gateway"
        events = {"kvEvents": {"enabled": True}}
        doc = _resource(name, replicas=2, routing={"gateway": "inferencePool"}, cache=events)
        _apply(c, ns, doc)
        _available(c, ns, name)

        # The operator sees the API within its discovery period and makes the pool.
        def pool() -> dict[str, Any] | None:
            done = c.kubectl("get", "inferencepool", name, "-n", ns, "-o", "json", check=False)
            return json.loads(done.stdout) if done.returncode == 0 else None

        spec = wait_until("the InferencePool", pool, 120)["spec"]
        assert spec["endpointPickerRef"]["name"] == f"{name}-epp"
        assert spec["endpointPickerRef"]["port"] == {"number": 9002}
        assert spec["targetPorts"] == [{"number": 8000}]
        selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
        pods = c.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]
        endpoints = sorted(f"{p['status']['podIP']}:8000" for p in pods if p["status"].get("podIP"))
        assert len(endpoints) == 2, pods

        router = c.kubectl_json(
            "get", "pods", "-n", ns, "-l",
            f"app.kubernetes.io/instance={name},app.kubernetes.io/component=router",
        )["items"][0]["status"]["podIP"]  # fmt: skip

        def picker_knows_both() -> bool:
            # The pool file reaches the picker through the ConfigMap volume; its
            # answer names the pick and then the track's other pods.
            named = _epp_destination(f"{router}:9002")
            return named is not None and sorted(named.split(",")) == endpoints

        wait_until("the picker's pool of both model pods", picker_knows_both, 180)
        code, report = run_eppcheck(
            binary, f"{router}:9002", endpoints, conversations=3, forward=True, pad=150
        )
        failed = [ch for ch in report["checks"] if not ch["ok"]]
        assert failed == [] and code == 0, failed
        turns = report["turns"]
        assert len(turns) == 6
        for conversation in turns.values():
            assert {t["pick"] for t in conversation} <= set(endpoints)
            assert conversation[2]["cached_tokens"] >= 512, conversation

        # The picker's gauge, through the router's NGINX (what Prometheus scrapes): it
        # follows both sidecars' KV events (logged in with the internal token) in sync.
        def event_pods() -> float | None:
            url = f"http://{router}:8080{PICKER_METRICS_PATH}"
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "dscache_picker_event_pods":
                        return float(sample.value)
            return None

        wait_until("both sidecars' event feeds in sync", lambda: event_pods() == 2, 120)

        # An InferenceObjective of the pool: its priority reaches the picker's pool file
        # (a negative one: its requests are shed, 429, when every pod is at its bound).
        objective = {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": "batch-summaries"},
            "spec": {"priority": -1, "poolRef": {"name": name}},
        }
        _apply(c, ns, objective)

        def pool_objectives() -> dict[str, int] | None:
            data = c.kubectl_json("get", "configmap", f"{name}-router", "-n", ns)["data"]
            found: dict[str, int] | None = json.loads(data["epp-pool.json"]).get("objectives")
            return found

        assert wait_until("the objective in the pool file", pool_objectives, 120) == {
            "batch-summaries": -1
        }
        c.kubectl("delete", "dscd", name, "-n", ns, "--timeout=300s")
    finally:
        c.kubectl("delete", "-f", str(crd), "-f", str(objective_crd), "--wait=false", check=False)
