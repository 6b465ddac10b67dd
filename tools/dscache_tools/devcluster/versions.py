"""Pinned versions of the dev cluster's parts and where their files live.

Contract:
    * Every binary the dev cluster runs is built from source through the Go
      module proxy at exactly the versions pinned here; changing a pin changes
      the cache directory, so old and new builds never mix.
    * Binaries live outside the repository in a per-user cache,
      ``${XDG_CACHE_HOME:-~/.cache}/dscache/<part>/<version>/bin/``, and are
      never committed. ``DSCACHE_DEVCLUSTER_CACHE`` overrides the root.
    * A running cluster's state (pids, certificates, logs, kubeconfig) lives in
      ``${XDG_STATE_HOME:-~/.local/state}/dscache/devcluster/`` unless the
      caller names another directory; ``DSCACHE_DEVCLUSTER_STATE`` overrides
      the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Kubernetes release: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl.
KUBERNETES_VERSION = "v1.35.8"
#: etcd 3.6 is the series Kubernetes 1.35 is released and tested with.
ETCD_VERSION = "v3.6.16"
#: KWOK simulates nodes and pod status; it is only a client of the API server.
KWOK_VERSION = "v0.8.0"
#: Helm 3.20 is built against the Kubernetes 1.35 client libraries.
HELM_VERSION = "v3.20.2"
#: kube-router, run as its NetworkPolicy firewall alone (iptables + ipset) on real
#: nodes. The only version the module proxy offers; a dev-cluster tool, never shipped.
#: (sigs.k8s.io/kube-network-policies builds too, but needs the nftables queue
#: statement, which this kernel lacks: see docs/security.md.)
NETPOL_VERSION = "v2.1.0"


@dataclass(frozen=True)
class Versions:
    """One consistent set of component versions (all with a leading ``v``)."""

    kubernetes: str = KUBERNETES_VERSION
    etcd: str = ETCD_VERSION
    kwok: str = KWOK_VERSION
    helm: str = HELM_VERSION
    netpol: str = NETPOL_VERSION

    @property
    def kubernetes_minor(self) -> tuple[str, str]:
        """``("1", "35")`` for ``v1.35.8``."""
        major, minor, _patch = self.kubernetes.removeprefix("v").split(".", 2)
        return major, minor

    @property
    def staging(self) -> str:
        """Published version of the staging modules: ``v0.35.8`` for ``v1.35.8``."""
        _major, rest = self.kubernetes.removeprefix("v").split(".", 1)
        return f"v0.{rest}"


PINNED = Versions()


def cache_root() -> Path:
    """Root of the binary cache (``.../dscache``), created on demand by the builder."""
    override = os.environ.get("DSCACHE_DEVCLUSTER_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dscache"


def default_state_dir() -> Path:
    """Where ``dscache dev cluster up`` keeps a cluster's state by default."""
    override = os.environ.get("DSCACHE_DEVCLUSTER_STATE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / "dscache" / "devcluster"
