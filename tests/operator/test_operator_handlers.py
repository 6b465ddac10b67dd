"""How a reconcile's outcome becomes kopf's: retry, give up, or leave alone."""

from __future__ import annotations

import json

import kopf
import pytest
from dscache_operator.handlers import _run
from dscache_operator.kube import ApiError, Kube
from dscache_operator.metrics import OperatorMetrics
from dscache_operator.reconcile import Reconciler
from dscache_operator.settings import OperatorSettings


class _FailingReconciler(Reconciler):
    """A real Reconciler whose reconcile raises the API answer under test."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(Kube.__new__(Kube), OperatorSettings(), OperatorMetrics())
        self.error = error

    def reconcile(self, namespace: str, name: str, reader: object = None) -> None:  # type: ignore[override]
        raise self.error


def _body() -> kopf.Body:
    return kopf.Body({"metadata": {"namespace": "gone", "name": "chat", "uid": "u1"}})


def _forbidden(reason: str) -> ApiError:
    body = json.dumps(
        {
            "kind": "Status",
            "code": 403,
            "reason": "Forbidden",
            "details": {"causes": [{"reason": reason}]},
        }
    )
    return ApiError(403, "Forbidden", body)


def _count(r: Reconciler, result: str) -> float:
    v = r.metrics.registry.get_sample_value("dscache_operator_reconciles_total", {"result": result})
    return v or 0.0


def test_a_resource_in_a_terminating_namespace_is_left_alone() -> None:
    r = _FailingReconciler(_forbidden("NamespaceTerminating"))
    _run(r, _body(), permanent=True)  # no retry, no error in the log
    assert _count(r, "namespace_terminating") == 1
    assert _count(r, "api_error") == 0


def test_an_rbac_refusal_is_still_an_error_that_retries() -> None:
    r = _FailingReconciler(_forbidden("FieldValueForbidden"))
    with pytest.raises(kopf.TemporaryError):
        _run(r, _body(), permanent=True)
    assert _count(r, "api_error") == 1
    assert _count(r, "namespace_terminating") == 0
