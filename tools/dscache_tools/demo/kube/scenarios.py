"""The Kubernetes demo's run: install, then the three rollouts in turn.

See :mod:`dscache_tools.demo.kube` for what each part shows and the report's keys.
Waits poll the API with tenacity (:mod:`dscache_tools.polling`) and
raise TimeoutError naming what they waited for; a part that times out is
reported as not promoted or not rolled back, and the run goes on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dscache_tools.demo.kube.cluster import (
    Api,
    Cluster,
    available,
    bad_revision_patches,
    cluster_for,
    install,
    patch_dscd,
    patch_revision,
    prewarm_configmap,
    resource,
    workdir_for,
)
from dscache_tools.demo.kube.options import NAME, KubeDemoOptions, options_report
from dscache_tools.demo.kube.plot import write_png
from dscache_tools.demo.kube.report import (
    count_by_key,
    format_table,
    moves,
    phase_report,
    ratios,
    restore_started,
    timeline,
)
from dscache_tools.demo.kube.watch import LoadThread, Phase, Watcher, router_lookups
from dscache_tools.demo.output import publish
from dscache_tools.podlogs import save_pod_logs
from dscache_tools.polling import wait_until
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    prewarm_requests,
    sessions_of,
)

#: Rollout waits poll the API once a second (a probe makes up to three GETs).
wait_for = functools.partial(wait_until, interval=1.0)

#: moved sessions the JSON lists, whole (``sessions_moved_by_router_samples``)
MOVE_SAMPLES = 20


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
    report: dict[str, Any] = {"options": options_report(opts)}
    with cluster_for(opts, say) as cluster:
        install(cluster, opts, say)
        ns = opts.namespace
        api = Api(cluster.kubeconfig)
        cluster.kubectl(
            "apply", "-f", "-", stdin=json.dumps(prewarm_configmap(ns, warm), ensure_ascii=False)
        )
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(resource(opts, "1")))
        say("waiting for the model pods, their sidecars and the router")
        wait_for("the first revision to be Available", lambda: available(api, ns), 900)
        wait_for(
            f"{opts.router_replicas} router pods ready",
            lambda: len(api.router_ips(ns)) >= opts.router_replicas,
            300,
        )
        targets = [f"http://{ip}:8080" for ip in api.router_ips(ns)]
        try:
            report.update(_scenarios(cluster, api, opts, targets, slices, say=say))
        except BaseException:
            # The namespace goes next, and with it the logs that explain the failure.
            keep = workdir_for(opts) / "pod-logs"
            for namespace in (ns, opts.operator_namespace):
                save_pod_logs(cluster.kubectl_bin, cluster.kubeconfig, namespace, keep / namespace)
            say(f"failed: the pods' logs and events are kept in {keep}")
            raise
        finally:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    report["wall_s"] = round(time.monotonic() - began, 1)
    return report


def _scenarios(
    cluster: Cluster,
    api: Api,
    opts: KubeDemoOptions,
    targets: Sequence[str],
    slices: Sequence[Sequence[ChatRequest]],
    *,
    say: Callable[[str], None],
) -> dict[str, Any]:
    run = _Scenarios(cluster, api, opts, tuple(targets), say)
    out: dict[str, Any] = {}
    canary = run.warm_canary(slices[0], out)
    run.bad_revision(slices[1], out)
    blind = run.blind_rolling(slices[2], out)
    latencies = run.latencies
    out["router_weight_latency_s"] = round(max(latencies), 2) if latencies else None
    out["router_weight_latency_samples_s"] = [round(x, 2) for x in latencies]
    out["ratios"] = ratios(out["warm_canary"], out["blind_rolling"])
    out["sessions_moved_by_router"] = sum(run.moved.values())
    out["sessions_moved_by_router_by_part"] = dict(run.moved)
    out["sessions_moved_by_router_by_key"] = dict(run.moved_by_key)
    out["sessions_moved_by_router_indistinguishable"] = run.indistinguishable
    out["sessions_moved_by_router_samples"] = run.move_samples
    out["router_lookups_by_part"] = run.lookups
    out["timeline"] = {
        "warm_canary": timeline(canary),
        "blind_rolling": timeline(blind),
    }
    return out


@dataclass
class _Scenarios:
    """The three parts of the demo, each with its own slice of the workload."""

    cluster: Cluster
    api: Api
    opts: KubeDemoOptions
    targets: tuple[str, ...]  # every router pod: the load spreads over them
    say: Callable[[str], None]
    #: seconds from a weight change in the status to every router serving it (the
    #: canary's and the bad revision's; a blind update changes no weight)
    latencies: list[float] = field(default_factory=list)
    #: sessions whose pod changed while that pod kept serving, per part
    moved: dict[str, int] = field(default_factory=dict)
    #: the same sessions, by how the turn that moved them was keyed (every part)
    moved_by_key: Counter[str] = field(default_factory=Counter)
    #: of those, the ones whose turn no router could tell from another conversation's
    indistinguishable: int = 0
    #: the first MOVE_SAMPLES of them, for a person to look into
    move_samples: list[dict[str, Any]] = field(default_factory=list)
    #: the router pods' lookup counters over each part (``watch.router_lookups``)
    lookups: dict[str, dict[str, float]] = field(default_factory=dict)
    _lookups_at: dict[str, float] = field(default_factory=dict)

    @property
    def ns(self) -> str:
        """The demo's namespace."""
        return self.opts.namespace

    @property
    def timeout(self) -> int:
        """Seconds a whole rollout may take."""
        return 600 + 8 * self.opts.step_interval_s

    def _load(self, workload: Sequence[ChatRequest]) -> LoadThread:
        opts = self.opts
        self._lookups_at = router_lookups(self.api.router_ips(self.ns))
        return LoadThread(
            self.targets, workload, opts.concurrency, opts.think_s, opts.temperature
        ).start()

    def _stop(self, load: LoadThread, part: str) -> None:
        """Stops ``part``'s load and counts the sessions the router moved in it."""
        load.stop()
        now, before = router_lookups(self.api.router_ips(self.ns)), self._lookups_at
        # A router pod replaced during the part starts its counters anew: never below 0.
        self.lookups[part] = {k: max(0.0, v - before.get(k, 0.0)) for k, v in sorted(now.items())}
        found = moves([r for _, r in load.results])
        self.moved[part] = len(found)
        self.moved_by_key.update(count_by_key(found))
        self.indistinguishable += sum(m.indistinguishable for m in found)
        self.move_samples += [
            {"part": part, **asdict(m)} for m in found[: MOVE_SAMPLES - len(self.move_samples)]
        ]

    def _status(self) -> dict[str, Any]:
        return self.api.dscd(self.ns).get("status") or {}

    def _settle(self, phase: Phase, watcher: Watcher, what: str) -> None:
        """Marks ``phase`` complete, measures ``settle`` seconds more, stops watching."""
        phase.completed = time.perf_counter()
        took = phase.completed - phase.started
        self.say(f"{what} done in {took:.0f} s; {self.opts.settle:.0f} s more")
        time.sleep(self.opts.settle)
        watcher.stop()

    def _promoted_since(self, before: str | None) -> Callable[[], bool]:
        """A probe: promoted past ``before``; raises at once if the gate rolled it back."""

        def probe() -> bool:
            st = self._status()
            if st.get("phase") == "RolledBack":
                why = [
                    c.get("message") for c in st.get("conditions", []) if c["type"] == "RolledBack"
                ]
                raise RuntimeError(f"the warm canary was rolled back: {why}")
            return available(self.api, self.ns, not_revision=before)

        return probe

    def warm_canary(self, workload: Sequence[ChatRequest], out: dict[str, Any]) -> Phase:
        """1. A new revision through the operator's warm canary."""
        load = self._load(workload)
        self.say(f"warm-up traffic for {self.opts.warmup_s:.0f} s")
        time.sleep(self.opts.warmup_s)
        before = self._status().get("stableRevision")
        canary = Phase("warm_canary", time.perf_counter())
        watcher = Watcher(self.api, self.ns, canary).start()
        self.say("new revision 2: Deploying -> Prewarming -> 10/25/50/100%")
        patch_dscd(self.cluster, self.ns, {"spec": {"model": {"revision": "2"}}})
        promoted = True
        try:
            wait_for("revision 2 to be promoted", self._promoted_since(before), self.timeout)
        except TimeoutError as exc:
            promoted = False
            self.say(f"warning: {exc}")
        except BaseException:
            # Rolled back (or interrupted): the demo fails; its threads stop first, or
            # they poll a cluster that is being stopped.
            watcher.stop()
            with contextlib.suppress(Exception):
                load.stop()
            raise
        self._settle(canary, watcher, "rollout")
        self.latencies += watcher.latencies
        canary.results = [x for x in load.since(canary.started) if x[0] < time.perf_counter()]
        canary.before = load.before(canary.started, self.opts.warmup_s / 2)
        self._stop(load, "warm_canary")
        out["promoted"] = promoted
        out["warm_canary"] = phase_report(canary, "weight")
        return canary

    def bad_revision(self, workload: Sequence[ChatRequest], out: dict[str, Any]) -> None:
        """2. A revision that cannot hit: rolled back by the gate at its first step."""
        load = self._load(workload)
        bad = Phase("bad_revision", time.perf_counter())
        watcher = Watcher(self.api, self.ns, bad).start()
        self.say("bad revision (the cache admits nothing): the gate must roll it back")
        bad_patch, restore = bad_revision_patches(self.api.dscd(self.ns)["spec"])
        patch_dscd(self.cluster, self.ns, bad_patch)

        def rolled_back() -> Any:
            st = self._status()
            return st if st.get("phase") == "RolledBack" or st.get("rolledBackRevision") else None

        try:
            st = wait_for(
                "the bad revision to be rolled back",
                rolled_back,
                600 + 4 * self.opts.step_interval_s,
            )
            out["bad_revision_rolled_back"] = True
            out["bad_revision"] = {
                "last_analysis": st.get("lastAnalysis"),
                "conditions": [
                    c for c in st.get("conditions", []) if c.get("type") == "RolledBack"
                ],
                "seconds": round(time.perf_counter() - bad.started, 1),
            }
        except TimeoutError as exc:
            out["bad_revision_rolled_back"] = False
            self.say(f"warning: {exc}")
        watcher.stop()
        self.latencies += watcher.latencies
        # Back to the stable revision's exact spec.
        self.cluster.kubectl(
            "patch", "dscd", NAME, "-n", self.ns, "--type", "json", "-p", json.dumps(restore)
        )
        wait_for(
            "the resource back to its stable revision",
            lambda: available(self.api, self.ns),
            self.timeout,
        )
        self.say(f"warm-up traffic for {self.opts.warmup_s:.0f} s")
        time.sleep(self.opts.warmup_s)
        self._stop(load, "bad_revision")

    def blind_rolling(self, workload: Sequence[ChatRequest], out: dict[str, Any]) -> Phase:
        """3. A plain rolling update of the stable track's Deployment, blind to its cache."""
        load = self._load(workload)
        time.sleep(self.opts.warmup_s)
        if not available(self.api, self.ns):
            raise RuntimeError("the resource is rolling out again: the blind update would race it")
        slot = self._status().get("stableSlot")
        deployment = f"{NAME}-{slot}"
        blind = Phase("blind_rolling", time.perf_counter())
        watcher = Watcher(self.api, self.ns, blind).start()
        self.say(f"blind rolling update of deployment/{deployment} to model revision 3")
        patch_revision(self.cluster, self.ns, deployment, "3")
        time.sleep(2)
        self.cluster.kubectl(
            "rollout",
            "status",
            f"deployment/{deployment}",
            "-n",
            self.ns,
            f"--timeout={self.timeout}s",
        )
        self._settle(blind, watcher, "rolling update")
        # The operator keeps the router's pod list current (the new pods have new
        # addresses) and, owning the Deployment, later puts its own template back: a
        # second rolling update that is not part of this one. The window ends there.
        end = restore_started(blind, f"{slot}_updated")
        blind.results = [x for x in load.since(blind.started) if end is None or x[0] < end]
        blind.before = load.before(blind.started, self.opts.warmup_s / 2)
        self._stop(load, "blind_rolling")
        out["blind_rolling"] = phase_report(blind, f"{slot}_updated")
        out["blind_rolling"]["template_restored_at_s"] = (
            None if end is None else round(end - blind.started, 1)
        )
        return blind


def main(opts: KubeDemoOptions, json_out: Path | None, png_out: Path | None) -> int:
    """Runs the demo, prints the comparison, writes JSON and PNG; returns the exit code."""

    def say(line: str) -> None:
        print(f"[demo kubernetes] {line}", flush=True)

    try:
        with terminate_on_sigterm():  # a killed demo still stops its cluster
            report = run_kubernetes_demo(opts, say)
    except KeyboardInterrupt:
        return 130
    publish(report, format_table(report), json_out, png_out, write_png)
    ok = report["promoted"] and report["bad_revision_rolled_back"]
    return 0 if ok else 1
