"""A real Kubernetes control plane on loopback for tests and local trials.

``dscache dev cluster`` builds kube-apiserver, kube-controller-manager,
kube-scheduler, kubectl, etcd, KWOK and helm from Go modules at pinned versions
(:mod:`.versions`, :mod:`.build`), then runs them as local processes bound to
127.0.0.1 with fake KWOK nodes that advertise CPU, memory and ``nvidia.com/gpu``
(:mod:`.cluster`, :mod:`.nodes`). Nothing is mocked: admission, schema
validation, garbage collection, the Deployment and ReplicaSet controllers and
the scheduler are the real ones; only kubelets are simulated, so pods reach
Running and Ready without running any process.

Contract:
    * Binaries are cached per version outside the repository and built at most
      once (:func:`.build.ensure_built`).
    * :meth:`.cluster.DevCluster.start` returns a ready cluster or raises with
      the component logs named; :meth:`.cluster.DevCluster.stop` leaves no
      process behind.
    * The pytest fixture in ``tests/conftest.py`` and the CLI share this code.
"""

from dscache_tools.devcluster.build import Binaries, BuildError, ensure_built, is_built, locate
from dscache_tools.devcluster.cluster import ClusterError, DevCluster, ToolError, wait_until
from dscache_tools.devcluster.versions import PINNED, Versions, cache_root, default_state_dir

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
