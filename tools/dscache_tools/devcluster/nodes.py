"""The fake nodes of a dev cluster and KWOK's configuration, as pure data.

Contract:
    * ``node_shapes(n)`` is deterministic: nodes ``dev-node-0`` ..
      ``dev-node-{n-1}``, each with 32 CPUs, 256Gi memory and 110 pods.
      Every node advertises ``GPUS_PER_NODE`` ``nvidia.com/gpu`` except the
      last one of two or more nodes, which has none, so GPU scheduling is
      always testable: with the default three nodes, two have GPUs, one has not.
    * Each node carries the annotation ``kwok.x-k8s.io/node: fake``; KWOK
      manages exactly the nodes with that annotation and leaves others alone.
    * Each carries ``dscache.io/node-kind=simulated``; in a cluster with real
      nodes also the taint ``dscache.io/simulated=true:NoSchedule``, so a pod
      lands on a simulated node only when it tolerates that (tests that need
      many or GPU nodes) and ordinary workloads run on real nodes.
    * ``kwok_config(stages)`` is KWOK's ``--config`` text: the Stage manifests
      shipped with the same KWOK version (node start, lease heartbeat, pod
      ready/complete/delete), so pods bound to a node go Running and Ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Annotation KWOK selects its nodes by.
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_SELECTOR = f"{KWOK_ANNOTATION}=fake"
#: Label on every dev node, and on GPU nodes the one NVIDIA's device plugin sets.
DEV_NODE_LABEL = "dscache.io/dev-node"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
GPU_RESOURCE = "nvidia.com/gpu"
GPUS_PER_NODE = 8
#: ``real`` (kubelet + containerd) or ``simulated`` (KWOK).
NODE_KIND_LABEL = "dscache.io/node-kind"
#: NoSchedule taint of simulated nodes in a cluster that also has real nodes.
SIMULATED_TAINT = "dscache.io/simulated"
#: What a pod spec adds to run on a simulated node (and only there).
SIMULATED_PLACEMENT: dict[str, Any] = {
    "nodeSelector": {NODE_KIND_LABEL: "simulated"},
    "tolerations": [{"key": SIMULATED_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
}


@dataclass(frozen=True)
class NodeShape:
    """What one fake node advertises."""

    name: str
    cpu: str = "32"
    memory: str = "256Gi"
    pods: str = "110"
    gpus: int = GPUS_PER_NODE


def node_shapes(count: int) -> list[NodeShape]:
    """The ``count`` nodes of a cluster; the last of two or more has no GPU.

    Raises:
        ValueError: ``count`` is below 1.
    """
    if count < 1:
        raise ValueError(f"a dev cluster needs at least one node, got {count}")
    shapes = []
    for index in range(count):
        cpu_only = count >= 2 and index == count - 1
        shapes.append(NodeShape(name=f"dev-node-{index}", gpus=0 if cpu_only else GPUS_PER_NODE))
    return shapes


def node_manifest(shape: NodeShape, simulated_taint: bool = False) -> dict[str, Any]:
    """The Node object to create for ``shape`` (status included; KWOK keeps it).

    Args:
        shape: What the node advertises.
        simulated_taint: Taint it ``dscache.io/simulated=true:NoSchedule`` (a
            cluster with real nodes: only pods that tolerate it land here).
    """
    resources = {
        "cpu": shape.cpu,
        "memory": shape.memory,
        "pods": shape.pods,
        "ephemeral-storage": "1Ti",
    }
    labels = {
        "kubernetes.io/hostname": shape.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        DEV_NODE_LABEL: "true",
        NODE_KIND_LABEL: "simulated",
    }
    if shape.gpus:
        resources[GPU_RESOURCE] = str(shape.gpus)
        labels[GPU_PRESENT_LABEL] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": shape.name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": (
            {"taints": [{"key": SIMULATED_TAINT, "value": "true", "effect": "NoSchedule"}]}
            if simulated_taint
            else {}
        ),
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
            },
        },
    }


def kwok_config(stages_dir: Path) -> str:
    """KWOK's multi-document config: every Stage manifest in ``stages_dir``.

    Raises:
        FileNotFoundError: ``stages_dir`` has no Stage manifests.
    """
    files = sorted(stages_dir.glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no KWOK Stage manifests in {stages_dir}")
    return "\n---\n".join(file.read_text().strip() for file in files) + "\n"
