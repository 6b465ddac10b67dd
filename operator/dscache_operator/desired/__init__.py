"""Every child object of a ``DeepSeekCacheDeployment``, as pure functions.

Children (``<name>`` is the resource's name):

* per track ``<slot>`` in blue/green: Deployment and Service ``<name>-<slot>``
  (model server + KV sidecar per pod), PodDisruptionBudget ``<name>-<slot>``;
* the router: ConfigMap, Deployment and PodDisruptionBudget ``<name>-router``,
  Service ``<name>`` (the entry point);
* during a prewarm: Job ``<name>-prewarm-<revision>`` (created once per
  revision with the ready canary pods' addresses; a Job's template is
  immutable, so it is never re-applied);
* NetworkPolicies ``<name>-model``, ``<name>-router``, ``<name>-prewarm``
  (:mod:`.network`; unless the admin turned them off);
* optionally ServiceMonitor and PrometheusRule ``<name>``;
* with a generated tenant salt: Secret ``<name>-tenant-salt`` (:mod:`.tenancy`),
  created once by the reconciler, never re-applied.

Where each is built: :mod:`.common` (names, labels, owner, pod and container
security), :mod:`.model` (the tracks), :mod:`.router`, :mod:`.prewarm`,
:mod:`.monitoring`; :func:`children` here puts them together. Images: the model
server runs the server image (torch); the sidecar, the hostPath
``cache-owner`` init container and the prewarm Job run the slim core image; the
router runs NGINX itself.

Invariants: the same inputs give the same dicts (so re-applying is a no-op);
every child carries an ownerReference to the resource (garbage collection),
the ``app.kubernetes.io/*`` labels and ``dscache.io/track``; selectors use only
name, instance, component and slot, which never change for an object; a
track's pod template comes only from the revision stored for that track (see
:mod:`.model`), so a rollout never restarts the stable pods.
"""

from __future__ import annotations

from collections.abc import Mapping

from dscache_operator.desired.common import (
    SLOT,
    TEMPLATE_HASH,
    TRACK,
    Obj,
    Owner,
    pdb,
    pod_address,
    selector_labels,
    track_of,
)
from dscache_operator.desired.model import model_deployment, model_service
from dscache_operator.desired.monitoring import (
    prometheus_rule,
    router_service_monitor,
    service_monitor,
)
from dscache_operator.desired.network import network_policies
from dscache_operator.desired.prewarm import (
    PREWARM_TARGETS_ENV,
    prewarm_active,
    prewarm_copy_range,
    prewarm_job,
    prewarm_job_name,
    progressive,
)
from dscache_operator.desired.router import (
    EPP_POOL_KEY,
    INFERENCE_OBJECTIVE_API,
    INFERENCE_POOL_API,
    ROUTER_CONF,
    ROUTER_CONFIG_HASH,
    epp_active,
    epp_service,
    inference_pool,
    objective_priorities,
    picker_active,
    router_config,
    router_config_hash,
    router_configmap,
    router_deployment,
    router_service,
)
from dscache_operator.desired.tenancy import new_salt, tenant_salt_secret
from dscache_operator.policy import DEFAULT_POLICY, AdminPolicy
from dscache_operator.spec import DeepSeekCacheDeploymentSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

#: What the reconciler and the tests use; the builders' own modules hold the rest.
__all__ = [
    "EPP_POOL_KEY",
    "INFERENCE_OBJECTIVE_API",
    "INFERENCE_POOL_API",
    "PREWARM_TARGETS_ENV",
    "ROUTER_CONF",
    "ROUTER_CONFIG_HASH",
    "SLOT",
    "TEMPLATE_HASH",
    "TRACK",
    "Owner",
    "children",
    "epp_active",
    "epp_service",
    "inference_pool",
    "model_deployment",
    "network_policies",
    "new_salt",
    "objective_priorities",
    "pod_address",
    "prewarm_active",
    "prewarm_copy_range",
    "prewarm_job",
    "prewarm_job_name",
    "progressive",
    "prometheus_rule",
    "router_config",
    "router_config_hash",
    "router_configmap",
    "router_deployment",
    "selector_labels",
    "tenant_salt_secret",
    "track_of",
]


def children(
    owner: Owner,
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    stable_addresses: tuple[str, ...],
    canary_addresses: tuple[str, ...],
    *,
    previous_addresses: tuple[str, ...] = (),
    monitoring: bool,
    inference_pools: bool = False,
    objectives: Mapping[str, int] | None = None,
    policy: AdminPolicy = DEFAULT_POLICY,
) -> list[Obj]:
    """Every child to (re-)apply now, in a safe order (tracks before the router).

    Frozen tracks (a ``kubectl rollout undo`` was seen) are left out: the
    operator does not fight a person's rollback. The prewarm Job is not among
    them: it is created once (:func:`prewarm_job`), never re-applied. The InferencePool
    is among them only where the cluster serves its API (``inference_pools``);
    ``objectives`` are its InferenceObjectives' priorities, for the picker's pool file.
    """
    out: list[Obj] = []
    for slot, ss in sorted(status.slots.items()):
        if not ss.frozen:
            out.append(model_deployment(owner, spec, status, slot, policy))
        out.append(model_service(owner, status, slot))
        out.append(
            pdb(owner, f"{owner.name}-{slot}", "model", track_of(status, slot), {SLOT: slot})
        )
    cfg = router_config(spec, status, stable_addresses, canary_addresses, previous_addresses)
    epp = epp_active(spec)
    out += [
        router_configmap(owner, cfg, epp=epp, objectives=objectives),
        router_deployment(owner, spec),
        router_service(owner, spec),
        pdb(owner, f"{owner.name}-router", "router", "all", {}),
    ]
    if epp:
        out.append(epp_service(owner, spec))
        if inference_pools:
            out.append(inference_pool(owner, spec))
    out += network_policies(owner, spec, status, policy)
    if monitoring:
        if spec.monitoring.service_monitor:
            picker = picker_active(spec)  # NGINX proxies the picker's metrics then
            out += [service_monitor(owner), router_service_monitor(owner, picker)]
        if spec.monitoring.prometheus_rule:
            out.append(prometheus_rule(owner, spec))
    return out
