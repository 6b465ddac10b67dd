"""A small typed Kubernetes API client: server-side apply, get, list, patch, events.

Built on the official client's authenticated HTTP layer (kubeconfig or
in-cluster), with objects as plain dicts, so the desired objects of
:mod:`.desired` go to the API server unchanged. Every write of a child is a
server-side apply with field manager ``dscache-operator`` and ``force``: the
operator owns the fields it renders and nothing else, and re-applying the
same object is a no-op on the server (no new resourceVersion). The caller
(:class:`~dscache_operator.reconcile.Reconciler`) applies only objects that are
absent or carry the resource's ownerReference, so ``force`` never adopts
another's object. The exceptions are the prewarm Job and the generated tenant
salt Secret (:meth:`Kube.create`): created once, never re-applied (a Job's pod
template is immutable; a salt must never change), and the Secret is never read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from dscache_operator import FIELD_MANAGER, GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, reason: str, body: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {body[:500]}")
        self.status = status
        self.body = body

    @property
    def namespace_terminating(self) -> bool:
        """The API refused new objects because their namespace is being deleted."""
        return self.status == 403 and "NamespaceTerminating" in self.body


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API."""

    group_version: str  # "v1" or "apps/v1"
    plural: str

    def path(self, namespace: str, name: str | None = None) -> str:
        base = "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"
        p = f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{p}/{name}" if name else p


RESOURCES: dict[str, Resource] = {
    "Deployment": Resource("apps/v1", "deployments"),
    "Service": Resource("v1", "services"),
    "ConfigMap": Resource("v1", "configmaps"),
    "Secret": Resource("v1", "secrets"),
    "NetworkPolicy": Resource("networking.k8s.io/v1", "networkpolicies"),
    "Pod": Resource("v1", "pods"),
    "Event": Resource("v1", "events"),
    "PodDisruptionBudget": Resource("policy/v1", "poddisruptionbudgets"),
    "Job": Resource("batch/v1", "jobs"),
    "ServiceMonitor": Resource("monitoring.coreos.com/v1", "servicemonitors"),
    "PrometheusRule": Resource("monitoring.coreos.com/v1", "prometheusrules"),
    "InferencePool": Resource("inference.networking.k8s.io/v1", "inferencepools"),
    "InferenceObjective": Resource("inference.networking.x-k8s.io/v1alpha2", "inferenceobjectives"),
    "DeepSeekCacheDeployment": Resource(f"{GROUP}/{VERSION}", PLURAL),
}


def load_api_client(kubeconfig: str | None = None) -> k8s_client.ApiClient:
    """An ApiClient from ``kubeconfig``, ``$KUBECONFIG``/~/.kube/config, or in-cluster."""
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration
        )
    except k8s_config.ConfigException:
        k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    return k8s_client.ApiClient(configuration)


class Kube:
    """The operator's API calls; one instance per process, passed down.

    ``on_request`` is called with the HTTP verb of every request sent (the
    operator counts them: ``dscache_operator_api_requests_total``); kopf's own
    watches and status patches go through kopf, not here.
    """

    def __init__(
        self,
        api: k8s_client.ApiClient,
        timeout_s: float = 30.0,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.on_request = on_request

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Obj:
        m, url, headers, data, _ = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        if self.on_request is not None:
            self.on_request(method)
        resp = self.api.call_api(m, url, headers, data, _request_timeout=self.timeout_s)
        raw = resp.read()  # type: ignore[no-untyped-call]
        text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
        if not 200 <= resp.status <= 299:
            raise ApiError(resp.status, str(resp.reason), text)
        return json.loads(text) if text else {}

    def apply(self, obj: Obj) -> Obj:
        """Server-side apply of ``obj`` (must carry kind, metadata.name/namespace)."""
        res = RESOURCES[obj["kind"]]
        meta = obj["metadata"]
        return self._call(
            "PATCH",
            res.path(meta["namespace"], meta["name"]),
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def create(self, obj: Obj) -> Obj | None:
        """Creates ``obj``; None if an object of that name exists already (HTTP 409)."""
        res = RESOURCES[obj["kind"]]
        try:
            return self._call(
                "POST",
                res.path(obj["metadata"]["namespace"]),
                query=[("fieldManager", FIELD_MANAGER)],
                body=obj,
            )
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The object, or None if it does not exist."""
        try:
            return self._call("GET", RESOURCES[kind].path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Obj]:
        """Objects of ``kind`` matching every label in ``selector``."""
        sel = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        out = self._call("GET", RESOURCES[kind].path(namespace), query=[("labelSelector", sel)])
        items: list[Obj] = out.get("items", [])
        return items

    def merge_patch(self, kind: str, namespace: str, name: str, patch: Obj) -> Obj:
        """JSON merge patch of the object."""
        return self._call(
            "PATCH",
            RESOURCES[kind].path(namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
        )

    def patch_status(
        self,
        kind: str,
        namespace: str,
        name: str,
        status: Obj,
        resource_version: str | None = None,
    ) -> Obj:
        """Merge patch of the status subresource; 409 if ``resource_version`` is stale."""
        body: Obj = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return self._call(
            "PATCH",
            RESOURCES[kind].path(namespace, name) + "/status",
            body=body,
            content_type="application/merge-patch+json",
        )

    def peering_exists(self, name: str, namespace: str | None) -> bool:
        """Whether kopf's peering object exists (False also without its CRD).

        A ClusterKopfPeering for ``namespace`` None, else a KopfPeering in ``namespace``.
        """
        base = "/apis/kopf.dev/v1"
        path = (
            f"{base}/clusterkopfpeerings/{name}"
            if namespace is None
            else f"{base}/namespaces/{namespace}/kopfpeerings/{name}"
        )
        try:
            self._call("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def has_api(self, group_version: str, plural: str) -> bool:
        """Whether the cluster serves ``plural`` in ``group_version`` (e.g. CRD installed)."""
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        try:
            out = self._call("GET", base)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in out.get("resources", []))
