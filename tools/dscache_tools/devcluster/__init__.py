"""A real Kubernetes cluster on this machine for tests, demos and local trials.

``dscache dev cluster`` builds kube-apiserver, kube-controller-manager,
kube-scheduler, kubectl, kubelet, kube-proxy, etcd, KWOK and helm from Go
modules at pinned versions, then runs them as local processes: a control
plane on loopback, fake KWOK nodes that advertise CPU, memory and
``nvidia.com/gpu``, and optionally real nodes (containerd + kubelet) whose
pods run dscache's images, with Prometheus beside them. Nothing is mocked:
admission, schema validation, garbage collection, the controllers and the
scheduler are the real ones.

Where to look:
    ===================  =====================================================
    ``versions``         the pins and where binaries and state live
    ``build``            which parts are built (``gobuild``: how one is built)
    ``cluster``          ``DevCluster``: start, find, stop (the lifecycle)
    ``supervisor``       the processes: launch, logs, readiness waits, stop
    ``controlplane``     component command lines, readiness probes
    ``pki``              CA and certificates (API server, admin, kubelets)
    ``kubeconfig``       the kubeconfig files written from them
    ``nodes``            the fake nodes' shapes (GPU and CPU-only) and KWOK
    ``realnodes``        what a real node is: paths, addresses, config texts
    ``nodeagents``       starting and draining real nodes, Prometheus
    ``host``             the host ledger: every change recorded, then undone
    ``hostnet``          sysctls, bridges and iptables (``hostfs``: cgroups, mounts)
    ``images``           dscache's images, built without a registry, loaded into nodes
    ``podsd``            pod discovery for Prometheus; ``prometheus``: its config
    ``api``, ``procs``   a tiny HTTPS client, process/file helpers (waiting is
                         :mod:`dscache_tools.polling`, re-exported as ``wait_until``)
    ===================  =====================================================

Why our own and not ``kwokctl``:
    kwokctl's binary runtime does what :mod:`.cluster` does for the control
    plane (start etcd, the API server, controller manager, scheduler and
    KWOK, write a PKI and kubeconfig). We weighed moving that part to it and
    kept ours, because it would remove little and cost more than it removes:

    * The binaries: kwokctl downloads release binaries from dl.k8s.io and
      GitHub, which this project cannot reach (only the Go module proxy and
      package registries work); it would run ours (``--kube-binary-prefix``),
      so :mod:`.build` stays either way. Building kwokctl itself is cheap (it
      is in the KWOK module we build already) but adds a part and a pin.
    * Real nodes: kwokctl has no notion of a real kubelet. Ours needs the API
      server on node 0's bridge address, kubelet client flags, the Node
      authorizer, and kubelet and kube-proxy certificates from the same CA;
      through kwokctl that is a patch per flag plus reading its PKI to issue
      node certificates: the same code in a YAML layer.
    * Guarantees the tests rely on: with ``tie_to_parent`` no process
      outlives a killed pytest (PR_SET_PDEATHSIG); stop signals only pids
      whose executable is the recorded binary; a foreign directory or
      kubeconfig is never overwritten; the host ledger (:mod:`.host`) undoes
      every host change, also after a crash. kwokctl runs its processes
      detached and keeps its own state under ``~/.kwok``.
    * GPU and CPU-only node shapes (:mod:`.nodes`), the images
      (:mod:`.images`) and Prometheus with pod discovery are ours in any case.

    What we do take from KWOK: its controller (the ``kwok`` binary) and the
    Stage manifests kwokctl itself uses (fast node start, lease heartbeat,
    fast pods), at the same pinned version.

Contract:
    * Binaries are cached per version outside the repository and built at most
      once (:func:`.build.ensure_built`); :mod:`.build` and :mod:`.images` need
      the standard library only (they run before the project is installed).
    * :meth:`.cluster.DevCluster.start` returns a ready cluster or raises with
      the component logs named; :meth:`.cluster.DevCluster.stop` leaves no
      process and no host change behind.
    * The pytest fixture in ``tests/conftest.py``, the Kubernetes demo and the
      CLI (:mod:`dscache_tools.devcli`) share this code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dscache_tools.devcluster.build import Binaries, BuildError, ensure_built, is_built, locate
from dscache_tools.devcluster.versions import PINNED, Versions, cache_root, default_state_dir

if TYPE_CHECKING:
    from dscache_tools.devcluster.cluster import ClusterError, DevCluster, ToolError
    from dscache_tools.polling import wait_until

__all__ = [
    "PINNED",
    "Binaries",
    "BuildError",
    "ClusterError",
    "DevCluster",
    "Versions",
    "cache_root",
    "default_state_dir",
    "ensure_built",
    "is_built",
    "locate",
    "ToolError",
    "wait_until",
]

# ``python -m dscache_tools.devcluster`` (the build) and ``...devcluster.images``
# import this package before the project's dependencies may be installed, so
# what needs them (the cluster: tenacity) is imported on first use only.
_LAZY = {
    "ClusterError": f"{__name__}.cluster",
    "DevCluster": f"{__name__}.cluster",
    "ToolError": f"{__name__}.cluster",
    "wait_until": "dscache_tools.polling",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
