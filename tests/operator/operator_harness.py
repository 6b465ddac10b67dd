"""The operator's cluster-test harness: a real Prometheus, the real operator as processes,
and the helpers the cluster tests share to create resources and wait on their status.

Kept out of conftest.py so the tests can import the types.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from dscache_tools.devcluster import DevCluster, wait_until
from dscache_tools.devcluster.nodes import SIMULATED_PLACEMENT
from dscache_tools.net import free_port
from fakes.server_metrics import FakeServerMetrics, Figures
from needs import need_binary
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
#: The shared operator re-applies unchanged children this often (the default
#: is 60 s), so a test watching a few seconds sees several re-applies.
REAPPLY_SECONDS = 1


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class PrometheusProcess:
    """A real Prometheus scraping ``metrics`` every second.

    ``metrics`` is the fake model server (its series carry their own labels) or any
    ``/metrics`` on 127.0.0.1 at its ``port``, e.g. a real vLLM server; ``labels``
    are then given to its target, as pod discovery labels a pod's series
    (``namespace``, ``dscache_io_revision``).
    """

    def __init__(
        self,
        workdir: Path,
        metrics: FakeServerMetrics,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.metrics = metrics
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        target = {"targets": [f"127.0.0.1:{metrics.port}"], "labels": labels or {}}
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: dscache-server\n"
            "    honor_labels: true\n"
            f"    static_configs: [{json.dumps(target)}]\n"
        )
        self.log = workdir / "prometheus.log"
        self._log = self.log.open("w")
        self.proc = subprocess.Popen(
            [
                need_binary("prometheus", "prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        # Ready, and the target scraped once (discovery applies targets every 5 s).
        try:
            wait_until("prometheus scraped its target", self._scraped, 60, 0.2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {self.log.read_text()[-2000:]}") from exc

    def _scraped(self) -> bool:
        try:
            r = httpx.get(f"{self.url}/api/v1/query", params={"query": "up"}, timeout=2)
            return bool(r.json()["data"]["result"])
        except (httpx.HTTPError, ValueError, KeyError):
            return False  # not serving yet

    def close(self) -> None:
        _stop(self.proc)
        self._log.close()


class OperatorProcess:
    """``dscache operator`` as a child process; ``restart()`` and ``kill()`` for the tests.

    ``peering`` runs it as one replica of a peered set (``--peering NAME``);
    ``metrics=True`` serves its ``/metrics`` on a free port (:meth:`reconciles`).
    """

    def __init__(
        self,
        cluster: DevCluster,
        workdir: Path,
        prometheus_url: str,
        kubeconfig: Path | None = None,
        *,
        name: str = "operator",
        peering: str | None = None,
        metrics: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.prometheus_url = prometheus_url
        self.name = name
        self.peering = peering
        self.metrics_port = free_port() if metrics else 0
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start()

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}-{self.starts}.log"

    def start(self) -> None:
        env = self.cluster.env()
        env["DSCACHE_OPERATOR_REAPPLY_SECONDS"] = str(REAPPLY_SECONDS)
        env.update(self.extra_env)
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        paths = [str(ROOT / "operator"), str(ROOT / "sidecar"), str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
        self.starts += 1
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dscache.cli",
                    "operator",
                    "--all-namespaces",
                    "--tick-seconds",
                    "1",
                    "--prometheus-url",
                    self.prometheus_url,
                    "--health-port",
                    "0",
                    "--metrics-port",
                    str(self.metrics_port),
                    *(["--peering", self.peering] if self.peering else []),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def reconciles(self) -> float:
        """``dscache_operator_reconciles_total`` over every result (0 before the first)."""
        assert self.metrics_port, "started without metrics=True"
        try:
            r = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5)
        except httpx.HTTPError:
            return 0.0  # not serving yet
        return sum(
            sample.value
            for family in text_string_to_metric_families(r.text)
            for sample in family.samples
            if sample.name == "dscache_operator_reconciles_total"
        )


# ----------------------------------------------------------------------------- resources

GOOD = Figures(hit_rate=0.95, ttft_s=0.2)
BAD = Figures(hit_rate=0.40, ttft_s=0.2)
STABLE = Figures(hit_rate=0.90, ttft_s=0.2)


def get(c: DevCluster, ns: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = c.kubectl_json("get", "dscd", name, "-n", ns)
    return out


def status(c: DevCluster, ns: str, name: str) -> dict[str, Any]:
    return get(c, ns, name).get("status") or {}


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((x for x in st.get("conditions", []) if x["type"] == type_), {})


def wait_for(
    c: DevCluster,
    ns: str,
    name: str,
    what: str,
    ok: Callable[[dict[str, Any]], bool],
    op: OperatorProcess,
    timeout: float = 90.0,
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        st = status(c, ns, name)
        return st if ok(st) else None

    try:
        return wait_until(what, probe, timeout, 0.3)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{op.tail()}") from exc


def events(
    c: DevCluster,
    ns: str,
    name: str,
    until: Callable[[list[str]], bool] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """The reasons of ``name``'s Events, oldest first; with ``until``, once they
    satisfy it. The operator posts its Events after the status write that they
    describe (kopf's posting queue), so a test that saw the status waits for them
    (a bounded while: an Event never posted fails it, with the reasons seen)."""

    def reasons() -> list[str]:
        out = c.kubectl_json(
            "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
        )
        items = sorted(
            out["items"],
            key=lambda e: e.get("lastTimestamp") or e["metadata"]["creationTimestamp"],
        )
        return [e["reason"] for e in items]

    if until is None:
        return reasons()
    seen: list[str] = []

    def probe() -> list[str] | None:
        nonlocal seen
        seen = reasons()
        return seen if until(seen) else None

    try:
        found: list[str] = wait_until(f"the Events of {name}", probe, timeout, 0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the Events posted: {seen}") from exc
    return found


def simulated(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its pods placed on simulated nodes, when it is a DeepSeekCacheDeployment."""
    if doc.get("kind") != "DeepSeekCacheDeployment":
        return doc
    # These tests drive the operator's decisions with fake metrics: the model and
    # router pods go to simulated (KWOK) nodes, where they run no process (the
    # real-pod end-to-end tests are in tests/e2e/).
    return {**doc, "spec": {**doc.get("spec", {}), "scheduling": SIMULATED_PLACEMENT}}


def apply(c: DevCluster, ns: str, docs: list[dict[str, Any]]) -> None:
    """Applies ``docs``; DeepSeekCacheDeployments place their pods on simulated nodes."""
    placed = [simulated(d) for d in docs]
    c.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all(placed))


def example_docs(example: str) -> list[dict[str, Any]]:
    """The documents of ``examples/<example>/``."""
    return [
        d
        for p in sorted((ROOT / "examples" / example).glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]


def apply_example(c: DevCluster, ns: str, example: str) -> None:
    """``kubectl apply -f examples/<example>/``, its pods on simulated nodes."""
    apply(c, ns, example_docs(example))


def spec_doc(name: str, prom: PrometheusProcess, **rollout: Any) -> dict[str, Any]:
    return {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DeepSeekCacheDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"preset": "tiny-gqa", "revision": "1"},
            "replicas": 2,
            "routing": {"replicas": 1},
            "rollout": {
                "interval": "5s",
                "rollbackWindow": "10m",
                "analysis": {"prometheusUrl": prom.url},
                **rollout,
            },
        },
    }


def set_revision(c: DevCluster, ns: str, name: str, revision: str) -> None:
    patch = json.dumps({"spec": {"model": {"revision": revision}}})
    c.kubectl("patch", "dscd", name, "-n", ns, "--type", "merge", "-p", patch)


def available(c: DevCluster, ns: str, name: str, op: OperatorProcess) -> dict[str, Any]:
    """The rollout at rest and the ``Available`` condition True (router included), as
    ``kubectl wait --for=condition=Available`` would see it."""

    def ok(s: dict[str, Any]) -> bool:
        return s.get("phase") == "Available" and condition(s, "Available").get("status") == "True"

    return wait_for(c, ns, name, "Available", ok, op)


def start_rollout(
    c: DevCluster,
    ns: str,
    name: str,
    op: OperatorProcess,
    metrics: FakeServerMetrics,
    revision: str,
    figures: Figures | None = GOOD,
) -> tuple[str, str]:
    """Patches the model revision; returns (stable, canary) revision hashes."""
    stable = status(c, ns, name)["stableRevision"]
    metrics.set(ns, stable, STABLE)
    set_revision(c, ns, name, revision)
    st = wait_for(
        c, ns, name, "canary", lambda s: s.get("canaryRevision") not in (None, stable), op
    )
    if figures is not None:
        metrics.set(ns, st["canaryRevision"], figures)
    return stable, st["canaryRevision"]


def router_conf(c: DevCluster, ns: str, name: str) -> str:
    cm = c.kubectl_json("get", "configmap", f"{name}-router", "-n", ns)
    text: str = cm["data"]["nginx.conf"]
    return text


@dataclass(frozen=True)
class Rig:
    """What a rollout test drives: its namespace, the shared operator, Prometheus and metrics."""

    c: DevCluster
    ns: str
    op: OperatorProcess
    prom: PrometheusProcess
    metrics: FakeServerMetrics

    def deploy(self, name: str, extra: dict[str, Any] | None = None, **rollout: Any) -> str:
        """Creates resource ``name`` (``rollout`` settings, ``extra`` spec fields), waits for
        Available and returns its stable revision."""
        doc = spec_doc(name, self.prom, **rollout)
        apply(self.c, self.ns, [{**doc, "spec": {**doc["spec"], **(extra or {})}}])
        revision: str = self.available(name)["stableRevision"]
        return revision

    def available(self, name: str) -> dict[str, Any]:
        return available(self.c, self.ns, name, self.op)

    def rollout(self, name: str, revision: str, figures: Figures | None = GOOD) -> tuple[str, str]:
        """:func:`start_rollout` of ``name`` to model revision ``revision``."""
        return start_rollout(self.c, self.ns, name, self.op, self.metrics, revision, figures)

    def wait(
        self, name: str, what: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 90.0
    ) -> dict[str, Any]:
        return wait_for(self.c, self.ns, name, what, ok, self.op, timeout)

    def status(self, name: str) -> dict[str, Any]:
        return status(self.c, self.ns, name)

    def events(self, name: str, until: Callable[[list[str]], bool] | None = None) -> list[str]:
        return events(self.c, self.ns, name, until)

    def deployment(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.c.kubectl_json("get", "deployment", name, "-n", self.ns)
        return out

    def weights_until_promoted(
        self, name: str, canary: str, timeout: float, on_change: Callable[[dict[str, Any]], None]
    ) -> list[tuple[str, int]]:
        """Every (phase, weight) the status shows until ``canary`` is stable and Available."""
        seen: list[tuple[str, int]] = []

        def promoted() -> bool:
            st = self.status(name)
            key = (st["phase"], st["weight"])
            if not seen or seen[-1] != key:
                seen.append(key)
                on_change(st)
            return st.get("stableRevision") == canary and st["phase"] == "Available"

        try:
            wait_until(f"{name} promoted", promoted, timeout, 0.3)
        except TimeoutError as exc:
            raise AssertionError(f"no promotion: {seen}\n{self.op.tail()}") from exc
        return seen
