"""What the reconcile reads of its children: from kopf indexes, or from the API.

A reconcile observes a resource's model Deployments, its prewarm Job and its model
and router pods, and, for ``routing.gateway: inferencePool``, the InferenceObjectives
of its namespace. Read from the API server, that is four to seven requests per tick
for each resource; kopf keeps the same objects from watch streams instead
(``@kopf.index`` on Deployments, Jobs and Pods, each watch narrowed on the
server to ``app.kubernetes.io/name=dscache``, so the operator never holds other
workloads' objects; and on InferenceObjectives, which are not the operator's
children and carry no such label: only their name, pool and priority are kept).
kopf watches InferenceObjectives only where the cluster serves their API, from the
moment their CRD is installed.

Contract:
    * :class:`ChildReader` is what the reconciler reads through: ``get(kind,
      namespace, name)`` (a Deployment or a Job, or None) and ``pods(owner,
      component)`` (the pods carrying the owner's selector labels of that component)
      and ``objectives(namespace)`` (the namespace's InferenceObjectives; asked only
      where the cluster serves their API).
    * :class:`IndexedChildren` answers from kopf's indexes (:func:`register_indexes`),
      which kopf fills before any resource handler runs and keeps current from
      watch events: what it returns may be a watch event behind the API server,
      which a level-triggered reconcile repairs on its next tick. A prewarm Job
      created a moment ago and not yet indexed is created again and answered 409
      (exists), which :meth:`Kube.create` treats as done.
    * :class:`ApiChildren` answers from the API server (tests, tools, and any
      caller without kopf).
    * Index values are the objects' plain dicts; a pod keeps only what the
      reconcile reads (metadata and status), so a large fleet costs little memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import kopf

from dscache_operator.desired.common import Owner, selector_labels
from dscache_operator.kube import Kube, Obj

#: The watches kopf keeps for the indexes are narrowed to the operator's children.
CHILD_SELECTOR = "app.kubernetes.io/name=dscache"
_INSTANCE = "app.kubernetes.io/instance"
_COMPONENT = "app.kubernetes.io/component"
#: kopf's index names (each becomes a handler keyword argument).
DEPLOYMENTS, JOBS, PODS = "dscache_deployments", "dscache_jobs", "dscache_pods"
OBJECTIVES = "dscache_objectives"
INDEXES = (DEPLOYMENTS, JOBS, PODS, OBJECTIVES)
#: The InferenceObjective API (the Gateway API Inference Extension's), as kopf names it.
OBJECTIVE_RESOURCE = ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives")


class ChildReader(Protocol):
    """Where the reconciler reads its children."""

    def get(self, kind: str, namespace: str, name: str) -> Obj | None: ...

    def pods(self, owner: Owner, component: str) -> list[Obj]: ...

    def objectives(self, namespace: str) -> list[Obj]: ...


class ApiChildren:
    """Children read from the API server, one request each."""

    def __init__(self, kube: Kube) -> None:
        self._kube = kube

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self._kube.get(kind, namespace, name)

    def pods(self, owner: Owner, component: str) -> list[Obj]:
        return self._kube.list("Pod", owner.namespace, selector_labels(owner, component))

    def objectives(self, namespace: str) -> list[Obj]:
        return self._kube.list("InferenceObjective", namespace, {})


class IndexedChildren:
    """Children from kopf's indexes (the keyword arguments kopf gives a handler)."""

    def __init__(self, indexes: Mapping[str, Any]) -> None:
        self._by_kind = {"Deployment": indexes[DEPLOYMENTS], "Job": indexes[JOBS]}
        self._pods = indexes[PODS]
        self._objectives = indexes[OBJECTIVES]

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        store: Iterable[Obj] = self._by_kind[kind].get((namespace, name), ())
        return next(iter(store), None)

    def pods(self, owner: Owner, component: str) -> list[Obj]:
        return list(self._pods.get((owner.namespace, owner.name, component), ()))

    def objectives(self, namespace: str) -> list[Obj]:
        return list(self._objectives.get(namespace, ()))


def _key(namespace: str | None, name: str | None) -> tuple[str, str]:
    return (namespace or "", name or "")


def objective_entry(namespace: str | None, body: Mapping[str, Any]) -> dict[str, Obj]:
    """An InferenceObjective's index entry: its namespace, and what a pool file needs of
    it (its name, the pool it names, its priority)."""
    spec = body.get("spec") or {}
    slim = {
        "metadata": {"name": (body.get("metadata") or {}).get("name")},
        "spec": {k: spec[k] for k in ("poolRef", "priority") if k in spec},
    }
    return {namespace or "": slim}


def narrow_watches(settings: kopf.OperatorSettings) -> None:
    """Has the API server send the indexes' watches only the operator's children."""
    for resource in (("apps", "v1", "deployments"), ("batch", "v1", "jobs"), ("", "v1", "pods")):
        settings.watching.label_selectors[resource] = CHILD_SELECTOR


def register_indexes(registry: kopf.OperatorRegistry) -> None:
    """Adds the four indexes to ``registry`` (see :func:`narrow_watches`)."""

    @kopf.index("apps", "v1", "deployments", id=DEPLOYMENTS, registry=registry)
    def deployments(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> Any:
        return {_key(namespace, name): dict(body)}

    @kopf.index("batch", "v1", "jobs", id=JOBS, registry=registry)
    def jobs(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> Any:
        return {_key(namespace, name): dict(body)}

    @kopf.index("", "v1", "pods", id=PODS, registry=registry)
    def pods(namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any) -> Any:
        instance, component = labels.get(_INSTANCE), labels.get(_COMPONENT)
        if not instance or not component:
            return None
        slim = {"metadata": dict(body.metadata), "status": dict(body.status)}
        return {(namespace or "", instance, component): slim}

    @kopf.index(*OBJECTIVE_RESOURCE, id=OBJECTIVES, registry=registry)
    def objectives(namespace: str | None, body: kopf.Body, **_: Any) -> Any:
        return objective_entry(namespace, body)
