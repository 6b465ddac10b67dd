"""kopf handlers: thin adapters from kopf's causes to :class:`.reconcile.Reconciler`.

Create, update (spec, labels or annotations), resume (operator start) and a
per-resource timer all run the same level-triggered reconcile, so a missed
event is repaired on the next tick. Each reads the children through kopf's
indexes (:mod:`.children`), handed to it as keyword arguments. Handlers
never sleep: API failures become ``kopf.TemporaryError(delay=...)``; an invalid spec becomes
``kopf.PermanentError`` after the status says ``Ready=False, InvalidSpec``
(the timer only records it and keeps ticking, so a fixed spec recovers). A
resource whose namespace is being deleted is left alone (the API refuses new
children there with 403 NamespaceTerminating; that is not an RBAC failure).
Deletion needs no handler: every child has an ownerReference, so Kubernetes'
garbage collector removes them. kopf keeps its timers stoppable with a
finalizer (``dscache.io/finalizer``), which the running operator removes at
once on deletion.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from dscache_operator import GROUP, PLURAL, VERSION
from dscache_operator.children import (
    INDEXES,
    IndexedChildren,
    narrow_watches,
    register_indexes,
)
from dscache_operator.kube import ApiError
from dscache_operator.reconcile import Reconciler
from dscache_operator.schema import InvalidSpecError
from dscache_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


def _run(
    reconciler: Reconciler,
    body: kopf.Body,
    indexes: Mapping[str, Any] | None = None,
    *,
    permanent: bool,
) -> None:
    ns, name = body.metadata.namespace or "", body.metadata.name or ""
    # kopf hands a handler its indexes; without them (a direct call) the API is read.
    reader = IndexedChildren(indexes) if indexes and all(i in indexes for i in INDEXES) else None
    try:
        result = reconciler.reconcile(ns, name, reader)
    except InvalidSpecError as exc:
        reconciler.metrics.reconciles.labels(result="invalid_spec").inc()
        reason = getattr(exc, "reason", "InvalidSpec")
        reconciler.record_invalid(ns, name, str(exc), reason)
        kopf.warn(body, reason=reason, message=str(exc))
        if permanent:
            raise kopf.PermanentError(f"invalid spec: {exc}") from exc
        return
    except (ApiError, OSError) as exc:
        if isinstance(exc, ApiError) and exc.namespace_terminating:
            # Its namespace is going away and takes the children with it: nothing
            # to repair, and no error to retry (the deletion removes the finalizer).
            reconciler.metrics.reconciles.labels(result="namespace_terminating").inc()
            log.info("%s/%s: namespace is being deleted; not reconciling", ns, name)
            return
        reconciler.metrics.reconciles.labels(result="api_error").inc()
        raise kopf.TemporaryError(str(exc), delay=reconciler.settings.retry_delay_seconds) from exc
    reconciler.metrics.reconciles.labels(result="ok").inc()
    for e in result[1].events if result else ():
        kopf.event(body, type=e.type, reason=e.reason, message=e.message)


def register(
    registry: kopf.OperatorRegistry, reconciler: Reconciler, settings: OperatorSettings
) -> None:
    """Adds the handlers to ``registry`` (no module-level registration, no globals)."""
    resource = (GROUP, VERSION, PLURAL)
    register_indexes(registry)

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.create(*resource, id="create", registry=registry)
    def on_create(body: kopf.Body, **kwargs: Any) -> None:
        _run(reconciler, body, kwargs, permanent=True)

    @kopf.on.update(*resource, id="update", registry=registry)
    def on_update(body: kopf.Body, **kwargs: Any) -> None:
        _run(reconciler, body, kwargs, permanent=True)

    @kopf.on.resume(*resource, id="resume", registry=registry)
    def on_resume(body: kopf.Body, **kwargs: Any) -> None:
        _run(reconciler, body, kwargs, permanent=True)

    @kopf.timer(*resource, id="tick", interval=settings.tick_seconds, registry=registry)
    def tick(body: kopf.Body, **kwargs: Any) -> None:
        _run(reconciler, body, kwargs, permanent=False)


def kopf_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    """kopf's own settings: progress in annotations, so the status stays ours alone."""
    ks = kopf.OperatorSettings()
    ks.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="dscache.io")
    ks.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="dscache.io", key="last-handled-configuration"
    )
    ks.persistence.finalizer = "dscache.io/finalizer"
    ks.execution.max_workers = settings.max_workers
    ks.posting.level = logging.INFO
    ks.watching.server_timeout = 300
    ks.networking.request_timeout = settings.api_timeout_seconds
    ks.peering.lifetime = settings.peering_lifetime_seconds
    narrow_watches(ks)
    ks.peering.stealth = True  # no log line per keep-alive; pauses and resumes are still logged
    return ks
