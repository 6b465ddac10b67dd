"""Builds the dev cluster's binaries from Go modules, once, into a versioned cache.

Contract:
    * ``ensure_built()`` returns paths to kube-apiserver, kube-controller-manager,
      kube-scheduler, kubectl, kubelet, kube-proxy, etcd, kwok, helm and
      kube-router (the real nodes' NetworkPolicy controller) at the
      versions pinned in :mod:`dscache_tools.devcluster.versions`, building
      whatever is missing (:mod:`.gobuild` does one part).
    * Release versions are stamped through ``-ldflags -X`` (component-base and
      client-go for Kubernetes, helm's internal version and its Kubernetes
      capability defaults), so kubectl and helm see the real server version.
    * Idempotent: a part whose ``bin/.dscache-build.json`` stamp matches its
      recipe and whose binaries exist is not touched, so a second run takes
      well under a second. Binaries are moved into ``bin/`` only after a whole
      part built, and the stamp is written last.
    * Builds run under ``nice -n 19`` with the standard GOMODCACHE (sources, kept)
      and a build cache of their own (``<root>/go-build``, several GiB), removed
      once every part is built; the user's GOCACHE is left alone. A file
      lock serialises concurrent builders (CI's background build and a test
      fixture); the second waits and then finds everything built.
    * Standard library only (``scripts/build-dev-cluster.sh`` runs it before
      the project's dependencies are installed).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.devcluster.gobuild import (
    K8S_VERSION_PACKAGES,
    STAMP,
    BuildError,
    Part,
    build_cache,
    build_part,
    find_go,
)
from dscache_tools.devcluster.procs import Progress, exclusive_lock, exit_on_sigterm
from dscache_tools.devcluster.versions import PINNED, Versions, cache_root

logger = logging.getLogger(__name__)

__all__ = ["Binaries", "BuildError", "ensure_built", "is_built", "locate", "main"]


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every executable the dev cluster runs."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    kwok: Path
    helm: Path
    #: Directory with KWOK's Stage manifests of the same KWOK version.
    kwok_stages: Path
    #: The node agents of real (not simulated) nodes.
    kubelet: Path
    kube_proxy: Path
    #: The NetworkPolicy controller of real nodes (kube-router's firewall).
    netpol: Path

    @property
    def tool_dirs(self) -> tuple[Path, ...]:
        """Directories to put first on PATH for the matching kubectl and helm."""
        return (self.kubectl.parent, self.helm.parent)

    def missing(self, with_node_agents: bool = True) -> list[Path]:
        """The executables that are not there (the node agents only when asked)."""
        node_agents = () if with_node_agents else (self.kubelet, self.kube_proxy, self.netpol)
        return [
            p for p in self.all_executables() if p not in node_agents and not os.access(p, os.X_OK)
        ]

    def all_executables(self) -> tuple[Path, ...]:
        """Every executable, for existence checks."""
        return (
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kubectl,
            self.etcd,
            self.kwok,
            self.helm,
            self.kubelet,
            self.kube_proxy,
            self.netpol,
        )


def _kubernetes_part(name: str, commands: tuple[str, ...], versions: Versions) -> Part:
    """A part of ``k8s.io/kubernetes``'s commands, version-stamped like a release build."""
    major, minor = versions.kubernetes_minor
    ldflags = ["-s", "-w"]
    for pkg in K8S_VERSION_PACKAGES:
        ldflags += [
            f"-X {pkg}.gitVersion={versions.kubernetes}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return Part(
        name=name,
        version=versions.kubernetes,
        module="k8s.io/kubernetes",
        packages={f"k8s.io/kubernetes/cmd/{command}": command for command in commands},
        ldflags=tuple(ldflags),
        replace_staging=True,
    )


def _parts(versions: Versions) -> list[Part]:
    major, minor = versions.kubernetes_minor
    helm_ldflags = [
        "-s",
        "-w",
        f"-X helm.sh/helm/v3/internal/version.version={versions.helm}",
        "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
    ]
    for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        helm_ldflags += [f"-X {pkg}.k8sVersionMajor={major}", f"-X {pkg}.k8sVersionMinor={minor}"]
    control_plane = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
    return [
        _kubernetes_part("k8s", control_plane, versions),
        # The node agents, from the same wrapper module: a part of their own, so adding
        # them never relinks the control plane's binaries.
        _kubernetes_part("k8s-node", ("kubelet", "kube-proxy"), versions),
        Part(
            name="etcd",
            version=versions.etcd,
            module="go.etcd.io/etcd/server/v3",
            packages={"go.etcd.io/etcd/server/v3": "etcd"},
            ldflags=("-s", "-w"),
        ),
        Part(
            name="kwok",
            version=versions.kwok,
            module="sigs.k8s.io/kwok",
            packages={"sigs.k8s.io/kwok/cmd/kwok": "kwok"},
            ldflags=(
                "-s",
                "-w",
                f"-X sigs.k8s.io/kwok/pkg/consts.Version={versions.kwok.removeprefix('v')}",
            ),
            # kwokctl's default stages: fast node start, lease heartbeats, fast pods.
            copy_globs=(
                ("kustomize/stage/node/fast/*.yaml", "stages"),
                ("kustomize/stage/node/heartbeat-with-lease/*.yaml", "stages"),
                ("kustomize/stage/pod/fast/*.yaml", "stages"),
            ),
        ),
        Part(
            name="helm",
            version=versions.helm,
            module="helm.sh/helm/v3",
            packages={"helm.sh/helm/v3/cmd/helm": "helm"},
            ldflags=tuple(helm_ldflags),
        ),
        Part(
            name="kube-router",
            version=versions.netpol,
            module="github.com/cloudnativelabs/kube-router/v2",
            packages={"github.com/cloudnativelabs/kube-router/v2/cmd/kube-router": "kube-router"},
            ldflags=(
                "-s",
                "-w",
                "-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version="
                + versions.netpol,
            ),
        ),
    ]


def locate(versions: Versions = PINNED, root: Path | None = None) -> Binaries:
    """Where the binaries of ``versions`` are (or will be) in the cache; builds nothing."""
    base = root or cache_root()
    k8s = base / "k8s" / versions.kubernetes / "bin"
    node = base / "k8s-node" / versions.kubernetes / "bin"
    return Binaries(
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        etcd=base / "etcd" / versions.etcd / "bin" / "etcd",
        kwok=base / "kwok" / versions.kwok / "bin" / "kwok",
        helm=base / "helm" / versions.helm / "bin" / "helm",
        kwok_stages=base / "kwok" / versions.kwok / "stages",
        kubelet=node / "kubelet",
        kube_proxy=node / "kube-proxy",
        netpol=base / "kube-router" / versions.netpol / "bin" / "kube-router",
    )


def is_built(versions: Versions = PINNED, root: Path | None = None) -> bool:
    """True when every part's stamp matches its recipe and its binaries exist."""
    base = root or cache_root()
    return all(is_part_current(part, base) for part in _parts(versions))


def ensure_built(
    versions: Versions = PINNED,
    root: Path | None = None,
    progress: Progress | None = None,
) -> Binaries:
    """Builds every missing part and returns the binaries' paths.

    Args:
        versions: Component versions to build.
        root: Cache root; defaults to :func:`dscache_tools.devcluster.versions.cache_root`.
        progress: Receives one line per step; defaults to the module logger.

    Raises:
        BuildError: Go is missing or too old, or a build failed (the message
            names the log file with Go's output).
    """
    say: Progress = progress or (lambda line: logger.info("%s", line))
    base = root or cache_root()
    parts = _parts(versions)
    if all(is_part_current(part, base) for part in parts):
        say(f"all binaries present in {base}")
        return locate(versions, base)
    build_parts(parts, base, say)
    return locate(versions, base)


def build_parts(parts: list[Part], base: Path, say: Progress) -> None:
    """Builds each part of ``parts`` not current under ``base``, one builder at a time.

    Go's build cache (:func:`.gobuild.build_cache`) is shared by the parts and
    removed once all are built; a failure keeps it, so a retry resumes warm.

    Raises:
        BuildError: As :func:`.gobuild.build_part`.
    """
    base.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(base / ".build.lock", say):
        go = find_go()
        for part in parts:
            if is_part_current(part, base):
                say(f"{part.name} {part.version}: cached in {part.directory(base) / 'bin'}")
                continue
            build_part(part, base, go, say)
        scratch = build_cache(base)
        if scratch.exists():
            say(f"every part built: removing Go's build cache {scratch}")
            shutil.rmtree(scratch, ignore_errors=True)


def is_part_current(part: Part, base: Path) -> bool:
    """True when ``part``'s stamp matches its recipe and its binaries exist under ``base``."""
    bindir = part.directory(base) / "bin"
    try:
        stamp = json.loads((bindir / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict) or stamp.get("recipe") != part.recipe():
        return False
    copied = all(any((part.directory(base) / dest).glob("*")) for _glob, dest in part.copy_globs)
    return copied and all(os.access(bindir / name, os.X_OK) for name in part.packages.values())


def main() -> int:
    """``python -m dscache_tools.devcluster``: build or reuse everything, list the binaries.

    Needs only the standard library and Go, so CI can run it before the
    project's Python dependencies are installed.
    """
    logging.basicConfig(level=logging.INFO, format="[dev cluster build] %(message)s")
    exit_on_sigterm()
    started = time.monotonic()
    try:
        binaries = ensure_built()
    except BuildError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("done in %.1f s", time.monotonic() - started)
    for path in binaries.all_executables():
        logger.info("  %s", path)
    return 0
