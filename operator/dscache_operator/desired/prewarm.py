"""The prewarm Jobs of a new revision (pure).

Job ``<name>-prewarm-<revision>`` replays the prewarm prompts against the
ready canary pods before the canary takes traffic. With ``placement: all``
(the default) one Job sends every prompt to every canary pod before step 0.
With ``placement: ring`` each prompt goes only to the pods the router's
consistent hash tries first for it, and the warming is progressive: by step
``i`` (weight ``w``) each prompt is on the first ``ceil(pods * w / 100)`` pods
of its walk (at least one), so Job ``<name>-prewarm-<revision>-s<i>`` runs
during step ``i - 1`` for each step that needs more copies than the one before,
adding only the new ones. A Job's pod template is immutable: the reconciler
creates each once, with the addresses of that moment, and never re-applies it.
"""

from __future__ import annotations

import math

from dscache_operator.desired import common
from dscache_operator.desired.common import REVISION, SLOT, TMP, Obj, Owner
from dscache_operator.schema import parse_duration
from dscache_operator.spec import DeepSeekCacheDeploymentSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

PREWARM_TARGETS_ENV = "DSCACHE_PREWARM_TARGETS"
#: The stable pods whose mined templates the Job fetches.
PREWARM_SOURCES_ENV = "DSCACHE_PREWARM_SOURCES"
#: The gateway token ``dscache prewarm`` reads mined templates (and sends their tenants) with.
PREWARM_GATEWAY_TOKEN_ENV = "DSCACHE_PREWARM_GATEWAY_TOKEN"  # noqa: S105 - a variable's name
#: The API key ``dscache prewarm`` sends when ``--api-key`` is not given.
PREWARM_API_KEY_ENV = "DSCACHE_PREWARM_API_KEY"


def prewarm_job_name(owner: Owner, revision: str, step: int = 0) -> str:
    """Name of the prewarm Job of ``revision`` for rollout step ``step``."""
    return f"{owner.name}-prewarm-{revision}" + (f"-s{step}" if step else "")


def prewarm_copies(pods: int, weight: int) -> int:
    """Copies of each prompt the canary's ``pods`` hold by a step at ``weight`` percent."""
    return max(1, min(pods, math.ceil(pods * weight / 100)))


def progressive(spec: DeepSeekCacheDeploymentSpec) -> bool:
    """Whether steps after the first may need prewarm Jobs of their own (``placement: ring``)."""
    return spec.prewarm.placement == "ring"


def prewarm_copy_range(
    spec: DeepSeekCacheDeploymentSpec, pods: int, step: int
) -> tuple[int, int] | None:
    """``(skip, copies)`` of the walk the Job of ``step`` warms; None: the step needs no Job.

    Step 0 always warms (all pods with ``placement: all``); a later step only
    with ``placement: ring`` and more copies than the step before.
    """
    steps = spec.steps
    if not progressive(spec):
        return (0, pods) if step == 0 else None
    if step >= len(steps) or pods < 1:
        return None
    copies = prewarm_copies(pods, steps[step])
    skip = prewarm_copies(pods, steps[step - 1]) if step else 0
    return (skip, copies) if copies > skip else None


def mined_active(spec: DeepSeekCacheDeploymentSpec) -> bool:
    """Whether prewarm Jobs also send the stable pods' live-mined templates."""
    return (
        spec.prewarm.mined.enabled
        and spec.auth.gateway_secret_ref is not None
        and spec.engine != "vllm"
    )


def prewarm_active(spec: DeepSeekCacheDeploymentSpec) -> bool:
    """Whether a new revision is prewarmed at all (a prompt list or mined templates)."""
    return spec.prewarm.enabled and (spec.prewarm.prompts is not None or mined_active(spec))


def _gateway_env(spec: DeepSeekCacheDeploymentSpec) -> list[Obj]:
    ref = spec.auth.gateway_secret_ref
    if ref is None or not mined_active(spec):
        return []
    key_ref = {"name": ref.name, "key": ref.key}
    return [{"name": PREWARM_GATEWAY_TOKEN_ENV, "valueFrom": {"secretKeyRef": key_ref}}]


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
    *,
    step: int = 0,
    sources: tuple[str, ...] = (),
) -> Obj | None:
    """The prewarm Job of the canary revision for rollout step ``step``.

    Args:
        owner: the resource.
        spec: its spec (prompts, topN, concurrency, timeout, image, placement,
            the router's prompt key).
        status: the status naming the canary slot and revision.
        targets: ``ip:port`` of every ready canary pod, as the router's upstream
            lists them (its ring is built from them). None yet (no ready pod):
            no Job yet.
        step: the rollout step the Job warms for (see the module docstring).
        sources: ``ip:port`` of the ready stable pods, whose mined templates the
            Job sends too (with ``prewarm.mined`` active; none: only the prompts).

    Returns:
        The Job, or None: nothing to prewarm (yet), or the step needs no Job.

    A Job's pod template is immutable: the caller creates this once per
    revision and step, with the addresses of that moment, and never re-applies it.
    """
    p = spec.prewarm
    slot, revision = status.canary_slot, status.canary_revision
    if not prewarm_active(spec) or slot is None or revision is None or not targets:
        return None
    copies = prewarm_copy_range(spec, len(targets), step)
    if copies is None:
        return None
    urls = ",".join(f"http://{address}" for address in targets)
    env: list[Obj] = [{"name": PREWARM_TARGETS_ENV, "value": urls}]
    args = ["prewarm", "--target", f"$({PREWARM_TARGETS_ENV})"]
    if p.prompts is not None:
        args += ["--prompts", "/prewarm/prompts.jsonl", "--top-n", str(p.top_n)]
    if mined_active(spec):
        # No ready stable pod: an empty list, which the Job reports and skips.
        env.append({"name": PREWARM_SOURCES_ENV, "value": ",".join(f"http://{a}" for a in sources)})
        args += ["--mined-from", f"$({PREWARM_SOURCES_ENV})", "--mined-top", str(p.mined.top)]
    args += ["--concurrency", str(p.concurrency), "--quiet"]
    if progressive(spec):
        r = spec.routing
        args += ["--placement", "ring", "--skip-copies", str(copies[0])]
        args += ["--copies", str(copies[1]), "--prompt-key-max-bytes", str(r.prompt_key_bytes)]
    mounts: list[Obj] = []
    volumes: list[Obj] = []
    if p.prompts is not None:
        mounts.append({"name": "prompts", "mountPath": "/prewarm", "readOnly": True})
        items = [{"key": p.prompts.key, "path": "prompts.jsonl"}]
        volumes.append({"name": "prompts", "configMap": {"name": p.prompts.name, "items": items}})
    lbls = {**common.labels(owner, "prewarm", "canary"), SLOT: slot, REVISION: revision}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": common.meta(owner, prewarm_job_name(owner, revision, step), lbls),
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
                            "env": [*env, *_api_key_env(spec), *_gateway_env(spec)],
                            "resources": {
                                "requests": {"cpu": "50m", "memory": "128Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "volumeMounts": [*mounts, {"name": "tmp", "mountPath": TMP}],
                        }
                    ],
                    "volumes": [*volumes, {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
                },
            },
        },
    }
