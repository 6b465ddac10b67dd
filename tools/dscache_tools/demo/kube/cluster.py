"""The cluster the Kubernetes demo runs on, and what it applies and polls there.

Contract:
    * :func:`cluster_for` yields the cluster of ``--kubeconfig``, a running dev
      cluster with a real node, or a new one it stops on exit, whose node gets the
      images of the demo's engine only (:data:`.options.IMAGES`).
    * ``kubectl`` and ``helm`` change things (as a person would); polling goes
      through :class:`Api` (one HTTP client, no process per poll).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dscache_tools.demo.kube.options import (
    CHART,
    EXAMPLES,
    IMAGES,
    NAME,
    NO_CACHE_BLOCK_TOKENS,
    NO_CACHE_MIN_TOKENS,
    NO_PREFIX_CACHING,
    KubeDemoOptions,
)
from dscache_tools.workload import ChatRequest, prompts_jsonl


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
    loader = image_loader(progress=say, names=IMAGES[opts.engine])
    prometheus = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if prometheus is None:
        raise RuntimeError("the demo needs Debian's Prometheus: apt-get install prometheus")
    workdir = workdir_for(opts)
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


def workdir_for(opts: KubeDemoOptions) -> Path:
    if opts.workdir is not None:
        opts.workdir.mkdir(parents=True, exist_ok=True)
        return opts.workdir
    import tempfile

    return Path(tempfile.mkdtemp(prefix="dscache-demo-kube-"))


def resource(opts: KubeDemoOptions, revision: str, min_tokens: int | None = None) -> dict[str, Any]:
    """The demo's resource: the engine's CPU-sized example with this run's interval and
    revision."""
    import yaml

    obj: dict[str, Any] = yaml.safe_load(EXAMPLES[opts.engine].read_text())
    spec = obj["spec"]
    spec["model"]["revision"] = revision
    spec["rollout"]["interval"] = f"{opts.step_interval_s}s"
    # Each answer names the pod that served it: the demo counts sessions the router moved.
    spec["routing"] = {**spec.get("routing", {}), "replicas": opts.router_replicas}
    spec["routing"]["debugHeaders"] = True
    if min_tokens is not None:
        spec["cache"]["minTokens"] = min_tokens
    if opts.max_ttft_p99_ratio is not None:
        spec["rollout"]["analysis"]["maxTtftP99Ratio"] = opts.max_ttft_p99_ratio
    if opts.min_hit_rate_ratio is not None:
        spec["rollout"]["analysis"]["minHitRateRatio"] = opts.min_hit_rate_ratio
    obj["metadata"]["namespace"] = opts.namespace
    return obj


def bad_revision_patches(
    spec: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A revision that cannot hit, from the live ``spec``: the merge patch that makes it
    and the JSON patch that restores the stable revision's exact spec.

    The reference engine: ``cache.minTokens`` at the schema's maximum (the cache
    admits nothing). vLLM: ``cache.blockTokens`` longer than any prompt (no whole
    block: dscache stores and loads nothing) and vLLM's own prefix cache off.
    Restoring puts every changed field back as it was (a field removed would take
    the schema's default: another revision, another rollout).
    """

    def back(path: str, old: Any) -> dict[str, Any]:
        if old is None:
            return {"op": "remove", "path": path}
        return {"op": "replace", "path": path, "value": old}

    cache = spec.get("cache") or {}
    if spec.get("engine") == "vllm":
        args = list((spec.get("vllm") or {}).get("args") or [])
        patch = {
            "spec": {
                "cache": {"blockTokens": NO_CACHE_BLOCK_TOKENS},
                "vllm": {"args": [*args, NO_PREFIX_CACHING]},
            }
        }
        restore = [
            back("/spec/cache/blockTokens", cache.get("blockTokens")),
            back("/spec/vllm/args", args or None),
        ]
        return patch, restore
    patch = {"spec": {"cache": {"minTokens": NO_CACHE_MIN_TOKENS}}}
    return patch, [back("/spec/cache/minTokens", cache.get("minTokens"))]


def prewarm_configmap(namespace: str, warm: Sequence[ChatRequest]) -> dict[str, Any]:
    """ConfigMap ``finance-prompts``: each company's shared prefix, one chat per line."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "finance-prompts", "namespace": namespace},
        "data": {"prompts.jsonl": prompts_jsonl(warm)},
    }


#: The demo operator's ``reapplySeconds``: longer than the demo (see :func:`install`).
DRIFT_REPAIR_S = 3600


def install(cluster: Cluster, opts: KubeDemoOptions, say: Callable[[str], None]) -> None:
    """Helm install (or upgrade) of the operator, then the demo namespace's objects.

    An operator already installed keeps the values it was installed with (its
    admin's policy: host-path roots, Prometheus allow-list, ...); the demo sets
    only its Prometheus URL, tick and drift repair on top
    (``--reset-then-reuse-values``). The blind rolling update is a hand edit of a
    model Deployment, which the operator puts back once its children's
    ``reapplySeconds`` have passed (60 by default): within a second when the
    Deployment was last applied longer ago than that, before Kubernetes replaced
    a single pod. The demo's operator waits an hour, so the blind update runs as
    it would without dscache.
    """
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
        "--reset-then-reuse-values",
        "--set",
        f"operator.prometheusUrl={cluster.prometheus_url}",
        "--set",
        "operator.tickSeconds=2",
        "--set",
        f"operator.reapplySeconds={DRIFT_REPAIR_S}",
        "--wait",
        "--timeout",
        "5m",
    )
    cluster.kubectl("create", "namespace", opts.namespace, check=False)


def available(api: Api, ns: str, not_revision: str | None = None) -> bool:
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


def patch_dscd(cluster: Cluster, ns: str, patch: dict[str, Any]) -> None:
    """A merge patch of the demo's resource, as a person would apply it."""
    cluster.kubectl("patch", "dscd", NAME, "-n", ns, "--type", "merge", "-p", json.dumps(patch))


def patch_revision(cluster: Cluster, ns: str, deployment: str, revision: str) -> None:
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
