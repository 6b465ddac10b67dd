"""One reconcile of one resource: observe, decide (pure), apply, record.

``Reconciler.reconcile`` is what every kopf handler calls. It re-reads the
resource from the API server (a timer's body may be older than the status the
previous reconcile wrote), observes the children, fetches the analysis only
when the state machine says a step is due, lets :func:`.rollout.next_step`
decide, server-side-applies the desired children, creates the prewarm Job the
decision names (``Decision.prewarm_job``: the rollout decides which step's
Job and when; reconcile builds it with the ready canary pods' addresses and
creates it, never re-applies it: a Job's template is immutable), nudges the
live router pods after a router config change (an annotation patch, so the
kubelet refreshes the ConfigMap volume now rather than on its next periodic
sync), then writes the status (guarded by the resource's resourceVersion) and
clears one-shot annotations.

Before anything is rendered the spec is held against the admin's policy
(:func:`dscache_operator.policy.check_spec`; a refusal is ``Ready=False,
reason=NotAllowed``), and a generated tenant salt's Secret is created once.
No adoption: a child is applied only when it is absent or carries this
resource's ownerReference; one that exists without it (a Service of the same
name, someone's Deployment or Job) is left alone, never read as ours, and the
condition ``OwnershipConflict`` plus a ``ChildConflict`` event say which.

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
from dscache_operator.children import ApiChildren, ChildReader
from dscache_operator.conditions import get_condition, set_condition
from dscache_operator.desired import (
    INFERENCE_OBJECTIVE_API,
    INFERENCE_POOL_API,
    ROUTER_CONFIG_HASH,
    SLOT,
    TEMPLATE_HASH,
    TRACK,
    Owner,
    children,
    epp_active,
    new_salt,
    objective_priorities,
    pod_address,
    prewarm_active,
    prewarm_copy_range,
    prewarm_job,
    prewarm_job_name,
    progressive,
    router_config_hash,
    tenant_salt_secret,
    track_of,
)
from dscache_operator.kube import ApiError, Kube
from dscache_operator.metrics import OperatorMetrics
from dscache_operator.policy import check_spec
from dscache_operator.prometheus import PrometheusClient
from dscache_operator.revision import RevisionSource, revision_of
from dscache_operator.rollout import analysis_due, next_step, prewarm_step
from dscache_operator.rollout_types import (
    Annotations,
    Decision,
    Event,
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
#: The condition saying a child exists without this resource's ownership.
OWNERSHIP_CONFLICT = "OwnershipConflict"


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


def observe_router(deployment: Obj | None) -> bool:
    """Whether the router answers: its Deployment has at least one available pod.

    One is enough (the Service sends clients to it); a router rolling out new pods
    keeps old ones available, so this does not flicker during a config change.
    """
    if deployment is None:
        return False
    return int((deployment.get("status") or {}).get("availableReplicas") or 0) >= 1


def owned_by(obj: Obj, uid: str) -> bool:
    """Whether ``obj`` carries an ownerReference to the resource with ``uid``."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


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
        self.policy = settings.policy()
        self.metrics = metrics
        self.clock = clock
        # Per resource uid: children of its current reconcile that exist without its
        # ownerReference (left alone). Reconciles of one uid never overlap.
        self._conflicts: dict[str, list[str]] = {}
        # Resources whose generated tenant salt Secret exists (uid -> True).
        self._salted: LRUCache[str, bool] = LRUCache(maxsize=10000)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # One discovery GET per optional API and period, not per resource: an API
        # installed later (a CRD) is seen within the period.
        self._monitoring: TTLCache[str, bool] = TTLCache(
            maxsize=8, ttl=_MONITORING_TTL_S, timer=time.monotonic
        )
        # (owner uid, kind, name) -> what was last written there; an entry lives
        # reapply_seconds, so an unchanged object is re-applied (drift repaired)
        # at most that often. Deleted resources' entries age out on their own.
        self._applied: TTLCache[tuple[str, str, str], str] = TTLCache(
            maxsize=10000, ttl=settings.reapply_seconds, timer=time.monotonic
        )
        self._router_pods_at: LRUCache[str, str] = LRUCache(maxsize=10000)  # uid -> config hash
        # (owner uid, kind, name) of children applied lately: theirs is ours.
        self._owned_recently: TTLCache[tuple[str, str, str], bool] = TTLCache(
            maxsize=10000, ttl=max(60.0, 10 * settings.reapply_seconds), timer=time.monotonic
        )

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def reconcile(
        self, namespace: str, name: str, reader: ChildReader | None = None
    ) -> tuple[Obj, Decision] | None:
        """One reconcile; None if the resource is gone. ``reader``: where its
        Deployments, Job and pods are read (kopf's indexes; default: the API).

        Raises:
            InvalidSpecError: the spec cannot be reconciled (status already says so).
            ApiError: an API call failed; retry later.
        """
        # One read of the resource, under its lock: what kopf handed the handler may be
        # older than what another handler just wrote.
        with self._lock(f"{namespace}/{name}"):
            started = time.perf_counter()
            body = self.kube.get(KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return None
            decision = self._reconcile(body, reader or ApiChildren(self.kube))
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
            for e in decision.events:
                self.metrics.rollout_events.labels(reason=e.reason).inc()
            return body, decision

    def _reconcile(self, body: Obj, reader: ChildReader) -> Decision:
        meta = body["metadata"]
        owner = Owner(meta["name"], meta["namespace"], meta["uid"])
        spec = parse_spec(body.get("spec"))
        check_spec(spec, self.policy)
        status = parse_status(body.get("status"))
        now = self.clock()
        self._conflicts[owner.uid] = []
        self._ensure_tenant_salt(owner, spec, status)
        # Every model pod of the resource in one list: each track's addresses come from it.
        pods = reader.pods(owner, "model")
        observed = self._observe(owner, spec, status, meta, pods=pods, reader=reader)
        if analysis_due(status, observed, now):
            observed = replace(observed, verdict=self._analyse(owner, spec, status, now))
        decision = next_step(status, observed, now)
        new = decision.status
        stable = _addresses(new, new.stable_slot, pods)
        canary = _addresses(new, new.canary_slot, pods)
        previous = _addresses(new, new.previous_slot, pods)
        pools = epp_active(spec) and self._api_available(INFERENCE_POOL_API, "inferencepools")
        objs = children(
            owner,
            spec,
            new,
            stable,
            canary,
            previous_addresses=previous,
            monitoring=self._monitoring_available(),
            inference_pools=pools,
            objectives=self._objectives(owner, reader) if pools else None,
            policy=self.policy,
        )
        for child in objs:
            self._apply(owner, child)
        if decision.prewarm_job is not None:
            step = decision.prewarm_job
            job = prewarm_job(owner, spec, new, canary, step=step, sources=stable)
            if job is not None:
                self._create(job)
        configmap = next(o for o in objs if o["kind"] == "ConfigMap")
        self._nudge_router_pods(owner, router_config_hash(configmap), reader)
        for slot, ss in new.slots.items():
            if ss.frozen:  # template left alone; its track label still tells the truth
                self._label_frozen(owner, slot, track_of(new, slot))
        decision = self._record_conflicts(owner, decision, observed.generation, now)
        new = decision.status
        if new != status:
            self._write_status(owner, meta, new)
        if decision.clear_annotations:
            patch = {"metadata": {"annotations": dict.fromkeys(decision.clear_annotations)}}
            self.kube.merge_patch(KIND, owner.namespace, owner.name, patch)
        return decision

    def _apply(self, owner: Owner, obj: Obj) -> None:
        # Server-side apply of an unchanged object is a no-op on the server, but
        # still a request; skip it for a while, and repair drift on the next one.
        meta = obj["metadata"]
        key = (owner.uid, obj["kind"], meta["name"])
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
        if self._applied.get(key) == digest:
            return
        # Never adopt: a forced apply would take over an object of that name that
        # someone else made (and its deletion would follow ours). Only objects that
        # carry our ownerReference, or none yet, are applied; one seen to be ours is
        # not read again for a while (an object's owner does not change under us).
        if not self._owned_recently.get(key):
            existing = self.kube.get(obj["kind"], owner.namespace, meta["name"])
            if existing is not None and not owned_by(existing, owner.uid):
                self._conflict(owner, obj["kind"], meta["name"])
                return
        self.kube.apply(obj)
        self._applied[key] = digest
        self._owned_recently[key] = True

    def _conflict(self, owner: Owner, kind: str, name: str) -> None:
        what = f"{kind} {name}"
        found = self._conflicts.setdefault(owner.uid, [])
        if what not in found:
            log.warning(
                "%s/%s: %s exists without its ownership: left alone",
                owner.namespace,
                owner.name,
                what,
            )
            found.append(what)

    def _record_conflicts(
        self, owner: Owner, decision: Decision, generation: int, now: datetime
    ) -> Decision:
        """The ``OwnershipConflict`` condition (and an Event when it changes)."""
        conflicts = self._conflicts.pop(owner.uid, [])
        st = decision.status
        old = get_condition(st.conditions, OWNERSHIP_CONFLICT)
        if conflicts:
            message = (
                f"{', '.join(sorted(conflicts))} already exist(s) and not owned by this "
                "DeepSeekCacheDeployment: left alone (never adopted); delete or rename "
                "them, or give this resource another name"
            )
            reason = "ChildExists"
        elif old is not None and old.status == "True":
            message, reason = "every child is owned by this resource", "NoConflict"
        else:
            return decision
        if old is not None and old.message == message and old.reason == reason:
            return decision
        conds = set_condition(
            st.conditions,
            OWNERSHIP_CONFLICT,
            bool(conflicts),
            reason,
            message,
            now=now,
            generation=generation,
        )
        events = decision.events
        if conflicts:
            events = (*events, Event("Warning", "ChildConflict", message))
        return replace(decision, status=st.model_copy(update={"conditions": conds}), events=events)

    def _ensure_tenant_salt(
        self, owner: Owner, spec: DeepSeekCacheDeploymentSpec, status: DeepSeekCacheDeploymentStatus
    ) -> None:
        # The Secret must exist before a pod that reads it starts. Created once with a
        # fresh random salt, never updated (a new salt would make every block a miss),
        # never read: the operator may create Secrets but not get them.
        sources = [spec.revision_source().tenant_salt.source]
        sources += [
            RevisionSource.model_validate(ss.source).tenant_salt.source
            for ss in status.slots.values()
        ]
        if "generated" not in sources or self._salted.get(owner.uid):
            return
        self._create(tenant_salt_secret(owner, new_salt()))
        self._salted[owner.uid] = True

    def _create(self, obj: Obj) -> None:
        meta = obj["metadata"]
        if self.kube.create(obj) is None:
            log.info("%s %s/%s exists already", obj["kind"], meta["namespace"], meta["name"])
        else:
            log.info("created %s %s/%s", obj["kind"], meta["namespace"], meta["name"])

    def _nudge_router_pods(self, owner: Owner, digest: str, reader: ChildReader) -> None:
        # The kubelet refreshes a ConfigMap volume on its periodic sync (a minute
        # or more) but syncs a pod at once when the pod changes: annotate the live
        # router pods (never the template, which would restart them) with the
        # config's hash; NGINX's own watcher then reloads within a second.
        if self._router_pods_at.get(owner.uid) == digest:
            return
        pods = reader.pods(owner, "router")
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
        *,
        pods: list[Obj],
        reader: ChildReader,
    ) -> Observed:
        source = spec.revision_source()
        tracks: dict[str, TrackObservation] = {
            slot: observe_track(self._owned(reader, "Deployment", owner, f"{owner.name}-{slot}"))
            for slot in SLOTS
            if slot in status.slots
        }
        prewarm: PrewarmState = "absent"
        step = prewarm_step(status)
        if status.canary_revision is not None and step is not None:
            if step > 0 and not _step_needs_prewarm(spec, status, step, pods):
                prewarm = "succeeded"  # the step needs no more copies
            else:
                name = prewarm_job_name(owner, status.canary_revision, step)
                job = reader.get("Job", owner.namespace, name)
                if job is not None and not owned_by(job, owner.uid):
                    # Someone else's Job of that name cannot tell how our prewarm went.
                    self._conflict(owner, "Job", name)
                    prewarm = "failed"
                else:
                    prewarm = observe_job(job)
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
            router_ready=observe_router(
                self._owned(reader, "Deployment", owner, f"{owner.name}-router")
            ),
        )

    def _owned(self, reader: ChildReader, kind: str, owner: Owner, name: str) -> Obj | None:
        """The child ``name``, or None when it is absent or not ours (a conflict then)."""
        obj = reader.get(kind, owner.namespace, name)
        if obj is not None and not owned_by(obj, owner.uid):
            self._conflict(owner, kind, name)
            return None
        return obj

    def _analyse(
        self,
        owner: Owner,
        spec: DeepSeekCacheDeploymentSpec,
        status: DeepSeekCacheDeploymentStatus,
        now: datetime,
    ) -> Verdict:
        url = spec.rollout.analysis.prometheus_url or self.settings.prometheus_url
        if url and not self.policy.prometheus_allowed(url):
            verdict = Verdict(
                "NoData",
                f"spec.rollout.analysis.prometheusUrl {url!r} is not a Prometheus the admin "
                "allows (the operator's own URL or DSCACHE_OPERATOR_PROMETHEUS_URLS): not "
                "fetched; remove it to use the operator's",
            )
            self.metrics.analyses.labels(result=verdict.result).inc()
            return verdict
        client = (
            PrometheusClient(
                url,
                timeout_s=self.settings.prometheus_timeout_seconds,
                max_body_bytes=self.settings.prometheus_max_body_bytes,
                budget_s=self.settings.prometheus_timeout_seconds,
            )
            if url
            else None
        )
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

    def _objectives(self, owner: Owner, reader: ChildReader) -> dict[str, int]:
        """The priorities of the InferenceObjectives of the resource's InferencePool,
        where the cluster serves their API (from kopf's index, or one list)."""
        if not self._api_available(INFERENCE_OBJECTIVE_API, "inferenceobjectives"):
            return {}
        return objective_priorities(reader.objectives(owner.namespace), owner.name)

    def _monitoring_available(self) -> bool:
        return self._api_available("monitoring.coreos.com/v1", "servicemonitors")

    def _api_available(self, group_version: str, plural: str) -> bool:
        """Whether the cluster serves ``plural`` (asked once per period of
        ``_MONITORING_TTL_S``, so a CRD installed later is seen)."""
        available = self._monitoring.get(plural)
        if available is None:
            available = self.kube.has_api(group_version, plural)
            self._monitoring[plural] = available
            if not available and plural == "inferencepools":
                log.warning(
                    "routing.gateway inferencePool: the cluster serves no %s/%s (install "
                    "the Gateway API Inference Extension's CRDs); the endpoint picker runs "
                    "without its InferencePool",
                    group_version,
                    plural,
                )
        return available

    def _write_status(
        self, owner: Owner, meta: Mapping[str, Any], status: DeepSeekCacheDeploymentStatus
    ) -> None:
        self.kube.patch_status(
            KIND, owner.namespace, owner.name, dump_status(status), meta["resourceVersion"]
        )

    def record_invalid(
        self, namespace: str, name: str, message: str, reason: str = "InvalidSpec"
    ) -> None:
        """Ready=False with ``reason`` (InvalidSpec, NotAllowed), phase Failed, ``message``."""
        body = self.kube.get(KIND, namespace, name)
        if body is None:
            return
        status = parse_status(body.get("status"))
        gen = int(body["metadata"].get("generation", 0))
        conds = set_condition(
            status.conditions,
            "Ready",
            False,
            reason,
            message,
            now=self.clock(),
            generation=gen,
        )
        new = status.model_copy(
            update={"conditions": conds, "phase": "Failed", "observed_generation": gen}
        )
        self.kube.patch_status(KIND, namespace, name, dump_status(new))


def _addresses(
    status: DeepSeekCacheDeploymentStatus, slot: str | None, pods: list[Obj]
) -> tuple[str, ...]:
    """The ready model pods of ``slot`` among ``pods`` (every model pod of the resource),
    as ``ip:port`` of that slot's server."""
    if slot is None or slot not in status.slots:
        return ()
    port = RevisionSource.model_validate(status.slots[slot].source).server.port
    mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(SLOT) == slot]
    return tuple(pod_address(ip, port) for ip in ready_pod_ips(mine))


def _step_needs_prewarm(
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    step: int,
    pods: list[Obj],
) -> bool:
    # The canary's pod count decides only where copies follow the placement ring.
    if not progressive(spec):
        return False
    count = len(_addresses(status, status.canary_slot, pods))
    return prewarm_copy_range(spec, count, step) is not None
