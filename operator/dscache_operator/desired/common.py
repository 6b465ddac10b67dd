"""What every child object shares: names, labels, owner, pod and container security.

Invariants: selectors use only :func:`selector_labels` (name, instance,
component; plus the slot for a track), which never change for an object; every
child's metadata (:func:`meta`) carries the ownerReference and the full
:func:`labels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dscache_operator import API_VERSION, KIND
from dscache_operator.revision import ImageSpec, ResourcesSpec, SchedulingSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

Obj = dict[str, Any]

TEMPLATE_HASH = "dscache.io/template-hash"
TRACK = "dscache.io/track"
SLOT = "dscache.io/slot"
REVISION = "dscache.io/revision"
RUN_AS = 10001
TMP = "/tmp"  # noqa: S108 - an emptyDir of the pod's own, not a shared /tmp


@dataclass(frozen=True)
class Owner:
    """The resource the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> Obj:
        """The ownerReference every child carries."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    """Labels a selector may use: they never change for an object."""
    return {
        "app.kubernetes.io/name": "dscache",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
    }


def labels(owner: Owner, component: str, track: str) -> dict[str, str]:
    """The standard labels of a child."""
    return {
        **selector_labels(owner, component),
        "app.kubernetes.io/part-of": "dscache",
        "app.kubernetes.io/managed-by": "dscache-operator",
        TRACK: track,
    }


def meta(owner: Owner, name: str, lbls: dict[str, str]) -> Obj:
    """A child's ``metadata``: name, namespace, labels and the ownerReference."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": lbls,
        "ownerReferences": [owner.reference()],
    }


def track_of(status: DeepSeekCacheDeploymentStatus, slot: str) -> str:
    """stable, canary, previous (warm, rollback window) or idle."""
    if slot == status.stable_slot:
        return "stable"
    if slot == status.canary_slot:
        return "canary"
    if slot == status.previous_slot:
        return "previous"
    return "idle"


def resources(r: ResourcesSpec) -> Obj:
    """A container's ``resources`` (quantities as strings, empty parts left out)."""
    out: Obj = {}
    if r.requests:
        out["requests"] = {k: str(v) for k, v in r.requests.items()}
    if r.limits:
        out["limits"] = {k: str(v) for k, v in r.limits.items()}
    return out


def container(name: str, image: ImageSpec, command: list[str], args: list[str]) -> Obj:
    """A container running ``command args`` from ``image``, locked down (no root, no caps)."""
    return {
        "name": name,
        "image": image.reference,
        "imagePullPolicy": image.pull_policy,
        "command": command,
        "args": args,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def pod_spec(scheduling_spec: SchedulingSpec, spread: dict[str, str] | None = None) -> Obj:
    """The pod-level fields every pod of ours has; ``spread`` spreads it over nodes.

    No service account token and no service-link variables (the pods call no
    API, and a Service named like our env prefix would inject variables), a
    fixed non-root user whose group owns the volumes, and ``spec.scheduling``.
    """
    out: Obj = {
        **scheduling(scheduling_spec),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spread is not None:
        out["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": spread},
            }
        ]
    return out


def scheduling(s: SchedulingSpec) -> Obj:
    """The pod spec fields of ``spec.scheduling`` (none when unset)."""
    out: Obj = {}
    if s.node_selector:
        out["nodeSelector"] = dict(s.node_selector)
    if s.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in s.tolerations]
    if s.priority_class_name:
        out["priorityClassName"] = s.priority_class_name
    return out


def pdb(owner: Owner, name: str, component: str, track: str, extra: dict[str, str]) -> Obj:
    """A PodDisruptionBudget allowing one pod down at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(owner, name, {**labels(owner, component, track), **extra}),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {**selector_labels(owner, component), **extra}},
        },
    }


def pod_address(ip: str, port: int) -> str:
    """``ip:port`` for NGINX (IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
