"""``dscache demo kubernetes``: the cache-warmth-aware canary against a blind rolling update.

Everything runs for real on a Kubernetes cluster whose nodes run pods (the dev
cluster with a real node by default): the operator installed by Helm as a pod,
a CPU-sized ``DeepSeekCacheDeployment`` (``examples/04-dev-cluster``), model
server + sidecar pods, the NGINX router, a prewarm Job, and Prometheus beside
the cluster scraping the pods. The finance workload is driven through the
router's Service while:

1. **warm canary**: ``spec.model.revision`` changes; the operator deploys the
   new track, prewarms it, and ramps 10 -> 25 -> 50 -> 100% on the real hit
   rate and TTFT until it promotes;
2. **bad revision**: a revision that cannot hit (the cache admits nothing) is
   rolled out; the gate must roll it back at the first step;
3. **blind rolling update**: the stable track's Deployment gets a new model
   revision directly (``kubectl patch``), and Kubernetes replaces its pods one by
   one as a plain rolling update does, blind to what their caches hold. The
   operator keeps the router's pod list current meanwhile; it owns the
   Deployment and puts its template back afterwards, where the window ends.

Contract:
    * Warm canary and blind rolling update replay sessions of one workload
      (same documents, same shape, disjoint sessions) at the same concurrency;
      each is measured from its revision change until its rollout is complete
      and the same number of seconds after, so both windows cover a whole
      rollout and its aftermath.
    * Figures come from what the client saw (``usage`` of each streamed
      response and the time to its first token): recomputed prompt tokens are
      prompt tokens minus cached tokens.
    * Each part also gives the steady state of the same traffic (the second
      half of the warm-up just before its change: ``steady_recomputed_share``) and what the
      rollout cost beyond it (``excess_recomputed_tokens`` / ``_share``):
      new sessions and un-cached answers are recomputed with or without a
      rollout.
    * The JSON has ``warm_canary`` and ``blind_rolling`` (each with
      ``recomputed_tokens``, ``prompt_tokens``, ``ttft_p99_s``, ``errors``),
      ``promoted``, ``bad_revision_rolled_back`` and
      ``router_weight_latency_s`` (the slowest time from a weight change
      recorded in the resource's status to the router answering with it).
    * A cluster started here is stopped on exit; an existing one
      (``--kubeconfig``) keeps what was installed, in its own namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dscache_tools.demo.procs import terminate_on_sigterm
from dscache_tools.demo.run import pyplot
from dscache_tools.loadgen import LoadConfig, RequestResult, percentile, run_load
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    prewarm_requests,
    sessions_of,
)

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "04-dev-cluster" / "deepseekcachedeployment.yaml"
CHART = ROOT / "charts" / "dscache"
NAME = "finance"
#: ``spec.cache.minTokens`` of the bad revision: the schema's maximum, nothing is admitted.
NO_CACHE_MIN_TOKENS = 1 << 20


@dataclass(frozen=True)
class KubeDemoOptions:
    """Knobs of ``dscache demo kubernetes``.

    Attributes:
        quick: the ~15-minute profile (shorter steps and settling).
        kubeconfig: use this cluster (its nodes must run pods and hold the
            dscache images); None starts a dev cluster with a real node.
        prometheus_url: Prometheus the operator queries (None: the dev
            cluster's, or ``$DSCACHE_PROMETHEUS_URL``).
        namespace: where the demo's resource runs (deleted at the end).
        operator_namespace: the Helm release's namespace.
        concurrency: live sessions (users in a conversation at once).
        think_s: mean pause of a user between an answer and the next question.
        seed: workload seed.
        interval_s: rollout step interval (None: the profile's).
        settle_s: seconds measured after each rollout completes (None: profile).
        workdir: where logs and the load reports go (None: a temp dir).
    """

    quick: bool = False
    kubeconfig: Path | None = None
    prometheus_url: str | None = None
    namespace: str = "dscache-demo"
    operator_namespace: str = "dscache-system"
    concurrency: int = 48
    think_s: float = 15.0
    seed: int = 0
    interval_s: int | None = None
    settle_s: float | None = None
    workdir: Path | None = None

    @property
    def step_interval_s(self) -> int:
        """Seconds per rollout step."""
        return self.interval_s or (40 if self.quick else 90)

    @property
    def settle(self) -> float:
        """Seconds measured after a rollout completed."""
        return self.settle_s if self.settle_s is not None else (30.0 if self.quick else 60.0)

    @property
    def warmup_s(self) -> float:
        """Seconds of traffic before each measured rollout."""
        return 45.0 if self.quick else 90.0


# --------------------------------------------------------------------- cluster access


@dataclass
class Cluster:
    """kubectl and helm against one cluster, plus a Kubernetes API client for polling."""

    kubeconfig: Path
    kubectl_bin: str
    helm_bin: str
    prometheus_url: str

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def run(self, tool: str, *args: str, stdin: str | None = None, check: bool = True) -> str:
        exe = self.kubectl_bin if tool == "kubectl" else self.helm_bin
        done = subprocess.run(
            [exe, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=600,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        return self.run("kubectl", *args, stdin=stdin, check=check)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))


class Api:
    """Cheap polling (a kubectl per poll would eat a core): GETs of JSON over one client."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import config

        self.api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig)
        )

    def get(self, path: str, query: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
        """The decoded JSON of ``GET path``."""
        method, url, headers, body, _ = self.api.param_serialize(
            "GET",
            path,
            query_params=list(query),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        reply = self.api.call_api(method, url, headers, body, _request_timeout=10)
        raw = reply.read()
        if not 200 <= reply.status <= 299:
            raise RuntimeError(f"GET {path}: HTTP {reply.status}")
        data: dict[str, Any] = json.loads(raw)
        return data

    def dscd(self, namespace: str) -> dict[str, Any]:
        return self.get(
            f"/apis/dscache.io/v1alpha1/namespaces/{namespace}/deepseekcachedeployments/{NAME}"
        )

    def deployment_status(self, namespace: str, name: str) -> dict[str, Any]:
        d = self.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")
        st = d.get("status") or {}
        return {
            "replicas": int(d["spec"].get("replicas", 1)),
            "updated": int(st.get("updatedReplicas") or 0),
            "ready": int(st.get("readyReplicas") or 0),
            "available": int(st.get("availableReplicas") or 0),
            "total": int(st.get("replicas") or 0),
        }

    def router_ips(self, namespace: str) -> list[str]:
        selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=router"
        pods = self.get(f"/api/v1/namespaces/{namespace}/pods", [("labelSelector", selector)])
        out = []
        for p in pods.get("items", []):
            st = p.get("status") or {}
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in st.get("conditions") or ()
            )
            if st.get("podIP") and ready and not p["metadata"].get("deletionTimestamp"):
                out.append(str(st["podIP"]))
        return sorted(out)

    def service_url(self, namespace: str, name: str) -> str:
        svc = self.get(f"/api/v1/namespaces/{namespace}/services/{name}")
        return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"


@contextlib.contextmanager
def cluster_for(opts: KubeDemoOptions, say: Callable[[str], None]) -> Iterator[Cluster]:
    """The cluster to run on: ``opts.kubeconfig``'s, a running dev cluster's, or a new one."""
    from dscache_tools.devcluster import DevCluster, default_state_dir, ensure_built, locate

    bins = locate()
    if opts.kubeconfig is not None:
        url = opts.prometheus_url or os.environ.get("DSCACHE_PROMETHEUS_URL")
        if not url:
            raise RuntimeError(
                "with --kubeconfig, give --prometheus-url (or DSCACHE_PROMETHEUS_URL)"
            )
        yield Cluster(
            opts.kubeconfig,
            shutil.which("kubectl") or str(bins.kubectl),
            shutil.which("helm") or str(bins.helm),
            url,
        )
        return
    running = DevCluster.load(default_state_dir())
    if running is not None and running.running() and running.real_nodes:
        say(f"using the dev cluster running from {running.state_dir}")
        if not (opts.prometheus_url or running.prometheus_url):
            raise RuntimeError("that dev cluster runs no Prometheus: start it with --prometheus")
        yield Cluster(
            running.kubeconfig,
            str(running.binaries.kubectl),
            str(running.binaries.helm),
            opts.prometheus_url or running.prometheus_url or "",
        )
        return
    from dscache_tools.devcluster.images import image_loader

    binaries = ensure_built(progress=say)
    loader = image_loader(progress=say)
    prometheus = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if prometheus is None:
        raise RuntimeError("the demo needs Debian's Prometheus: apt-get install prometheus")
    workdir = _workdir(opts)
    say("starting a dev cluster with one real node")
    cluster = DevCluster.start(
        workdir / "cluster",
        node_count=1,
        real_nodes=1,
        load_images=loader,
        prometheus_binary=prometheus,
        binaries=binaries,
        tie_to_parent=True,
        timeout=120,
    )
    try:
        yield Cluster(
            cluster.kubeconfig,
            str(binaries.kubectl),
            str(binaries.helm),
            cluster.prometheus_url or "",
        )
    finally:
        cluster.stop(keep_logs=True)


def _workdir(opts: KubeDemoOptions) -> Path:
    if opts.workdir is not None:
        opts.workdir.mkdir(parents=True, exist_ok=True)
        return opts.workdir
    import tempfile

    return Path(tempfile.mkdtemp(prefix="dscache-demo-kube-"))


# --------------------------------------------------------------------- the resource


def resource(opts: KubeDemoOptions, revision: str, min_tokens: int | None = None) -> dict[str, Any]:
    """The demo's resource: the CPU-sized example with this run's interval and revision."""
    import yaml

    obj: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = obj["spec"]
    spec["model"]["revision"] = revision
    spec["rollout"]["interval"] = f"{opts.step_interval_s}s"
    if min_tokens is not None:
        spec["cache"]["minTokens"] = min_tokens
    obj["metadata"]["namespace"] = opts.namespace
    return obj


def prewarm_configmap(namespace: str, warm: Sequence[ChatRequest]) -> dict[str, Any]:
    """ConfigMap ``finance-prompts``: each company's shared prefix, one chat per line."""
    lines = [json.dumps({"messages": r.messages}, ensure_ascii=False) for r in warm]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "finance-prompts", "namespace": namespace},
        "data": {"prompts.jsonl": "\n".join(lines) + "\n"},
    }


def install(cluster: Cluster, opts: KubeDemoOptions, say: Callable[[str], None]) -> None:
    """Helm install (or upgrade) of the operator, then the demo namespace's objects."""
    say("helm install: the operator as a pod")
    cluster.run(
        "helm",
        "upgrade",
        "--install",
        "dscache",
        str(CHART),
        "--namespace",
        opts.operator_namespace,
        "--create-namespace",
        "--set",
        f"operator.prometheusUrl={cluster.prometheus_url}",
        "--set",
        "operator.tickSeconds=2",
        "--wait",
        "--timeout",
        "5m",
    )
    cluster.kubectl("create", "namespace", opts.namespace, check=False)


# --------------------------------------------------------------------- load and timeline


@dataclass
class Phase:
    """One measured rollout: the requests sent while it ran and what was seen."""

    name: str
    started: float  # perf_counter when the revision changed
    results: list[tuple[float, RequestResult]] = field(default_factory=list)
    #: (perf_counter, label, value) observations: weight, phase, updated pods
    events: list[tuple[float, str, Any]] = field(default_factory=list)
    completed: float | None = None
    #: the same traffic just before the change (the warm-up's second half, once
    #: the sessions that all started together are spread out): the steady state
    before: list[tuple[float, RequestResult]] = field(default_factory=list)


class LoadThread:
    """Replays sessions through the router in a thread until told to stop."""

    def __init__(
        self, target: str, workload: Sequence[ChatRequest], concurrency: int, think_s: float
    ) -> None:
        self.target = target
        self.workload = list(workload)
        self.concurrency = concurrency
        self.think_s = think_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.results: list[tuple[float, RequestResult]] = []
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> LoadThread:
        self._thread.start()
        return self

    def _record(self, res: RequestResult) -> None:
        with self._lock:
            self.results.append((time.perf_counter() - res.e2e_s, res))

    def _run(self) -> None:
        cfg = LoadConfig(
            target=self.target,
            concurrency=self.concurrency,
            timeout_s=300,
            progress=False,
            think_s=self.think_s,
        )
        try:
            asyncio.run(
                run_load(cfg, self.workload, on_result=self._record, should_stop=self._stop.is_set)
            )
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def since(self, t: float) -> list[tuple[float, RequestResult]]:
        with self._lock:
            return [(s, r) for s, r in self.results if s >= t]

    def before(self, t: float, seconds: float) -> list[tuple[float, RequestResult]]:
        """Requests started in the ``seconds`` before ``t``."""
        with self._lock:
            return [(s, r) for s, r in self.results if t - seconds <= s < t]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=600)
        if self.error is not None:
            raise RuntimeError(f"the load generator failed: {self.error}") from self.error


def router_weight(ip: str) -> float | None:
    """The canary weight a router pod serves (its status endpoint), or None."""
    try:
        with urllib.request.urlopen(f"http://{ip}:8080/dscache/router/status", timeout=2) as reply:
            return float(json.loads(reply.read())["canary_weight"])
    except (OSError, ValueError, KeyError):
        return None


class Watcher:
    """Polls the resource, the model Deployments and the routers while a rollout runs."""

    def __init__(self, api: Api, namespace: str, phase: Phase) -> None:
        self.api = api
        self.namespace = namespace
        self.phase = phase
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)
        self.last: dict[str, Any] = {}

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _note(self, label: str, value: Any) -> None:
        if self.last.get(label) != value:
            self.last[label] = value
            self.phase.events.append((time.perf_counter(), label, value))

    def _run(self) -> None:
        pending: tuple[float, float] | None = None  # (when the status changed, weight)
        while not self._stop.is_set():
            try:
                status = self.api.dscd(self.namespace).get("status") or {}
                weight = float(status.get("weight") or 0)
                if "weight" in self.last and self.last["weight"] != weight:
                    pending = (time.perf_counter(), weight)
                self._note("weight", weight)
                self._note("phase", status.get("phase"))
                self._note("stable", status.get("stableRevision"))
                analysis = status.get("lastAnalysis") or {}
                self._note("analysis", (analysis.get("weight"), analysis.get("result")))
                for slot in ("blue", "green"):
                    with contextlib.suppress(Exception):
                        d = self.api.deployment_status(self.namespace, f"{NAME}-{slot}")
                        self._note(f"{slot}_updated", (d["updated"], d["ready"], d["total"]))
                if pending is not None:
                    ips = self.api.router_ips(self.namespace)
                    served = [router_weight(ip) for ip in ips]
                    if ips and all(w == pending[1] for w in served):
                        self.latencies.append(time.perf_counter() - pending[0])
                        pending = None
            except Exception as exc:  # a poll that failed is retried on the next tick
                log.debug("watch: %s", exc)
            self._stop.wait(0.25)


# --------------------------------------------------------------------- figures


def figures(results: Sequence[tuple[float, RequestResult]]) -> dict[str, Any]:
    """What the client saw over ``results``."""
    ok = [r for _, r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": len(results),
        "errors": sum(not r.ok for _, r in results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "recomputed_tokens": prompt - cached,
        "recomputed_share": (prompt - cached) / prompt if prompt else None,
        "token_hit_ratio": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
    }


def per_step(phase: Phase, label: str) -> list[dict[str, Any]]:
    """Hit rate of the requests started during each value of ``label`` (weight, pods)."""
    marks = [(t, v) for t, lab, v in phase.events if lab == label and t >= phase.started]
    first = [(phase.started, _value_at(phase, label, phase.started)), *marks]
    out = []
    for i, (t, value) in enumerate(first):
        end = first[i + 1][0] if i + 1 < len(first) else float("inf")
        chunk = [(s, r) for s, r in phase.results if t <= s < end]
        if not chunk:
            continue
        f = figures(chunk)
        out.append(
            {
                label: value,
                "from_s": round(t - phase.started, 1),
                "requests": f["requests"],
                "token_hit_ratio": f["token_hit_ratio"],
                "ttft_p99_s": f["ttft_p99_s"],
            }
        )
    return out


def _value_at(phase: Phase, label: str, t: float) -> Any:
    value = None
    for when, lab, v in phase.events:
        if lab == label and when <= t:
            value = v
    return value


# --------------------------------------------------------------------- the run


def _wait(what: str, probe: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _available(api: Api, ns: str, not_revision: str | None = None) -> bool:
    """Available, nothing rolling out, its router ready, and (if given) a stable revision
    other than ``not_revision``: the one that was stable before a change."""
    obj = api.dscd(ns)
    st = obj.get("status") or {}
    if st.get("phase") != "Available" or st.get("canaryRevision"):
        return False
    if st.get("observedGeneration") != obj["metadata"]["generation"]:
        return False
    if not_revision is not None and st.get("stableRevision") in (None, not_revision):
        return False
    slot = st.get("stableSlot")
    d = api.deployment_status(ns, f"{NAME}-{slot}")
    return bool(d["ready"] == d["replicas"] == d["total"] and api.router_ips(ns))


def run_kubernetes_demo(opts: KubeDemoOptions, say: Callable[[str], None]) -> dict[str, Any]:
    """Runs the whole demo and returns the report (see the module docstring)."""
    began = time.monotonic()
    # Far more sessions than any phase sends (about 3 requests a second here): the
    # load must never run dry while a gate waits for data.
    sessions_needed = 3600
    # Analysts' conversations run several turns (4-12 here), a user pauses between
    # them (think_s): many conversations are live at any moment, as in production.
    workload = generate(
        WorkloadConfig(
            sessions=sessions_needed,
            seed=opts.seed,
            companies=6,
            min_turns=4,
            max_turns=12,
            max_tokens=8,
        )
    )
    by_session = list(sessions_of(workload).values())
    third = len(by_session) // 3
    slices = [[r for s in by_session[i * third : (i + 1) * third] for r in s] for i in range(3)]
    warm = prewarm_requests(workload)
    report: dict[str, Any] = {"options": _options(opts)}
    with cluster_for(opts, say) as cluster:
        install(cluster, opts, say)
        ns = opts.namespace
        api = Api(cluster.kubeconfig)
        cluster.kubectl(
            "apply", "-f", "-", stdin=json.dumps(prewarm_configmap(ns, warm), ensure_ascii=False)
        )
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(resource(opts, "1")))
        say("waiting for the model pods, their sidecars and the router")
        _wait("the first revision to be Available", lambda: _available(api, ns), 900)
        target = f"http://{api.router_ips(ns)[0]}:8080"
        try:
            report.update(_scenarios(cluster, api, opts, target, slices, say=say))
        finally:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    report["wall_s"] = round(time.monotonic() - began, 1)
    return report


def _scenarios(
    cluster: Cluster,
    api: Api,
    opts: KubeDemoOptions,
    target: str,
    slices: Sequence[Sequence[ChatRequest]],
    *,
    say: Callable[[str], None],
) -> dict[str, Any]:
    ns = opts.namespace
    out: dict[str, Any] = {}

    # 1. The warm canary.
    load = LoadThread(target, slices[0], opts.concurrency, opts.think_s).start()
    say(f"warm-up traffic for {opts.warmup_s:.0f} s")
    time.sleep(opts.warmup_s)
    before = (api.dscd(ns).get("status") or {}).get("stableRevision")
    canary = Phase("warm_canary", time.perf_counter())
    watcher = Watcher(api, ns, canary).start()
    say("new revision 2: Deploying -> Prewarming -> 10/25/50/100%")
    _patch_dscd(cluster, ns, {"spec": {"model": {"revision": "2"}}})
    timeout = 600 + 8 * opts.step_interval_s
    promoted = True
    try:
        _wait(
            "revision 2 to be promoted",
            lambda: _available(api, ns, not_revision=before),
            timeout,
        )
    except TimeoutError as exc:
        promoted = False
        say(f"warning: {exc}")
    canary.completed = time.perf_counter()
    say(f"rollout done in {canary.completed - canary.started:.0f} s; {opts.settle:.0f} s more")
    time.sleep(opts.settle)
    watcher.stop()
    canary.results = [x for x in load.since(canary.started) if x[0] < time.perf_counter()]
    canary.before = load.before(canary.started, opts.warmup_s / 2)
    load.stop()
    out["promoted"] = promoted
    out["warm_canary"] = _phase_report(canary, "weight")
    latencies = list(watcher.latencies)

    # 2. A revision that cannot hit: rolled back by the gate at its first step.
    load = LoadThread(target, slices[1], opts.concurrency, opts.think_s).start()
    bad = Phase("bad_revision", time.perf_counter())
    watcher = Watcher(api, ns, bad).start()
    say("bad revision (the cache admits nothing): the gate must roll it back")
    min_tokens = api.dscd(ns)["spec"]["cache"].get("minTokens")
    _patch_dscd(cluster, ns, {"spec": {"cache": {"minTokens": NO_CACHE_MIN_TOKENS}}})

    def rolled_back() -> Any:
        st = api.dscd(ns).get("status") or {}
        return st if st.get("phase") == "RolledBack" or st.get("rolledBackRevision") else None

    try:
        st = _wait(
            "the bad revision to be rolled back", rolled_back, 600 + 4 * opts.step_interval_s
        )
        out["bad_revision_rolled_back"] = True
        out["bad_revision"] = {
            "last_analysis": st.get("lastAnalysis"),
            "conditions": [c for c in st.get("conditions", []) if c.get("type") == "RolledBack"],
            "seconds": round(time.perf_counter() - bad.started, 1),
        }
    except TimeoutError as exc:
        out["bad_revision_rolled_back"] = False
        say(f"warning: {exc}")
    watcher.stop()
    latencies += watcher.latencies
    # Back to the stable revision's exact spec (a removed field would take the
    # schema's default: another revision, another rollout).
    restore = (
        {"op": "replace", "path": "/spec/cache/minTokens", "value": min_tokens}
        if min_tokens is not None
        else {"op": "remove", "path": "/spec/cache/minTokens"}
    )
    cluster.kubectl("patch", "dscd", NAME, "-n", ns, "--type", "json", "-p", json.dumps([restore]))
    _wait("the resource back to its stable revision", lambda: _available(api, ns), timeout)
    say(f"warm-up traffic for {opts.warmup_s:.0f} s")
    time.sleep(opts.warmup_s)
    load.stop()

    # 3. A plain rolling update of the stable track's Deployment, blind to its cache.
    load = LoadThread(target, slices[2], opts.concurrency, opts.think_s).start()
    time.sleep(opts.warmup_s)
    if not _available(api, ns):
        raise RuntimeError("the resource is rolling out again: the blind update would race it")
    slot = (api.dscd(ns).get("status") or {}).get("stableSlot")
    deployment = f"{NAME}-{slot}"
    blind = Phase("blind_rolling", time.perf_counter())
    watcher = Watcher(api, ns, blind).start()
    say(f"blind rolling update of deployment/{deployment} to model revision 3")
    _patch_revision(cluster, ns, deployment, "3")
    time.sleep(2)
    cluster.kubectl(
        "rollout", "status", f"deployment/{deployment}", "-n", ns, f"--timeout={timeout}s"
    )
    blind.completed = time.perf_counter()
    say(f"rolling update done in {blind.completed - blind.started:.0f} s; {opts.settle:.0f} s more")
    time.sleep(opts.settle)
    watcher.stop()
    # The operator keeps the router's pod list current (the new pods have new
    # addresses) and, owning the Deployment, later puts its own template back: a
    # second rolling update that is not part of this one. The window ends there.
    end = _restore_started(blind, f"{slot}_updated")
    blind.results = [x for x in load.since(blind.started) if end is None or x[0] < end]
    blind.before = load.before(blind.started, opts.warmup_s / 2)
    load.stop()
    out["blind_rolling"] = _phase_report(blind, f"{slot}_updated")
    out["blind_rolling"]["template_restored_at_s"] = (
        None if end is None else round(end - blind.started, 1)
    )
    out["router_weight_latency_s"] = round(max(latencies), 2) if latencies else None
    out["router_weight_latency_samples_s"] = [round(x, 2) for x in latencies]
    out["ratios"] = _ratios(out["warm_canary"], out["blind_rolling"])
    out["timeline"] = {
        "warm_canary": _timeline(canary),
        "blind_rolling": _timeline(blind),
    }
    return out


def _restore_started(phase: Phase, label: str) -> float | None:
    """When a second rolling update began after ``phase`` completed, if one did.

    ``label`` events are (updated, ready, total) pods of the Deployment: a new
    rollout shows as fewer updated pods than pods.
    """
    if phase.completed is None:
        return None
    for t, lab, value in phase.events:
        if lab == label and t > phase.completed and value[0] < value[2]:
            return t
    return None


def _patch_dscd(cluster: Cluster, ns: str, patch: dict[str, Any]) -> None:
    """A merge patch of the demo's resource, as a person would apply it."""
    cluster.kubectl("patch", "dscd", NAME, "-n", ns, "--type", "merge", "-p", json.dumps(patch))


def _patch_revision(cluster: Cluster, ns: str, deployment: str, revision: str) -> None:
    """Sets ``--revision`` of the server container in place, as a person would."""
    d = cluster.get("deployment", deployment, "-n", ns)
    containers = d["spec"]["template"]["spec"]["containers"]
    index = next(i for i, c in enumerate(containers) if c["name"] == "server")
    args = list(containers[index]["args"])
    if "--revision" in args:
        args[args.index("--revision") + 1] = revision
    else:
        args += ["--revision", revision]
    patch = [
        {"op": "replace", "path": f"/spec/template/spec/containers/{index}/args", "value": args}
    ]
    cluster.kubectl(
        "patch", "deployment", deployment, "-n", ns, "--type", "json", "-p", json.dumps(patch)
    )


def _phase_report(phase: Phase, label: str) -> dict[str, Any]:
    f = figures(phase.results)
    f["rollout_s"] = (
        round(phase.completed - phase.started, 1) if phase.completed is not None else None
    )
    f["window_s"] = round(
        max((s for s, _ in phase.results), default=phase.started) - phase.started, 1
    )
    f["per_step"] = per_step(phase, label)
    # What the rollout itself cost: recomputation beyond the steady state's share.
    steady = figures(phase.before)
    f["steady_recomputed_share"] = steady["recomputed_share"]
    f["steady_requests"] = steady["requests"]
    if steady["recomputed_share"] is not None and f["recomputed_share"] is not None:
        excess = f["recomputed_tokens"] - steady["recomputed_share"] * f["prompt_tokens"]
        f["excess_recomputed_tokens"] = round(excess)
        f["excess_recomputed_share"] = excess / f["prompt_tokens"] if f["prompt_tokens"] else None
    else:
        f["excess_recomputed_tokens"] = f["excess_recomputed_share"] = None
    return f


def _ratios(canary: dict[str, Any], blind: dict[str, Any]) -> dict[str, float | None]:
    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    def excess(part: dict[str, Any]) -> float | None:
        # Below the steady state is noise, not a negative cost.
        x = part["excess_recomputed_share"]
        return None if x is None else max(0.0, x)

    return {
        "recomputed_tokens": div(canary["recomputed_tokens"], blind["recomputed_tokens"]),
        "recomputed_share": div(canary["recomputed_share"], blind["recomputed_share"]),
        "excess_recomputed_share": div(excess(canary), excess(blind)),
        "ttft_p99": div(canary["ttft_p99_s"], blind["ttft_p99_s"]),
    }


def _timeline(phase: Phase) -> dict[str, Any]:
    return {
        "events": [
            {"t_s": round(t - phase.started, 2), "what": label, "value": value}
            for t, label, value in phase.events
        ],
        "requests": [
            {
                "t_s": round(s - phase.started, 2),
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "ttft_s": r.ttft_s,
                "ok": r.ok,
            }
            for s, r in phase.results
        ],
    }


def _options(opts: KubeDemoOptions) -> dict[str, Any]:
    return {
        "quick": opts.quick,
        "concurrency": opts.concurrency,
        "think_s": opts.think_s,
        "seed": opts.seed,
        "interval_s": opts.step_interval_s,
        "settle_s": opts.settle,
        "warmup_s": opts.warmup_s,
    }


# --------------------------------------------------------------------- output

TARGETS = {"recomputed_share": 0.3, "ttft_p99": 0.5}


def format_table(report: dict[str, Any]) -> str:
    """The rollout comparison (markdown)."""
    a, b = report["warm_canary"], report["blind_rolling"]

    def cell(value: Any, kind: str) -> str:
        if value is None:
            return "-"
        if kind == "s":
            return f"{value:.2f} s"
        if kind == "ratio":
            return f"{value:.3f}"
        if isinstance(value, float):
            return f"{value:,.0f}"
        return f"{value:,}"

    def ratio(x: Any, y: Any) -> str:
        return f"{x / y:.2f}x" if isinstance(x, (int, float)) and y else "-"

    rows = [
        ("rollout (revision change to done)", "rollout_s", "s"),
        ("requests in the window", "requests", "n"),
        ("prompt tokens", "prompt_tokens", "n"),
        ("recomputed prompt tokens", "recomputed_tokens", "n"),
        ("recomputed share", "recomputed_share", "ratio"),
        ("recomputed share before the change", "steady_recomputed_share", "ratio"),
        ("recomputed beyond that share", "excess_recomputed_share", "ratio"),
        ("token hit ratio", "token_hit_ratio", "ratio"),
        ("TTFT P50", "ttft_p50_s", "s"),
        ("TTFT P99", "ttft_p99_s", "s"),
        ("errors", "errors", "n"),
    ]
    lines = [
        "| | warm canary | blind rolling update | canary / blind |",
        "|---|---:|---:|---:|",
    ]
    for title, key, kind in rows:
        r = ratio(a.get(key), b.get(key)) if key not in ("requests", "rollout_s") else ""
        if key == "excess_recomputed_share":
            x = report["ratios"].get(key)
            r = "-" if x is None else f"{x:.2f}x"
        lines.append(f"| {title} | {cell(a.get(key), kind)} | {cell(b.get(key), kind)} | {r} |")
    lines.append("")
    lines.append("canary steps (requests started at each weight):")
    for step in a["per_step"]:
        hr = step["token_hit_ratio"]
        lines.append(
            f"  weight {step['weight']}: from {step['from_s']:>6.1f} s, {step['requests']} "
            f"requests, token hit {'-' if hr is None else f'{hr:.3f}'}"
        )
    lines.append("blind rolling update (updated, ready, total pods):")
    for step in b["per_step"]:
        label = next(k for k in step if k.endswith("_updated"))
        hr = step["token_hit_ratio"]
        lines.append(
            f"  pods {step[label]}: from {step['from_s']:>6.1f} s, {step['requests']} requests, "
            f"token hit {'-' if hr is None else f'{hr:.3f}'}"
        )
    lines.append("")
    lines.append(f"good revision promoted: {report['promoted']}")
    lines.append(f"bad revision rolled back by the gate: {report['bad_revision_rolled_back']}")
    latency = report.get("router_weight_latency_s")
    lines.append(
        "weight change to the router serving it: "
        + (
            "-"
            if latency is None
            else f"{latency:.2f} s (slowest of {len(report['router_weight_latency_samples_s'])})"
        )
    )
    for key, goal in TARGETS.items():
        value = report["ratios"].get(key)
        met = value is not None and value <= goal
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"target {key} canary/blind <= {goal}: {shown} {'met' if met else 'MISSED'}")
    return "\n".join(lines)


def write_png(report: dict[str, Any], path: Path) -> None:
    """Weights and hit rates over time for both rollouts, as a PNG."""
    plt = pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(14, 8), sharex="col")
    for col, (key, title) in enumerate(
        (("warm_canary", "cache-warmth-aware canary"), ("blind_rolling", "blind rolling update"))
    ):
        tl = report["timeline"][key]
        top, bottom = axes[0][col], axes[1][col]
        if key == "warm_canary":
            pts = [(e["t_s"], e["value"]) for e in tl["events"] if e["what"] == "weight"]
            ylabel = "canary weight (% of new sessions)"
        else:
            pts = [
                (e["t_s"], 100.0 * e["value"][0] / max(1, e["value"][2]))
                for e in tl["events"]
                if e["what"].endswith("_updated") and e["value"][2]
            ]
            ylabel = "updated pods (%)"
        if pts:
            xs = [p[0] for p in pts] + [max((r["t_s"] for r in tl["requests"]), default=0)]
            ys = [p[1] for p in pts] + [pts[-1][1]]
            top.step(xs, ys, where="post", color="#2980b9")
        top.set_ylim(-5, 105)
        top.set_ylabel(ylabel)
        top.set_title(title)
        top.grid(alpha=0.3)
        bins: dict[int, list[dict[str, Any]]] = {}
        for r in tl["requests"]:
            bins.setdefault(int(r["t_s"] // 15), []).append(r)
        xs, hit, p99 = [], [], []
        for b_, rs in sorted(bins.items()):
            ok = [r for r in rs if r["ok"]]
            prompt = sum(r["prompt_tokens"] for r in ok)
            xs.append(b_ * 15 + 7.5)
            hit.append(sum(r["cached_tokens"] for r in ok) / prompt if prompt else float("nan"))
            p99.append(percentile([r["ttft_s"] for r in ok if r["ttft_s"] is not None], 99) or 0)
        bottom.plot(xs, hit, "o-", color="#27ae60", label="token hit ratio (15 s bins)")
        bottom.set_ylim(0, 1.05)
        bottom.set_xlabel("seconds since the revision change")
        bottom.set_ylabel("token hit ratio")
        bottom.grid(alpha=0.3)
        twin = bottom.twinx()
        twin.plot(xs, p99, "s--", color="#c0392b", label="TTFT P99 (15 s bins)")
        twin.set_ylabel("TTFT P99 (s)")
        lines = bottom.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ratios = report["ratios"]
    fig.suptitle(
        "dscache demo kubernetes: recomputed share canary/blind "
        f"{ratios['recomputed_share']}, TTFT P99 canary/blind {ratios['ttft_p99']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(opts: KubeDemoOptions, json_out: Path | None, png_out: Path | None) -> int:
    """Runs the demo, prints the comparison, writes JSON and PNG; returns the exit code."""

    def say(line: str) -> None:
        print(f"[demo kubernetes] {line}", flush=True)

    try:
        with terminate_on_sigterm():  # a killed demo still stops its cluster
            report = run_kubernetes_demo(opts, say)
    except KeyboardInterrupt:
        return 130
    print()
    print(format_table(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nJSON written to {json_out}")
    if png_out is not None:
        write_png(report, png_out)
        print(f"PNG written to {png_out}")
    print(f"demo took {report['wall_s']:.0f} s")
    ok = report["promoted"] and report["bad_revision_rolled_back"]
    return 0 if ok else 1
