"""One reconcile of one resource: observe, decide (pure), apply, record.

``Reconciler.reconcile`` is what every kopf handler calls. It re-reads the
resource from the API server (a timer's body may be older than the status the
previous reconcile wrote), observes the children, fetches the analysis only
when the state machine says a step is due, lets :func:`.rollout.next_step`
decide, server-side-applies the desired children, creates the prewarm Job
(once per revision, with the ready canary pods' addresses; never re-applied:
a Job's template is immutable), nudges the live router pods after a router
config change (an annotation patch, so the kubelet refreshes the ConfigMap
volume now rather than on its next periodic sync), then writes the status
(guarded by the resource's resourceVersion) and clears one-shot annotations.

Invariants: calls for one resource never overlap (a lock per uid); the status
is written after the children, so a crash in between repeats the same
(idempotent) applies on the next tick rather than skipping them. Two operator
replicas never both act for long (kopf peering pauses all but one), and even
then the resourceVersion guard lets only one of two overlapping decisions be
written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from cachetools import LRUCache, TTLCache

from dscache_operator import KIND
from dscache_operator.analysis import Step, analyse
from dscache_operator.conditions import set_condition
from dscache_operator.desired import (
    ROUTER_CONFIG_HASH,
    SLOT,
    TEMPLATE_HASH,
    TRACK,
    Owner,
    children,
    pod_address,
    prewarm_active,
    prewarm_copy_range,
    prewarm_job,
    prewarm_job_name,
    progressive,
    router_config_hash,
    selector_labels,
    track_of,
)
from dscache_operator.kube import ApiError, Kube
from dscache_operator.metrics import OperatorMetrics
from dscache_operator.podspec import RevisionSource, revision_of
from dscache_operator.prometheus import PrometheusClient
from dscache_operator.rollout import analysis_due, next_step
from dscache_operator.rollout_types import (
    Annotations,
    Decision,
    Observed,
    PrewarmState,
    TrackObservation,
    Verdict,
)
from dscache_operator.settings import OperatorSettings
from dscache_operator.spec import DeepSeekCacheDeploymentSpec, parse_spec
from dscache_operator.status import (
    SLOTS,
    DeepSeekCacheDeploymentStatus,
    dump_status,
    parse_status,
)

log = logging.getLogger(__name__)
Obj = dict[str, Any]
_MONITORING_TTL_S = 10.0


def observe_track(deployment: Obj | None) -> TrackObservation:
    """Ready = every desired replica updated and available; undone = template hash mismatch."""
    if deployment is None:
        return TrackObservation()
    meta, spec, st = (
        deployment["metadata"],
        deployment.get("spec", {}),
        deployment.get("status", {}),
    )
    want = int(spec.get("replicas", 1))
    current = st.get("observedGeneration", 0) >= meta.get("generation", 0)
    ready = (
        current
        and int(st.get("updatedReplicas", 0)) >= want
        and int(st.get("availableReplicas", 0)) >= want
        and int(st.get("replicas", 0)) == want
    )
    applied = (meta.get("labels") or {}).get(TEMPLATE_HASH)
    running = ((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    undone = applied is not None and running.get(TEMPLATE_HASH) != applied
    return TrackObservation(exists=True, ready=bool(ready), undone=undone)


def observe_job(job: Obj | None) -> PrewarmState:
    """absent, running, succeeded or failed."""
    if job is None:
        return "absent"
    st = job.get("status") or {}
    if int(st.get("succeeded") or 0) > 0:
        return "succeeded"
    for c in st.get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return "failed"
        if c.get("type") == "Complete" and c.get("status") == "True":
            return "succeeded"
    return "running"


def ready_pod_ips(pods: list[Obj]) -> list[str]:
    """IPs of Ready, not terminating pods, ordered by pod name."""
    out: list[tuple[str, str]] = []
    for p in pods:
        if p["metadata"].get("deletionTimestamp"):
            continue
        st = p.get("status") or {}
        ip = st.get("podIP")
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in st.get("conditions") or []
        )
        if ip and ready:
            out.append((p["metadata"]["name"], ip))
    return [ip for _, ip in sorted(out)]


class Reconciler:
    """Reconciles resources; built once in ``main`` and handed to the handlers."""

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # One discovery GET per period, not per resource.
        self._monitoring: TTLCache[str, bool] = TTLCache(
            maxsize=1, ttl=_MONITORING_TTL_S, timer=time.monotonic
        )
        # (owner uid, kind, name) -> what was last written there; an entry lives
        # reapply_seconds, so an unchanged object is re-applied (drift repaired)
        # at most that often. Deleted resources' entries age out on their own.
        self._applied: TTLCache[tuple[str, str, str], str] = TTLCache(
            maxsize=10000, ttl=settings.reapply_seconds, timer=time.monotonic
        )
        self._router_pods_at: LRUCache[str, str] = LRUCache(maxsize=10000)  # uid -> config hash

    def _lock(self, uid: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def reconcile(self, namespace: str, name: str) -> tuple[Obj, Decision] | None:
        """One reconcile; None if the resource is gone.

        Raises:
            InvalidSpecError: the spec cannot be reconciled (status already says so).
            ApiError: an API call failed; retry later.
        """
        body = self.kube.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        with self._lock(body["metadata"]["uid"]):
            started = time.perf_counter()
            body = self.kube.get(KIND, namespace, name) or body
            decision = self._reconcile(body)
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
            for e in decision.events:
                self.metrics.rollout_events.labels(reason=e.reason).inc()
            return body, decision

    def _reconcile(self, body: Obj) -> Decision:
        meta = body["metadata"]
        owner = Owner(meta["name"], meta["namespace"], meta["uid"])
        spec = parse_spec(body.get("spec"))
        status = parse_status(body.get("status"))
        now = self.clock()
        observed = self._observe(owner, spec, status, meta)
        if analysis_due(status, observed, now):
            observed = replace(observed, verdict=self._analyse(owner, spec, status, now))
        decision = next_step(status, observed, now)
        new = decision.status
        stable = self._addresses(owner, new, new.stable_slot)
        canary = self._addresses(owner, new, new.canary_slot)
        previous = self._addresses(owner, new, new.previous_slot)
        objs = children(
            owner,
            spec,
            new,
            stable,
            canary,
            previous_addresses=previous,
            monitoring=self._monitoring_available(),
        )
        for child in objs:
            self._apply(child)
        step = _prewarm_step(new)
        if (
            step is not None
            and observed.prewarm_enabled
            and new.canary_revision == status.canary_revision
            and (observed.prewarm == "absent" or step != _prewarm_step(status))
        ):
            job = prewarm_job(owner, spec, new, canary, step=step, sources=stable)
            if job is not None:
                self._create(job)
        configmap = next(o for o in objs if o["kind"] == "ConfigMap")
        self._nudge_router_pods(owner, router_config_hash(configmap))
        for slot, ss in new.slots.items():
            if ss.frozen:  # template left alone; its track label still tells the truth
                self._label_frozen(owner, slot, track_of(new, slot))
        if new != status:
            self._write_status(owner, meta, new)
        if decision.clear_annotations:
            patch = {"metadata": {"annotations": dict.fromkeys(decision.clear_annotations)}}
            self.kube.merge_patch(KIND, owner.namespace, owner.name, patch)
        return decision

    def _apply(self, obj: Obj) -> None:
        # Server-side apply of an unchanged object is a no-op on the server, but
        # still a request; skip it for a while, and repair drift on the next one.
        meta = obj["metadata"]
        key = (meta["ownerReferences"][0]["uid"], obj["kind"], meta["name"])
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
        if self._applied.get(key) == digest:
            return
        self.kube.apply(obj)
        self._applied[key] = digest

    def _create(self, obj: Obj) -> None:
        meta = obj["metadata"]
        if self.kube.create(obj) is None:
            log.info("%s %s/%s exists already", obj["kind"], meta["namespace"], meta["name"])
        else:
            log.info("created %s %s/%s", obj["kind"], meta["namespace"], meta["name"])

    def _nudge_router_pods(self, owner: Owner, digest: str) -> None:
        # The kubelet refreshes a ConfigMap volume on its periodic sync (a minute
        # or more) but syncs a pod at once when the pod changes: annotate the live
        # router pods (never the template, which would restart them) with the
        # config's hash; NGINX's own watcher then reloads within a second.
        if self._router_pods_at.get(owner.uid) == digest:
            return
        pods = self.kube.list("Pod", owner.namespace, selector_labels(owner, "router"))
        patch = {"metadata": {"annotations": {ROUTER_CONFIG_HASH: digest}}}
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            if (meta.get("annotations") or {}).get(ROUTER_CONFIG_HASH) == digest:
                continue
            try:
                self.kube.merge_patch("Pod", owner.namespace, meta["name"], patch)
            except ApiError as exc:
                if exc.status != 404:
                    raise
        self._router_pods_at[owner.uid] = digest

    def _label_frozen(self, owner: Owner, slot: str, track: str) -> None:
        name = f"{owner.name}-{slot}"
        key = (owner.uid, "Deployment/labels", name)
        if self._applied.get(key) == track:
            return
        patch = {"metadata": {"labels": {TRACK: track}}}
        try:
            self.kube.merge_patch("Deployment", owner.namespace, name, patch)
        except ApiError as exc:
            if exc.status != 404:
                raise
        self._applied[key] = track

    def _observe(
        self,
        owner: Owner,
        spec: DeepSeekCacheDeploymentSpec,
        status: DeepSeekCacheDeploymentStatus,
        meta: Mapping[str, Any],
    ) -> Observed:
        source = spec.revision_source()
        tracks: dict[str, TrackObservation] = {
            slot: observe_track(
                self.kube.get("Deployment", owner.namespace, f"{owner.name}-{slot}")
            )
            for slot in SLOTS
            if slot in status.slots
        }
        prewarm: PrewarmState = "absent"
        step = _prewarm_step(status)
        if status.canary_revision is not None and step is not None:
            if step > 0 and not self._step_needs_prewarm(owner, spec, status, step):
                prewarm = "succeeded"  # the step needs no more copies
            else:
                name = prewarm_job_name(owner, status.canary_revision, step)
                prewarm = observe_job(self.kube.get("Job", owner.namespace, name))
        return Observed(
            generation=int(meta.get("generation", 0)),
            revision=revision_of(source),
            source=source.model_dump(mode="json", by_alias=True),
            steps=spec.steps,
            interval_s=spec.interval_s,
            rollback_window_s=spec.rollback_window_s,
            prewarm_enabled=prewarm_active(spec),
            tracks=tracks,
            prewarm=prewarm,
            annotations=Annotations.from_metadata(meta.get("annotations")),
        )

    def _step_needs_prewarm(
        self,
        owner: Owner,
        spec: DeepSeekCacheDeploymentSpec,
        status: DeepSeekCacheDeploymentStatus,
        step: int,
    ) -> bool:
        # The canary's pods are listed only where their count decides (placement ring).
        if not progressive(spec):
            return False
        pods = len(self._addresses(owner, status, status.canary_slot))
        return prewarm_copy_range(spec, pods, step) is not None

    def _analyse(
        self,
        owner: Owner,
        spec: DeepSeekCacheDeploymentSpec,
        status: DeepSeekCacheDeploymentStatus,
        now: datetime,
    ) -> Verdict:
        url = spec.rollout.analysis.prometheus_url or self.settings.prometheus_url
        client = PrometheusClient(url, self.settings.prometheus_timeout_seconds) if url else None
        started = status.step_started_at or now
        step = Step(
            namespace=owner.namespace,
            canary=status.canary_revision or "",
            stable=status.stable_revision or "",
            window_s=spec.interval_s,
            since_step_s=max(spec.interval_s, (now - started).total_seconds()),
        )
        verdict = analyse(client, spec.rollout.analysis, step)
        self.metrics.analyses.labels(result=verdict.result).inc()
        log.info(
            "analysis of %s/%s at %d%%: %s %s",
            owner.namespace,
            owner.name,
            status.weight,
            verdict.result,
            verdict.message,
        )
        return verdict

    def _addresses(
        self, owner: Owner, status: DeepSeekCacheDeploymentStatus, slot: str | None
    ) -> tuple[str, ...]:
        if slot is None or slot not in status.slots:
            return ()
        port = RevisionSource.model_validate(status.slots[slot].source).server.port
        pods = self.kube.list(
            "Pod", owner.namespace, {**selector_labels(owner, "model"), SLOT: slot}
        )
        return tuple(pod_address(ip, port) for ip in ready_pod_ips(pods))

    def _monitoring_available(self) -> bool:
        available = self._monitoring.get("servicemonitors")
        if available is None:
            available = self.kube.has_api("monitoring.coreos.com/v1", "servicemonitors")
            self._monitoring["servicemonitors"] = available
        return available

    def _write_status(
        self, owner: Owner, meta: Mapping[str, Any], status: DeepSeekCacheDeploymentStatus
    ) -> None:
        self.kube.patch_status(
            KIND, owner.namespace, owner.name, dump_status(status), meta["resourceVersion"]
        )

    def record_invalid(self, namespace: str, name: str, message: str) -> None:
        """Ready=False, reason InvalidSpec, phase Failed, with ``message``."""
        body = self.kube.get(KIND, namespace, name)
        if body is None:
            return
        status = parse_status(body.get("status"))
        gen = int(body["metadata"].get("generation", 0))
        conds = set_condition(
            status.conditions,
            "Ready",
            False,
            "InvalidSpec",
            message,
            now=self.clock(),
            generation=gen,
        )
        new = status.model_copy(
            update={"conditions": conds, "phase": "Failed", "observed_generation": gen}
        )
        self.kube.patch_status(KIND, namespace, name, dump_status(new))


def _prewarm_step(status: DeepSeekCacheDeploymentStatus) -> int | None:
    """The rollout step whose prewarm Job matters now: step 0 while prewarming, the
    next step during a step, None outside a rollout or during the last step."""
    if status.canary_revision is None:
        return None
    if status.step_index is None:
        return 0 if status.phase == "Prewarming" else None
    return status.step_index + 1
