"""The dev cluster's pure parts, without starting anything."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from dscache_tools.devcluster import PINNED, Versions, build, gobuild, locate, podsd
from dscache_tools.devcluster.access import _with_own
from dscache_tools.devcluster.cluster import ClusterError, DevCluster
from dscache_tools.devcluster.nodes import GPU_RESOURCE, kwok_config, node_manifest, node_shapes
from dscache_tools.devcluster.pki import generate

KUBERNETES_GOMOD = """
module k8s.io/kubernetes

go 1.25.0

require (
\tk8s.io/api v0.0.0
\tgithub.com/spf13/cobra v1.10.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tgithub.com/some/fork => github.com/other/fork v1.2.3
)

replace k8s.io/kms => ./staging/src/k8s.io/kms
"""


def test_staging_replacements_cover_every_local_replace() -> None:
    got = gobuild.staging_replacements(KUBERNETES_GOMOD, "v0.35.8")
    assert got == {
        "k8s.io/api": "v0.35.8",
        "k8s.io/client-go": "v0.35.8",
        "k8s.io/kms": "v0.35.8",
    }


def test_staging_version_follows_the_release() -> None:
    assert Versions(kubernetes="v1.35.8").staging == "v0.35.8"
    assert Versions(kubernetes="v1.34.12").kubernetes_minor == ("1", "34")


def test_binaries_live_in_versioned_cache_dirs(tmp_path: Path) -> None:
    found = locate(PINNED, tmp_path)
    assert found.kube_apiserver == tmp_path / "k8s" / PINNED.kubernetes / "bin" / "kube-apiserver"
    assert found.etcd == tmp_path / "etcd" / PINNED.etcd / "bin" / "etcd"
    assert found.helm == tmp_path / "helm" / PINNED.helm / "bin" / "helm"
    assert found.tool_dirs == (found.kubectl.parent, found.helm.parent)
    assert not build.is_built(PINNED, tmp_path)


def test_last_node_has_no_gpu() -> None:
    shapes = node_shapes(3)
    assert [s.name for s in shapes] == ["dev-node-0", "dev-node-1", "dev-node-2"]
    assert [s.gpus for s in shapes] == [8, 8, 0]
    assert node_shapes(1)[0].gpus == 8
    with pytest.raises(ValueError, match="at least one node"):
        node_shapes(0)
    gpu, cpu = node_manifest(shapes[0]), node_manifest(shapes[2])
    assert gpu["status"]["allocatable"][GPU_RESOURCE] == "8"
    assert GPU_RESOURCE not in cpu["status"]["allocatable"]
    assert gpu["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"


def test_kwok_config_joins_stage_documents(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("kind: Stage\nmetadata: {name: a}\n")
    (tmp_path / "b.yaml").write_text("kind: Stage\nmetadata: {name: b}\n")
    assert kwok_config(tmp_path) == (
        "kind: Stage\nmetadata: {name: a}\n---\nkind: Stage\nmetadata: {name: b}\n"
    )
    with pytest.raises(FileNotFoundError):
        kwok_config(tmp_path / "missing")


def test_certificates_chain_to_the_generated_ca(tmp_path: Path) -> None:
    pki = generate(tmp_path)
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    admin = x509.load_pem_x509_certificate(pki.admin_cert.read_bytes())
    serving.verify_directly_issued_by(ca)
    admin.verify_directly_issued_by(ca)
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kubernetes.default.svc" in names.get_values_for_type(x509.DNSName)
    assert admin.subject.rfc4514_string() == "O=system:masters,CN=dscache-dev-admin"
    assert pki.admin_key.stat().st_mode & 0o077 == 0


def test_shell_exports_are_quoted(tmp_path: Path) -> None:
    odd = tmp_path / "it's here"
    cluster = DevCluster(
        state_dir=odd,
        kubeconfig=odd / "kubeconfig",
        server="https://127.0.0.1:1",
        binaries=locate(PINNED, odd),
        node_count=1,
        processes=[],
    )
    script = cluster.shell_exports() + 'printf "%s\\n%s" "$KUBECONFIG" "$PATH"'
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/bin"}, check=True
    ).stdout.splitlines()
    assert out[0] == str(odd / "kubeconfig")
    assert out[1].split(":") == [*(str(d) for d in cluster.binaries.tool_dirs), "/bin"]
    assert json.dumps(cluster.env({"PATH": "/bin"})["KUBECONFIG"]) == json.dumps(out[0])


def test_images_go_to_each_real_nodes_containerd_and_a_cluster_without_one_says_so(
    tmp_path: Path,
) -> None:
    def cluster(real: tuple[str, ...]) -> DevCluster:
        return DevCluster(
            state_dir=tmp_path / "state",
            kubeconfig=tmp_path / "kubeconfig",
            server="https://127.0.0.1:1",
            binaries=locate(PINNED, tmp_path),
            node_count=1,
            processes=[],
            real_nodes=real,
        )

    sockets: list[Path] = []
    cluster(("dev-real-0", "dev-real-1")).load_images(sockets.append)
    assert [s.parent.parent.name for s in sockets] == ["dev-real-0", "dev-real-1"]
    assert all(s.name == "containerd.sock" for s in sockets)
    with pytest.raises(ClusterError, match="without real nodes"):
        cluster(()).load_images(sockets.append)


def test_start_never_wipes_a_foreign_directory(tmp_path: Path) -> None:
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ClusterError, match="holds no dev cluster state"):
        DevCluster.start(precious, binaries=locate(PINNED, tmp_path / "cache"))
    assert (precious / "notes.txt").read_text() == "keep me"


def test_start_never_overwrites_a_foreign_kubeconfig(tmp_path: Path) -> None:
    theirs = tmp_path / "config"
    theirs.write_text("apiVersion: v1\nkind: Config\ncurrent-context: prod\n")
    with pytest.raises(ClusterError, match="refusing to overwrite"):
        DevCluster.start(
            tmp_path / "state", kubeconfig=theirs, binaries=locate(PINNED, tmp_path / "cache")
        )
    assert "prod" in theirs.read_text()


def _pod(name: str, component: str, port: str, *, phase: str = "Running") -> dict[str, object]:
    return {
        "metadata": {
            "name": name,
            "namespace": "demo",
            "labels": {
                "app.kubernetes.io/name": "dscache",
                "app.kubernetes.io/component": component,
                "dscache.io/revision": "r1",
                "dscache.io/slot": "blue",
            },
        },
        "spec": {"containers": [{"name": "c", "ports": [{"name": port, "containerPort": 8000}]}]},
        "status": {"phase": phase, "podIP": f"10.0.0.{len(name)}"},
    }


def test_prometheus_scrapes_running_model_pods_only() -> None:
    # The router's port passes /metrics through to a model pod: scraping it
    # would count that pod's series a second time under the router's name.
    pods = {
        "items": [
            _pod("model-a", "model", "http"),
            _pod("router-b", "router", "http"),
            _pod("model-pending", "model", "http", phase="Pending"),
            _pod("model-grpc", "model", "grpc"),
        ]
    }
    (group,) = podsd.targets(pods)
    assert group["labels"]["pod"] == "model-a"
    assert group["labels"]["dscache_io_revision"] == "r1"
    assert group["targets"] == ["10.0.0.7:8000"]


@pytest.mark.parametrize(
    ("args", "timeout", "expected"),
    [
        (("rollout", "status", "deployment/x", "--timeout=600s"), 120.0, 630.0),
        (("delete", "dscd", "x", "--timeout=5m"), 120.0, 330.0),
        (("wait", "--timeout=1m30s"), 120.0, 120.0),
        (("wait", "--timeout=1h"), 120.0, 3630.0),
        (("get", "pods"), 120.0, 120.0),
        (("wait", "--timeout=soon"), 120.0, 120.0),
    ],
)
def test_a_kubectl_command_gets_its_own_timeout_and_more(
    args: tuple[str, ...], timeout: float, expected: float
) -> None:
    """``kubectl rollout status --timeout=600s`` through the dev cluster's wrapper was
    killed at the wrapper's 120 s: a vLLM pod that took over two minutes to start on
    a busy node failed a cluster test. A command's own timeout now wins, with 30 s
    for kubectl to give up and say so first."""
    assert _with_own(args, timeout) == expected
