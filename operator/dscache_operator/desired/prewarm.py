"""The prewarm Job of a new revision (pure).

Job ``<name>-prewarm-<revision>`` replays the prewarm prompts against every
ready canary pod before the canary takes traffic. A Job's pod template is
immutable: the reconciler creates it once per revision, with the addresses of
that moment, and never re-applies it.
"""

from __future__ import annotations

from dscache_operator.desired import common
from dscache_operator.desired.common import REVISION, SLOT, TMP, Obj, Owner
from dscache_operator.schema import parse_duration
from dscache_operator.spec import DeepSeekCacheDeploymentSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

PREWARM_TARGETS_ENV = "DSCACHE_PREWARM_TARGETS"
#: The API key ``dscache prewarm`` sends when ``--api-key`` is not given.
PREWARM_API_KEY_ENV = "DSCACHE_PREWARM_API_KEY"


def prewarm_job_name(owner: Owner, revision: str) -> str:
    """Name of the prewarm Job of ``revision``."""
    return f"{owner.name}-prewarm-{revision}"


def _api_key_env(spec: DeepSeekCacheDeploymentSpec) -> list[Obj]:
    ref = spec.prewarm.api_key_secret_ref
    if ref is None:
        return []
    key_ref = {"name": ref.name, "key": ref.key}
    return [{"name": PREWARM_API_KEY_ENV, "valueFrom": {"secretKeyRef": key_ref}}]


def prewarm_job(
    owner: Owner,
    spec: DeepSeekCacheDeploymentSpec,
    status: DeepSeekCacheDeploymentStatus,
    targets: tuple[str, ...],
) -> Obj | None:
    """The prewarm Job of the canary revision (None: nothing to prewarm yet).

    Args:
        owner: the resource.
        spec: its spec (prompts, topN, concurrency, timeout, image).
        status: the status naming the canary slot and revision.
        targets: ``ip:port`` of every ready canary pod: the router may send a
            session to any of them, so every one gets every prompt. None yet
            (no ready pod): no Job yet.

    A Job's pod template is immutable: the caller creates this once per
    revision, with the addresses of that moment, and never re-applies it.
    """
    p = spec.prewarm
    slot, revision = status.canary_slot, status.canary_revision
    if not p.enabled or p.prompts is None or slot is None or revision is None or not targets:
        return None
    urls = ",".join(f"http://{address}" for address in targets)
    args = ["prewarm", "--target", f"$({PREWARM_TARGETS_ENV})"]
    args += ["--prompts", "/prewarm/prompts.jsonl", "--top-n", str(p.top_n)]
    args += ["--concurrency", str(p.concurrency), "--quiet"]
    lbls = {**common.labels(owner, "prewarm", "canary"), SLOT: slot, REVISION: revision}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": common.meta(owner, prewarm_job_name(owner, revision), lbls),
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": max(1, int(parse_duration(p.timeout))),
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": lbls},
                "spec": {
                    **common.pod_spec(spec.scheduling),
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            **common.container("prewarm", p.image, ["dscache"], args),
                            "env": [
                                {"name": PREWARM_TARGETS_ENV, "value": urls},
                                *_api_key_env(spec),
                            ],
                            "resources": {
                                "requests": {"cpu": "50m", "memory": "128Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "volumeMounts": [
                                {"name": "prompts", "mountPath": "/prewarm", "readOnly": True},
                                {"name": "tmp", "mountPath": TMP},
                            ],
                        }
                    ],
                    "volumes": [
                        {
                            "name": "prompts",
                            "configMap": {
                                "name": p.prompts.name,
                                "items": [{"key": p.prompts.key, "path": "prompts.jsonl"}],
                            },
                        },
                        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
                    ],
                },
            },
        },
    }
