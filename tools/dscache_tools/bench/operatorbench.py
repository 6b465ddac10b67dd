"""``dscache bench operator``: many DeepSeekCacheDeployments rolling out at once.

A dev cluster's real control plane with ``nodes`` simulated (KWOK) nodes, the
chart's CRDs and RBAC (its in-cluster operator scaled to zero), and the operator
as two peered local processes (``dscache operator --all-namespaces --peering``:
the chart's two replicas, one acting, one standing by). The bench creates
``resources`` DeepSeekCacheDeployments across ``namespaces`` namespaces (two model
pods and one router pod each, on the simulated nodes, where pods run no process),
waits until every one is Available, then changes every model revision at once
and follows the rollouts (canary 50/100%, prewarm and analysis off: no model
answers on a simulated node, and the gates have tests of their own) to the end.

What it measures, over the wave:

* reconcile latency: from a resource's spec change (its patch answered) to the
  first child of the new revision written (its model Deployment seen by a
  watch), P50 and P99;
* the acting operator's peak RSS (sampled every 0.5 s) and both replicas' CPU
  seconds, also per reconcile;
* API requests per reconcile: the operator's own counters,
  ``dscache_operator_api_requests_total`` over ``dscache_operator_reconciles_total``;
* stuck rollouts: resources not Available on the new revision within the timeout.

JSON: ``resources``, ``namespaces``, ``nodes``, ``reconcile_p50_s``,
``reconcile_p99_s``, ``operator_rss_mib``, ``operator_cpu_s``,
``operator_cpu_s_per_reconcile``, ``reconciles``, ``api_requests``,
``api_requests_per_reconcile``, ``rollout_s`` (the last resource's), ``stuck_rollouts``
``standby_reconciles`` (over the wave; 0: the standby did nothing) and
``max_workers`` (the operator's handler threads, ``$DSCACHE_OPERATOR_MAX_WORKERS``
or its default).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dscache_tools.bench import Doc, report
from dscache_tools.chaos.counters import counter_total
from dscache_tools.devcluster.nodes import SIMULATED_PLACEMENT
from dscache_tools.loadgen import percentile
from dscache_tools.procs import Child, ProcessGroup, terminate_on_sigterm

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
CHART_NS = "dscache-system"
PEERING = "dscache-bench"


@dataclass(frozen=True)
class Profile:
    """How big a run is."""

    resources: int
    namespaces: int
    nodes: int
    timeout_s: float


#: The issue's scale: 50 resources in 10 namespaces on 200 nodes. ``--quick`` keeps
#: the scale and gives the wave less time.
FULL = Profile(resources=50, namespaces=10, nodes=200, timeout_s=900.0)
QUICK = Profile(resources=50, namespaces=10, nodes=200, timeout_s=420.0)


class BenchError(RuntimeError):
    """The bench could not run (the message says where)."""


def resource_doc(name: str, revision: str) -> dict[str, Any]:
    """One DeepSeekCacheDeployment of the bench, its pods on simulated nodes."""
    return {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DeepSeekCacheDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"preset": "tiny-gqa", "revision": revision},
            "replicas": 2,
            "routing": {"replicas": 1},
            "prewarm": {"enabled": False},
            "rollout": {
                "steps": [50, 100],
                "interval": "5s",
                "rollbackWindow": "1m",
                "analysis": {"enabled": False},
            },
            "scheduling": SIMULATED_PLACEMENT,
        },
    }


class Operators:
    """The two peered operator replicas, their metrics and their resources."""

    def __init__(self, group: ProcessGroup, env: dict[str, str]) -> None:
        from dscache_tools.net import free_port

        self.ports: list[int] = []
        self.children: list[Child] = []
        for name in ("a", "b"):
            port = free_port()
            child = group.start(
                f"operator-{name}",
                [
                    sys.executable,
                    "-m",
                    "dscache.cli",
                    "operator",
                    "--all-namespaces",
                    "--peering",
                    PEERING,
                    "--health-port",
                    "0",
                    "--metrics-port",
                    str(port),
                ],
                env=env,
            )
            self.ports.append(port)
            self.children.append(child)

    def counters(self, i: int) -> dict[str, float]:
        """Replica ``i``'s reconciles and API requests (0 before it serves metrics)."""
        import httpx

        try:
            text = httpx.get(f"http://127.0.0.1:{self.ports[i]}/metrics", timeout=5).text
        except httpx.HTTPError:
            text = ""
        return {
            "reconciles": counter_total(text, "dscache_operator_reconciles") or 0.0,
            "api_requests": counter_total(text, "dscache_operator_api_requests") or 0.0,
        }

    def cpu_s(self) -> float:
        """CPU seconds both replicas used so far."""
        import psutil

        total = 0.0
        for c in self.children:
            t = psutil.Process(c.pid).cpu_times()
            total += t.user + t.system
        return total

    def rss_mib(self, i: int) -> float:
        import psutil

        return float(psutil.Process(self.children[i].pid).memory_info().rss) / (1 << 20)


class FirstChildWatch:
    """Watches model Deployments; remembers when each resource's first one carrying
    ``revision`` was seen (the reconcile's first child of the new revision)."""

    def __init__(self, api: Any, revision: str) -> None:
        self._api, self._revision = api, revision
        self.seen: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)
        self._ready = threading.Event()

    def start(self) -> FirstChildWatch:
        self._thread.start()
        if not self._ready.wait(30):
            raise BenchError("the Deployment watch did not start")
        return self

    def _run(self) -> None:
        from kubernetes import client, watch

        apps = client.AppsV1Api(self._api)
        marker = f'"{self._revision}"'
        selector = "app.kubernetes.io/component=model"
        while not self._stop.is_set():
            listing = apps.list_deployment_for_all_namespaces(label_selector=selector)
            version = listing.metadata.resource_version if listing.metadata else None
            self._ready.set()
            w = watch.Watch()  # type: ignore[no-untyped-call]
            try:
                for event in w.stream(  # type: ignore[no-untyped-call]
                    apps.list_deployment_for_all_namespaces,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=30,
                ):
                    now = time.monotonic()
                    dep = event["object"]
                    template = self._api.sanitize_for_serialization(dep.spec.template)
                    if marker in json.dumps(template):
                        owner = dep.metadata.labels.get("app.kubernetes.io/instance", "")
                        self.seen.setdefault((dep.metadata.namespace, owner), now)
                    if self._stop.is_set():
                        break
            except Exception as exc:  # a dropped watch: list again and go on
                log.debug("deployment watch restarted: %s", exc)
            finally:
                w.stop()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        self._stop.set()


class RssSampler:
    """Samples a value every ``period_s`` on a thread; keeps the peak."""

    def __init__(self, sample: Callable[[], float], period_s: float = 0.5) -> None:
        self.peak = 0.0
        self._sample, self._period = sample, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.peak = max(self.peak, self._sample())
            except Exception as exc:  # the process went away: the bench will say so
                log.debug("rss sample failed: %s", exc)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@contextmanager
def _cluster(workdir: Path, nodes: int) -> Iterator[Any]:
    from dscache_tools.devcluster import DevCluster, ensure_built

    binaries = ensure_built(progress=lambda line: print(f"[bench operator] {line}", flush=True))
    cluster = DevCluster.start(
        workdir / "cluster",
        node_count=nodes,
        binaries=binaries,
        tie_to_parent=True,
        timeout=180.0,
    )
    try:
        yield cluster
    finally:
        cluster.stop(keep_logs=True)


def _status(custom: Any, ns: str, name: str) -> dict[str, Any]:
    obj = custom.get_namespaced_custom_object(
        "dscache.io", "v1alpha1", ns, "deepseekcachedeployments", name
    )
    st: dict[str, Any] = obj.get("status") or {}
    return st


def _settled(st: dict[str, Any]) -> bool:
    """Available with no rollout in flight."""
    return st.get("phase") == "Available" and not st.get("canaryRevision")


def _wait_all(
    custom: Any, names: list[tuple[str, str]], deadline: float, ok: Callable[..., bool]
) -> dict[tuple[str, str], float]:
    """Polls every resource's status until ``ok(key, status)`` holds for all of them
    or ``deadline`` passes; returns when each was first seen so."""
    done: dict[tuple[str, str], float] = {}
    while time.monotonic() < deadline and len(done) < len(names):
        for nn in names:
            if nn not in done and ok(nn, _status(custom, *nn)):
                done[nn] = time.monotonic()
        time.sleep(1.0)
    return done


def _spread(profile: Profile) -> list[tuple[str, str]]:
    """(namespace, name) of every resource: ``resources`` spread over ``namespaces``."""
    return [
        (f"bench-{i % profile.namespaces}", f"chat-{i // profile.namespaces}")
        for i in range(profile.resources)
    ]


def _install(cluster: Any, names: list[tuple[str, str]]) -> Any:
    """The chart (CRDs, RBAC; its operator scaled to zero), the peering object and the
    namespaces; returns an API client."""
    from kubernetes import config

    cluster.install_chart(
        "dscache", ROOT / "charts" / "dscache", CHART_NS, {"operator.replicas": 0}
    )
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/deepseekcachedeployments.dscache.io"
    )
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering"}
    docs = [{**peering, "metadata": {"name": PEERING}}]
    docs += [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        for ns in sorted({ns for ns, _ in names})
    ]
    cluster.kubectl(
        "apply", "-f", "-", stdin=json.dumps({"kind": "List", "apiVersion": "v1", "items": docs})
    )
    return config.new_client_from_config(str(cluster.kubeconfig))  # type: ignore[no-untyped-call]


def _each(names: list[tuple[str, str]], fn: Callable[[tuple[str, str]], object]) -> None:
    """``fn`` on every resource, eight API calls at a time."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fn, names))


def _wave(
    api: Any, ops: Operators, names: list[tuple[str, str]], timeout_s: float
) -> dict[str, Any]:
    """Changes every model revision at once and follows the rollouts to the end."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    before = {nn: _status(custom, *nn).get("stableRevision") for nn in names}
    active = max(range(2), key=lambda i: ops.counters(i)["reconciles"])
    counts0, cpu0 = [ops.counters(i) for i in range(2)], ops.cpu_s()
    watch = FirstChildWatch(api, "r2").start()
    patched: dict[tuple[str, str], float] = {}

    def patch(nn: tuple[str, str]) -> None:
        custom.patch_namespaced_custom_object(
            "dscache.io", "v1alpha1", nn[0], "deepseekcachedeployments", nn[1],
            {"spec": {"model": {"revision": "r2"}}},
        )  # fmt: skip
        patched[nn] = time.monotonic()  # one key per thread: no lock needed

    print("[bench operator] every revision changed at once; following the rollouts", flush=True)
    t0 = time.monotonic()
    with RssSampler(lambda: ops.rss_mib(active)) as rss:
        _each(names, patch)
        done = _wait_all(
            custom,
            names,
            t0 + timeout_s,
            lambda nn, st: _settled(st) and st.get("stableRevision") not in (None, before[nn]),
        )
    watch.stop()
    counts1, cpu = [ops.counters(i) for i in range(2)], ops.cpu_s() - cpu0
    latencies = [watch.seen[nn] - patched[nn] for nn in names if nn in watch.seen]
    reconciles = sum(
        b["reconciles"] - a["reconciles"] for a, b in zip(counts0, counts1, strict=True)
    )
    requests = sum(
        b["api_requests"] - a["api_requests"] for a, b in zip(counts0, counts1, strict=True)
    )
    return {
        "children_written": len(latencies),
        "reconcile_p50_s": percentile(latencies, 50),
        "reconcile_p99_s": percentile(latencies, 99),
        "operator_rss_mib": round(rss.peak, 1),
        "operator_cpu_s": round(cpu, 2),
        "operator_cpu_s_per_reconcile": round(cpu / reconciles, 4) if reconciles else None,
        "reconciles": reconciles,
        "api_requests": requests,
        "api_requests_per_reconcile": round(requests / reconciles, 2) if reconciles else None,
        "rollout_s": round(max(done.values()) - t0, 1) if done else None,
        "stuck_rollouts": len(names) - len(done),
        # kopf's peering pauses the lower-priority replica; only a short overlap while
        # both start up can reconcile twice (optimistic concurrency keeps it safe).
        "standby_reconciles": counts1[1 - active]["reconciles"] - counts0[1 - active]["reconciles"],
    }


def run(profile: Profile, workdir: Path) -> Doc:
    """One run at ``profile``'s scale, its cluster and logs under ``workdir``."""
    from kubernetes import client

    # One line per HTTP request from the metrics scrapes would drown the progress.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = _spread(profile)
    with _cluster(workdir, profile.nodes) as cluster, ProcessGroup(workdir / "logs") as group:
        print(f"[bench operator] cluster up, {profile.nodes} simulated nodes", flush=True)
        api = _install(cluster, names)
        custom = client.CustomObjectsApi(api)
        env = cluster.env()
        paths = [ROOT / "operator", ROOT / "sidecar", ROOT]
        env["PYTHONPATH"] = ":".join([*map(str, paths), env.get("PYTHONPATH", "")])
        ops = Operators(group, env)
        _each(
            names,
            lambda nn: custom.create_namespaced_custom_object(
                "dscache.io", "v1alpha1", nn[0], "deepseekcachedeployments",
                resource_doc(nn[1], "r1"),
            ),
        )  # fmt: skip
        print(f"[bench operator] {len(names)} resources created", flush=True)
        deadline = time.monotonic() + profile.timeout_s
        ready = _wait_all(custom, names, deadline, lambda _nn, st: _settled(st))
        if len(ready) < len(names):
            raise BenchError(
                f"only {len(ready)} of {len(names)} resources became Available "
                f"(operator logs: {workdir / 'logs'})"
            )
        wave = _wave(api, ops, names, profile.timeout_s)
    from dscache_operator.settings import OperatorSettings

    return {
        "resources": len(names),
        "namespaces": profile.namespaces,
        "nodes": profile.nodes,
        "max_workers": OperatorSettings().max_workers,  # as the operators read it
        **wave,
    }


def run_bench(args: argparse.Namespace) -> Doc:
    """``--quick`` or the full profile, in ``--work-dir`` or a temporary directory."""
    profile = QUICK if args.quick else FULL
    if args.work_dir:
        return run(profile, Path(args.work_dir))
    with tempfile.TemporaryDirectory(prefix="dscache-bench-operator-") as tmp:
        return run(profile, Path(tmp))


def table(doc: Doc) -> str:
    """The printed table."""
    rows = [
        ("resources / namespaces / simulated nodes",
         f"{doc['resources']} / {doc['namespaces']} / {doc['nodes']}"),
        ("reconcile latency P50 / P99 (spec change to first child)",
         f"{_s(doc['reconcile_p50_s'])} / {_s(doc['reconcile_p99_s'])}"),
        ("acting operator's peak RSS", f"{doc['operator_rss_mib']} MiB"),
        ("operators' CPU over the wave (per reconcile)",
         f"{doc['operator_cpu_s']} s ({doc['operator_cpu_s_per_reconcile']} s)"),
        ("reconciles / API requests per reconcile",
         f"{doc['reconciles']:.0f} / {doc['api_requests_per_reconcile']}"),
        ("last rollout done after", _s(doc["rollout_s"])),
        ("stuck rollouts", str(doc["stuck_rollouts"])),
        ("standby's reconciles", f"{doc['standby_reconciles']:.0f}"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench operator``: the run, the table, the JSON (1 if it failed)."""
    with terminate_on_sigterm():
        return report("operator", lambda: run_bench(args), table, args.json_out, (BenchError,))
