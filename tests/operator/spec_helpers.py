"""Helpers the operator's pure-logic tests share (imported by name).

``status_for`` runs the rollout machine one step, as the operator does for a
new resource; ``validated_deployment`` renders a model Deployment and checks it
against the Kubernetes 1.35 schema; ``released_revision`` is the revision the
operator as released computed for a spec: the hash of its source without the
fields added since, which must equal today's while they hold their defaults (no
rollout on an operator upgrade).
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import kubernetes_validate
from dscache_operator.desired import Owner, model_deployment
from dscache_operator.revision import RevisionSource, revision_of
from dscache_operator.rollout import next_step
from dscache_operator.rollout_types import Observed, TrackObservation
from dscache_operator.spec import DeepSeekCacheDeploymentSpec
from dscache_operator.status import DeepSeekCacheDeploymentStatus

OWNER = Owner("chat", "prod", "0c5f0e38-8a7a-4f5b-9d63-2c1d3d1c2a11")
T0 = datetime(2026, 11, 30, 12, tzinfo=UTC)
READY = TrackObservation(exists=True, ready=True)

#: Fields of the revision source added after release, as paths into its JSON form.
ADDED_SINCE_RELEASE: tuple[tuple[str, ...], ...] = (
    ("auth",),
    ("engine",),
    ("vllm",),
    ("cache", "directLookup"),
    ("cache", "shared"),
    ("cache", "volume", "claimTemplate"),
    ("cache", "eviction"),
    ("cache", "kvEvents"),
    ("server", "dtype"),
)


def status_for(
    spec: DeepSeekCacheDeploymentSpec, status: DeepSeekCacheDeploymentStatus | None = None
) -> DeepSeekCacheDeploymentStatus:
    """The status after one rollout step for ``spec`` with both tracks ready."""
    src = spec.revision_source()
    o = Observed(
        generation=1,
        revision=revision_of(src),
        source=src.model_dump(mode="json", by_alias=True),
        prewarm_enabled=False,
        tracks={"blue": READY, "green": READY},
    )
    return next_step(status or DeepSeekCacheDeploymentStatus(), o, T0).status


def validated_deployment(
    spec: DeepSeekCacheDeploymentSpec, status: DeepSeekCacheDeploymentStatus | None = None
) -> dict[str, Any]:
    """The blue track's model Deployment, valid for Kubernetes 1.35 (strict)."""
    dep = model_deployment(OWNER, spec, status or status_for(spec), "blue")
    kubernetes_validate.validate(dep, "1.35.0", strict=True)
    return dep


def released_source(src: RevisionSource) -> dict[str, Any]:
    """``src`` as the released operator stored it: without :data:`ADDED_SINCE_RELEASE`."""
    source: dict[str, Any] = src.model_dump(mode="json", by_alias=True)
    for *parents, name in ADDED_SINCE_RELEASE:
        node = source
        for key in parents:
            node = node[key]
        del node[name]
    return source


def released_revision(src: RevisionSource) -> str:
    """The revision the released operator computed for ``src``."""
    text = json.dumps(released_source(src), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]
