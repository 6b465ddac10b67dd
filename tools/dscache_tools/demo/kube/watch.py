"""Load and observation while a rollout runs: the replay thread and the watcher.

Contract:
    * :class:`LoadThread` replays sessions through the router until stopped and
      keeps each result with the time its request started.
    * :class:`Watcher` records every change it sees (weight, phase, stable
      revision, analysis, pods of each Deployment) as an event of its
      :class:`Phase`, and how long each recorded weight took to reach every
      router pod.
    * :func:`router_lookups` sums the router pods' lookup counters (how each turn
      the routers could not place by their own memory was looked up, and how
      slowly the picker answered), so a part's moves can be told from its lookups
      that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dscache_operator.schema import parse_duration
from dscache_operator.spec import PickerSpec
from prometheus_client.parser import text_string_to_metric_families

from dscache import metricnames as names
from dscache_tools.demo.kube.cluster import Api
from dscache_tools.demo.kube.options import NAME
from dscache_tools.loadgen import LoadConfig, RequestResult, run_load
from dscache_tools.workload import ChatRequest

log = logging.getLogger(__name__)


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
        self,
        targets: Sequence[str],
        workload: Sequence[ChatRequest],
        concurrency: int,
        think_s: float,
        temperature: float,
    ) -> None:
        self.targets = tuple(targets)
        self.workload = list(workload)
        self.concurrency = concurrency
        self.think_s = think_s
        self.temperature = temperature
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
            target=self.targets[0],
            spread=self.targets[1:],
            concurrency=self.concurrency,
            timeout_s=300,
            progress=False,
            think_s=self.think_s,
            answers="served",  # as a chat client: the next turn carries the answer it got
            temperature=self.temperature,
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


#: The lookup counters :func:`router_lookups` keeps, by the short name it gives them.
LOOKUP_COUNTERS = {
    names.ROUTER_HOLDERS: "holders",  # the router's: found, unknown, failed (no answer in time)
    names.ROUTER_LOCATES: "locates",
    names.PICKER_CONVERSATIONS: "conversations",  # the pods' conversation ledgers
}
#: The router's default wait for its picker (the custom resource's default).
PICKER_TIMEOUT_S = parse_duration(PickerSpec.model_fields["timeout"].get_default())


def router_lookups(ips: Sequence[str], port: int = 8080) -> dict[str, float]:
    """Summed over the router pods at ``ips`` (a pod that does not answer counts
    nothing): each lookup counter by result (``"holders/failed"``), the picker's
    holder answers (``"holder_answers"``) and those within the router's default
    picker timeout (``"holder_answers_in_time"``)."""
    out: dict[str, float] = {}
    for ip in ips:
        for path in (names.ROUTER_METRICS_PATH, names.PICKER_METRICS_PATH):
            try:
                url = f"http://{ip}:{port}{path}"
                with urllib.request.urlopen(url, timeout=5) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    key = _lookup_key(family.name, sample.name, sample.labels)
                    if key is not None:
                        out[key] = out.get(key, 0.0) + sample.value
    return out


def _lookup_key(family: str, sample: str, labels: dict[str, str]) -> str | None:
    if family in LOOKUP_COUNTERS and sample.endswith("_total") and "result" in labels:
        return f"{LOOKUP_COUNTERS[family]}/{labels['result']}"
    if family == names.PICKER_HOLDER_SECONDS and sample.endswith("_count"):
        return "holder_answers"
    within = float(labels.get("le", "nan")) == PICKER_TIMEOUT_S
    if family == names.PICKER_HOLDER_SECONDS and sample.endswith("_bucket") and within:
        return "holder_answers_in_time"
    return None
