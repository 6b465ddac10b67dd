"""The dscache Kubernetes operator: ``DeepSeekCacheDeployment`` -> model tracks, router, rollouts.

Modules, from pure to effectful:

* :mod:`~dscache_operator.spec` - the resource's typed spec and status (pydantic),
  the single source of the CRD schema (:mod:`~dscache_operator.crd`).
* :mod:`~dscache_operator.rollout` - the rollout state machine,
  ``next_step(status, observed, now) -> Decision``; no I/O, no clock.
* :mod:`~dscache_operator.desired` - every child object as a pure function of the
  spec and the status.
* :mod:`~dscache_operator.analysis` - PromQL queries and their verdicts.
* :mod:`~dscache_operator.kube` and :mod:`~dscache_operator.reconcile` - the only
  code that talks to the API server; :mod:`~dscache_operator.handlers` - thin
  kopf handlers; :mod:`~dscache_operator.cli` - ``dscache operator``.
"""

GROUP = "dscache.io"
VERSION = "v1alpha1"
KIND = "DeepSeekCacheDeployment"
PLURAL = "deepseekcachedeployments"
SINGULAR = "deepseekcachedeployment"
SHORT_NAMES = ("dscd",)
API_VERSION = f"{GROUP}/{VERSION}"
FIELD_MANAGER = "dscache-operator"

__all__ = [
    "API_VERSION",
    "FIELD_MANAGER",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
]
