"""What the cluster admin allows a resource to make the operator do (pure).

A namespace user who may create a ``DeepSeekCacheDeployment`` must not get,
through the operator, what the admin withholds from them directly: node
directories, unbounded node disk, every node, the shared tier's credential in
an image of their choosing, or outbound requests to any URL. The admin's rules
are the operator's settings (``DSCACHE_OPERATOR_*``, the chart's
``operator.policy`` values), gathered in one :class:`AdminPolicy`;
:func:`check_spec` holds a parsed spec against them before anything is
rendered.

Rules and their defaults:

* **hostPath roots** (``/var/lib/dscache``): a ``hostPath`` cache directory must
  be one of the roots or below one, after normalisation (``..`` and repeated
  slashes resolved as the kubelet would); an empty list refuses hostPath caches.
* **cache size** (at most ``1Ti`` per pod).
* **tolerations**: each toleration's key must match one of the allowed key
  patterns (``fnmatch``; default ``*``: any named key); a toleration without a
  key tolerates every taint (control-plane and NotReady nodes included) and is
  refused unless ``allowKeylessTolerations``.
* **shared-tier images**: the shared tier's credential goes only to a sidecar
  image that matches an allowed pattern (default: the project's core image).
* **Prometheus URLs**: rollout analysis fetches only the operator's own URL and
  the allowed list (:meth:`AdminPolicy.prometheus_allowed`).
* **the cache-owner image**: the root init container of a hostPath cache runs
  the admin's image, never the resource's.
* **NetworkPolicies** (on) and the peers that may scrape the pods' metrics
  (Prometheus pods, ``app.kubernetes.io/name: prometheus``, in any namespace):
  see :mod:`dscache_operator.desired.network`.

A refusal is a :class:`NotAllowedError` (an :class:`InvalidSpecError` with the
reason ``NotAllowed``), whose message names the rule and the admin setting.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dscache_operator.quantity import quantity_bytes
from dscache_operator.revision import DEFAULT_CORE_IMAGE, ImageSpec
from dscache_operator.schema import InvalidSpecError
from dscache_operator.spec import DeepSeekCacheDeploymentSpec

#: The admin's default hostPath root.
DEFAULT_HOST_PATH_ROOT = "/var/lib/dscache"
#: The default largest cache per pod.
DEFAULT_MAX_CACHE_SIZE = "1Ti"


#: Who scrapes the pods by default: Prometheus pods (the Prometheus Operator's and the
#: community chart's carry this label) in any namespace.
DEFAULT_METRICS_PEERS: tuple[dict[str, Any], ...] = (
    {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    },
)


class NotAllowedError(InvalidSpecError):
    """The spec asks for something the admin's policy does not allow."""

    reason = "NotAllowed"


def normalise_host_path(path: str) -> str:
    """``path`` as the node sees it: ``..``, ``.`` and repeated slashes resolved.

    ``posixpath.normpath`` keeps a leading ``//``; a path is made absolute and
    single-slashed first, so ``//etc`` and ``/var/lib/dscache/../../etc`` both
    come out as ``/etc``.
    """
    return posixpath.normpath("/" + path.lstrip("/"))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def normalise_url(url: str) -> str:
    """A Prometheus base URL compared by its text without trailing slashes."""
    return url.strip().rstrip("/")


@dataclass(frozen=True)
class AdminPolicy:
    """The admin's rules (see the module docstring); the defaults are the operator's."""

    host_path_roots: tuple[str, ...] = (DEFAULT_HOST_PATH_ROOT,)
    max_cache_size: str = DEFAULT_MAX_CACHE_SIZE
    toleration_keys: tuple[str, ...] = ("*",)
    allow_keyless_tolerations: bool = False
    shared_tier_images: tuple[str, ...] = (
        f"{DEFAULT_CORE_IMAGE.repository}:*",
        f"{DEFAULT_CORE_IMAGE.repository}@sha256:*",
    )
    prometheus_url: str | None = None
    prometheus_urls: tuple[str, ...] = ()
    cache_owner_image: ImageSpec = field(default=DEFAULT_CORE_IMAGE)
    network_policies: bool = True
    metrics_peers: tuple[dict[str, Any], ...] = DEFAULT_METRICS_PEERS

    def __post_init__(self) -> None:
        roots = tuple(normalise_host_path(r) for r in self.host_path_roots if r.strip())
        object.__setattr__(self, "host_path_roots", roots)
        quantity_bytes(self.max_cache_size)  # a bad setting fails at start-up

    @property
    def max_cache_bytes(self) -> int:
        """:attr:`max_cache_size` in bytes."""
        return quantity_bytes(self.max_cache_size)

    def host_path_allowed(self, path: str) -> bool:
        """Whether ``path`` (normalised) is a root or below one."""
        p = normalise_host_path(path)
        return any(_under(p, root) for root in self.host_path_roots)

    def prometheus_allowed(self, url: str) -> bool:
        """Whether analysis may fetch ``url``: the operator's own, or one on the list."""
        allowed = {normalise_url(u) for u in (*self.prometheus_urls, self.prometheus_url or "")}
        return normalise_url(url) in allowed - {""}

    def image_for_shared_tier(self, image: ImageSpec) -> bool:
        """Whether a sidecar running ``image`` may receive the shared tier's credential."""
        return _matches(image.reference, self.shared_tier_images)


def _matches(value: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in patterns)


DEFAULT_POLICY = AdminPolicy()


def check_spec(spec: DeepSeekCacheDeploymentSpec, policy: AdminPolicy) -> None:
    """Refuses what ``policy`` does not allow.

    Raises:
        NotAllowedError: naming the field, the rule and the operator setting.
    """
    vol = spec.cache.volume
    hostpath = vol.host_path if vol.type == "hostPath" else None
    if hostpath is not None and not policy.host_path_allowed(hostpath):
        roots = ", ".join(policy.host_path_roots) or "none"
        raise NotAllowedError(
            f"spec.cache.volume.hostPath {hostpath!r} (normalised "
            f"{normalise_host_path(hostpath)!r}) is outside the host directories the admin "
            f"allows for caches ({roots}; operator setting DSCACHE_OPERATOR_HOST_PATH_ROOTS): "
            "use a directory below one of them, or an emptyDir or claimTemplate cache"
        )
    size = quantity_bytes(spec.cache.size)
    if size > policy.max_cache_bytes:
        raise NotAllowedError(
            f"spec.cache.size {spec.cache.size} is above the largest cache per pod the admin "
            f"allows ({policy.max_cache_size}; DSCACHE_OPERATOR_MAX_CACHE_SIZE)"
        )
    for i, t in enumerate(spec.scheduling.tolerations):
        where = f"spec.scheduling.tolerations[{i}]"
        if t.key is None:
            if not policy.allow_keyless_tolerations:
                raise NotAllowedError(
                    f"{where} has no key: it would tolerate every taint (control-plane and "
                    "unhealthy nodes too); name the taint's key "
                    "(DSCACHE_OPERATOR_ALLOW_KEYLESS_TOLERATIONS allows it)"
                )
        elif not _matches(t.key, policy.toleration_keys):
            raise NotAllowedError(
                f"{where}.key {t.key!r} is not a taint the admin lets resources tolerate "
                f"({', '.join(policy.toleration_keys) or 'none'}; "
                "DSCACHE_OPERATOR_TOLERATION_KEYS)"
            )
    shared = spec.cache.shared
    if shared.enabled and not policy.image_for_shared_tier(spec.sidecar.image):
        raise NotAllowedError(
            f"spec.sidecar.image {spec.sidecar.image.reference!r} may not receive the shared "
            "tier's credential: the admin allows it only for "
            f"{', '.join(policy.shared_tier_images) or 'no image'} "
            "(DSCACHE_OPERATOR_SHARED_TIER_IMAGES); use an allowed sidecar image or disable "
            "spec.cache.shared"
        )
